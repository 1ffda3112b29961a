"""``shardline serve fleet`` refuses what it cannot reconcile before it serves, and waits out what it
cannot reach yet (the Kubernetes API server) instead of exiting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.cli import main
from services.common.config import child_environ
from services.common.healthcheck import check
from services.common.logging import STACKS_SIGNAL
from services.common.ports import free_port
from tests.router.processes import REPO, stop
from tests.stack import fresh_database

pytestmark = pytest.mark.waits  # on an API server that is not there yet (tests/lanes.py)


def test_an_unknown_fleet_or_none_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDLINE_FLEET", raising=False)
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    assert main(["serve", "fleet", "--port", "0", "--registry-url", url]) == 2
    assert "--fleet NAME, --spec FILE" in capsys.readouterr().err
    assert main(["serve", "fleet", "--port", "0", "--registry-url", url, "--fleet", "nope"]) == 2
    assert "no fleet nope in the registry" in capsys.readouterr().err


def test_a_bad_spec_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    bad = tmp_path / "bad.yaml"
    bad.write_text("replica_group: {name: BAD}\n")
    assert main(["serve", "fleet", "--port", "0", "--registry-url", url, "--spec", str(bad)]) == 2
    assert "DNS label" in capsys.readouterr().err


def test_the_rendered_controller_starts_without_an_api_server_reports_not_ready_and_retries(
        tmp_path: Path, postgres_url: str) -> None:
    """The controller Deployment of deploy/k8s/rendered/, its command line as rendered (the spec
    file at the ConfigMap's contents, a free port and the test's database in place of the
    cluster's), with nothing but the image's own contents: the official client, pointed by a
    kubeconfig at an API server that does not answer. It starts, says NOT_SERVING to the
    readiness probe, and keeps retrying, instead of exiting."""
    objects = list(yaml.safe_load_all((REPO / "deploy/k8s/rendered/shardline.yaml").read_text()))
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "shardline-fleet")
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "shardline-fleet-spec")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    (mount,) = container["volumeMounts"]
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    for name, text in config["data"].items():
        (spec_dir / name).write_text(text)
    port = free_port()
    args = [str(spec_dir) + a[len(mount["mountPath"]):] if a.startswith(mount["mountPath"]) else a
            for a in container["args"]]
    args[args.index("--port") + 1] = str(port)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{free_port()}",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "shardline"}}]}))
    with fresh_database(postgres_url, "k8s") as url:
        env = {**child_environ(), **{e["name"]: e["value"] for e in container["env"]},
               "SHARDLINE_HOST": "127.0.0.1", "SHARDLINE_REGISTRY_URL": url, "KUBECONFIG": str(kubeconfig)}
        env.pop("SHARDLINE_REDIS_URL")  # the cluster's Redis: not the test's business
        log = tmp_path / "fleet.log"
        with log.open("wb") as out:
            # the image's entry point, as installed in this environment
            command = [str(Path(sys.executable).with_name(container["command"][0])), *container["command"][1:]]
            proc = subprocess.Popen([*command, *args], cwd=tmp_path, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while "reconcile failed, retrying" not in log.read_text():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            time.sleep(3)  # a few reconciles more: it keeps trying, and stays up
            assert proc.poll() is None, log.read_text()
            assert check(f"127.0.0.1:{port}", timeout_s=5) == "NOT_SERVING"
            assert log.read_text().count("reconcile failed, retrying") >= 2, log.read_text()
            # asked where it is (as bench/_fleet_stack does when a controller stops acting): every
            # thread's stack in its log, the reconcile loop's among them, and it serves on
            os.kill(proc.pid, STACKS_SIGNAL)
            deadline = time.monotonic() + 10
            while "in _run" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            assert "Thread 0x" in log.read_text() and proc.poll() is None
        finally:
            stop(proc, timeout_s=20)


def test_the_fleet_and_quality_packages_import_no_torch() -> None:
    """The controller's process starts in half a second of CPU rather than two (it runs the
    workers; it never runs a model): none of its modules may pull torch in, not even through a
    live group's quality gate (the quality package is checked too). A fresh interpreter, since this
    one has torch already."""
    code = ("import importlib, pkgutil, sys, services.fleet, services.quality\n"
            "for p in (services.fleet, services.quality):\n"
            "    for m in pkgutil.iter_modules(p.__path__):\n"
            "        if m.name != '__main__':\n"
            "            importlib.import_module(f'{p.__name__}.{m.name}')\n"
            "heavy = sorted(n for n in ('torch', 'transformers', 'safetensors') if n in sys.modules)\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_environ(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
