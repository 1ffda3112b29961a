"""`shardline up` end to end on the tiny model: start-up, the streamed demo, HTTP, clean stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from services.common.config import child_environ
from tests.router.processes import REPO
from tests.stack import free_port


def up_command(tmp_path: Path, *extra: str) -> tuple[list[str], dict[str, str], dict[str, int]]:
    ports = {"router": free_port(), "http": free_port(), "base": free_port(), "tmp": str(tmp_path)}
    # the internal services take base .. base+3; a free port's neighbours are free in practice,
    # and a clash fails loudly (the service exits and `up` reports it)
    argv = [sys.executable, "-m", "services.cli", "up", "--model", "tiny", "--port", str(ports["router"]),
            "--http-port", str(ports["http"]), "--port-base", str(ports["base"]), "--kv-cache-gb", "0.01",
            "--log-dir", str(tmp_path / "logs"), *extra]
    env = child_environ(SHARDLINE_MODEL_CACHE=str(tmp_path / "models"), SHARDLINE_STATE_DIR=str(tmp_path / "state"))
    return argv, env, ports


def our_processes(ports: dict) -> list[str]:
    """Command lines of live processes serving on any of the stack's ports, or naming its
    directory (the replica groups take free ports; their registry is in the stack's state dir)."""
    wanted = {str(p) for p in (ports["router"], *range(ports["base"], ports["base"] + 3))}
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "serve" in args and (any(a == "--port" and b in wanted for a, b in zip(args, args[1:]))
                                or any(ports["tmp"] in a for a in args)):
            found.append(" ".join(args))
    return found


def test_up_streams_the_demo_and_exits_0(tmp_path):
    prompt = "hello world"
    argv, env, ports = up_command(tmp_path, "--exit-after-demo", "--demo-prompt", prompt, "--demo-max-tokens", "24")
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    model_dir = tmp_path / "models" / "tiny-llama"
    assert f"making the tiny model in {model_dir}" in out
    for name in ("telemetry", "loader", "planner", "router"):
        assert f"  {name:<10} 127.0.0.1:" in out
    assert re.search(r"\n  tiny-llama-[0-9a-f]{6} 127\.0\.0\.1:\d+ +SERVING", out), out  # the fleet's one group
    assert (f"shardline is up: router gRPC 127.0.0.1:{ports['router']}, "
            f"OpenAI HTTP http://127.0.0.1:{ports['http']}/v1") in out
    streamed, summary = out.split(f"demo: {prompt}", 1)[1].split("\n[", 1)
    assert summary.startswith("length: 12 prompt + 24 completion tokens on tiny-llama-")
    # the same greedy request through `shardline generate` gives the same text
    reference = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", str(model_dir),
                                "--prompt", prompt, "--max-tokens", "24", "--json"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert reference.returncode == 0, reference.stderr
    assert streamed == json.loads(reference.stdout)["text"] and streamed
    assert our_processes(ports) == []


def test_up_serves_http_until_sigterm_and_leaves_no_process(tmp_path):
    argv, env, ports = up_command(tmp_path, "--demo-prompt", "hello")
    log = tmp_path / "up.out"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops the stack." not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="none", max_retries=0)
        done = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=5, temperature=0)
        assert done.usage.completion_tokens == 5 and done.replica_group_id.startswith("tiny-llama-")
        assert len(our_processes(ports)) == 5  # telemetry, loader, planner, worker, router
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "shardline up: stopping the stack" in log.read_text()
    assert our_processes(ports) == []
