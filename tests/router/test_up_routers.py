"""`shardline up --routers 2`: two routers in front of one fleet, one SIGKILLed under load.

The group's KV budget is small (``--kv-cache-gb 0.005``: a few streams of 100 tokens at once), so
both routers keep their queues full and the budget binds. A client spreads 16 greedy streams over
the two routers (as a load balancer would: a request whose connection a router refuses, or resets
before any answer, passes to the other). Fault-free, every stream ends with its reference text.
Then one router is SIGKILLed while its streams decode: the streams on it break (a killed process
sends no error event), every stream on the other router and every request sent after the kill
completes with the reference text, the worker's own stats show it never admitted past its KV budget and holds
no claim of the dead router's streams afterwards, and `up` starts the router again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from services.common.proto import worker_pb2, worker_pb2_grpc
from services.common.registry import ShardRegistry
from tests.router.processes import running_up, serving_pid
from tests.router.test_up import up_command

pytestmark = pytest.mark.slow

MODEL = FLEET = "tiny-llama"
STREAMS = 16
MAX_TOKENS = 100
# half the default `--kv-cache-gb 0.01` of up_command: the same few streams at once as 200 tokens
# there, at half the decoding (the module's CPU is its tokens: 16 streams a round, two rounds)
KV_CACHE_GB = "0.005"


def complete(bases: list[str], first: int, prompt: str, progress: list[int], i: int) -> dict:
    """One greedy streamed completion through ``bases[first]``, or the next router if that one
    refuses or resets the connection before answering: its text, the router that took it, and how
    it ended."""
    result = {"text": "", "router": None, "finish": None, "error": None}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    for k in range(len(bases)):
        router = result["router"] = (first + k) % len(bases)
        answered = False
        try:
            with httpx.stream("POST", f"{bases[router]}/completions", json=body, timeout=60) as response:
                answered = True
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result["error"] = chunk["error"]["message"]
                        continue
                    choice = chunk["choices"][0]
                    result["text"] += choice["text"]
                    result["finish"] = choice["finish_reason"] or result["finish"]
                    progress[i] += 1
            return result
        except httpx.ConnectError:
            continue  # nobody listens there: the next router
        except httpx.HTTPError as exc:
            if not answered:
                # A router killed a moment ago can still accept a connection into its listen
                # backlog, which the kernel then resets: no response began, so the balancer
                # passes the request on, as it does for a refused connection.
                continue
            result["error"] = f"{type(exc).__name__}: {exc}"  # the router died mid-stream
            return result
    raise AssertionError(f"no router took stream {i}")


PROMPTS = [f"router test {i}: the fleet said" for i in range(STREAMS)]


def run_round(bases: list[str], during=None) -> tuple[list[dict], list[dict]]:
    """16 streams spread over the routers; ``during(progress)`` returns prompts to send once it
    has acted (the requests sent afterwards), whose results come second."""
    progress = [0] * STREAMS
    with ThreadPoolExecutor(STREAMS + 8) as pool:
        futures = [pool.submit(complete, bases, i % len(bases), p, progress, i) for i, p in enumerate(PROMPTS)]
        later = []
        if during is not None:
            later_prompts = during(progress)
            later_progress = [0] * len(later_prompts)
            later = [pool.submit(complete, bases, j % len(bases), p, later_progress, j)
                     for j, p in enumerate(later_prompts)]
        return [f.result(timeout=180) for f in futures], [f.result(timeout=180) for f in later]


def worker_stats(registry: str) -> worker_pb2.StatsResponse:
    with ShardRegistry(registry) as reg:
        [group] = [g for g in reg.fleet_groups(FLEET) if g.status in ("healthy", "degraded")]
    with grpc.insecure_channel(group.endpoint) as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)


def test_two_routers_share_one_budget_and_a_killed_router_loses_only_its_own_streams(tmp_path):
    registry = f"sqlite:///{tmp_path / 'registry.db'}"
    argv, env, ports = up_command(tmp_path, "--routers", "2", "--registry-url", registry,
                                    "--kv-cache-gb", KV_CACHE_GB)
    bases = [f"http://127.0.0.1:{ports['http'] + i}/v1" for i in range(2)]
    with running_up(argv, env, tmp_path / "up.out") as out:
        log = out.read_text()
        assert f"and router gRPC 127.0.0.1:{ports['router'] + 1}, OpenAI HTTP {bases[1]}" in log, log
        stats = worker_stats(registry)
        claim = (8 + MAX_TOKENS) * stats.kv_bytes_per_token  # a prompt is under 16 tokens
        assert STREAMS * claim > stats.kv_bytes_capacity  # the budget binds: some streams wait

        reference, _ = run_round(bases)
        assert all(r["error"] is None and r["finish"] == "length" for r in reference), reference
        assert {r["router"] for r in reference} == {0, 1}
        texts = [r["text"] for r in reference]

        victim = serving_pid("router", ports["router"] + 1)
        killed_at = []

        def kill_mid_stream(progress: list[int]) -> list[str]:
            deadline = time.monotonic() + 60
            # router 1's streams decode (3 or more of them: the others wait in its queue)
            while sum(progress[i] >= 4 for i in range(1, STREAMS, 2)) < 3:
                assert time.monotonic() < deadline, progress
                time.sleep(0.005)
            os.kill(victim, signal.SIGKILL)
            killed_at.append(list(progress))
            return PROMPTS[:8]  # sent after the kill, spread over both routers as before

        during, after = run_round(bases, kill_mid_stream)
        broken = [i for i, r in enumerate(during) if r["error"] is not None]
        print(f"router 1 killed with the streams at {killed_at[0]} tokens; {len(broken)} of its 8 streams broke "
              f"({sum(bool(during[i]['text']) for i in broken)} mid-stream, the others queued in it): "
              f"{sorted({during[i]['error'][:60] for i in broken})}")
        for i, r in enumerate(during):
            if r["router"] == 0 or r["error"] is None:  # the other router's, and any that had ended
                assert r["error"] is None and r["text"] == texts[i], (i, r)
            else:
                assert r["router"] == 1 and texts[i].startswith(r["text"]), (i, r)
        assert broken and all(during[i]["router"] == 1 for i in broken)
        for j, r in enumerate(after):  # sent after the kill: none fails
            assert r["error"] is None and r["text"] == texts[j], (j, r)

        # the worker's own account: never past its budget, and the dead router's claims are gone
        deadline = time.monotonic() + 15
        while (stats := worker_stats(registry)).kv_bytes_admitted or stats.running or stats.waiting:
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        assert 0 < stats.kv_bytes_admitted_peak <= stats.kv_bytes_capacity, stats
        print(f"worker: peak admitted {stats.kv_bytes_admitted_peak} of {stats.kv_bytes_capacity} bytes, "
              f"{stats.kv_budget_refusals} claims refused (the other router had taken the headroom)")

        # `up` started the router again at its ports
        deadline = time.monotonic() + 120
        while "SERVING again" not in (log := out.read_text()):
            assert time.monotonic() < deadline, log
            time.sleep(0.2)
        again = complete([bases[1]], 0, PROMPTS[1], [0], 0)
        assert again["error"] is None and again["text"] == texts[1] and again["router"] == 0
