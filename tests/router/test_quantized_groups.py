"""Quantized replica groups served end to end: `shardline up --dtype int8|fp8` on SmolLM2-135M
streams with the official `openai` client, the router and the registry report the group's dtype,
and one router serves a bfloat16 group and an int8 group side by side."""

from __future__ import annotations

import json
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from tests.cli import run_cli
from tests.router.processes import running_up, start_service, stop, wait_healthy, wait_serving
from tests.router.test_up import up_command
from tests.stack import free_port

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def group_dtypes(router: str) -> dict[str, str]:
    with grpc.insecure_channel(router) as channel:
        groups = router_pb2_grpc.RouterServiceStub(channel).ListReplicaGroups(
            router_pb2.ListReplicaGroupsRequest(), timeout=10).groups
    return {g.replica_group_id: common_pb2.Dtype.Name(g.layout.dtype) for g in groups}


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_up_serves_smollm2_quantized(smollm2_dir: Path, tmp_path: Path, dtype: str) -> None:
    registry = tmp_path / "registry.db"
    argv, env, ports = up_command(tmp_path, "--model", str(smollm2_dir), "--dtype", dtype,
                                  "--registry-url", f"sqlite:///{registry}", "--kv-cache-gb", "0.05")
    with running_up(argv, env, tmp_path / "up.out"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="none", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert set(group_dtypes(f"127.0.0.1:{ports['router']}").values()) == {f"DTYPE_{dtype.upper()}"}
    # the same greedy tokens as `shardline generate` at that dtype on its own
    reference = run_cli("generate", "--model", str(smollm2_dir), "--dtype", dtype, "--prompt", PROMPT,
                        "--max-tokens", "16", "--json")
    assert reference.returncode == 0, reference.stderr
    assert text == json.loads(reference.stdout)["text"] and text.strip()
    with sqlite3.connect(registry) as db:
        assert {row[0] for row in db.execute("SELECT dtype FROM replica_groups")} == {dtype}


def test_one_router_serves_bfloat16_and_int8_groups(tiny_model_dir: Path, tmp_path: Path) -> None:
    procs, workers = [], []
    try:
        for dtype in ("bfloat16", "int8"):
            log = tmp_path / f"worker-{dtype}.log"
            proc, address = start_service("worker", ["--model", str(tiny_model_dir), "--served-model-name", "tiny",
                                                     "--dtype", dtype, "--kv-cache-gb", "0.01",
                                                     "--replica-group-id", f"rg-{dtype}"], log)
            procs.append(proc)
            wait_serving(proc, address, log)
            workers += ["--worker", address]
        http_port = free_port()
        router, router_address = start_service("router", ["--model", str(tiny_model_dir), "--served-model-name",
                                                          "tiny", "--http-port", str(http_port), *workers],
                                               tmp_path / "router.log")
        procs.append(router)
        wait_serving(router, router_address, tmp_path / "router.log", timeout_s=30)
        http = f"http://127.0.0.1:{http_port}"
        wait_healthy(http)
        assert group_dtypes(router_address) == {"rg-bfloat16": "DTYPE_BFLOAT16", "rg-int8": "DTYPE_INT8"}

        def one(i: int) -> str:
            response = httpx.post(f"{http}/v1/completions", json={
                "model": "tiny", "prompt": f"story {i}", "max_tokens": 48, "temperature": 0, "ignore_eos": True},
                timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 48
            return response.headers["x-shardline-replica-group-id"]

        with ThreadPoolExecutor(8) as pool:
            served = set(pool.map(one, range(16)))
        assert served == {"rg-bfloat16", "rg-int8"}  # KV headroom routing used both
    finally:
        for proc in reversed(procs):
            stop(proc, timeout_s=20)
