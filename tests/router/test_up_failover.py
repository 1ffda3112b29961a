"""`shardline up --replicas 2` when a worker process (a group's driver) is SIGKILLed mid-stream.

One stack for the module, on the tiny model: a fleet of two groups reconciled by the controller
in ``up``. The first test kills one group's worker under 8 concurrent greedy streams: each stream
completes with the fault-free run's tokens (the ones on the dead group continue on the other,
their later chunks naming it) or ends with an error event; the stack keeps serving; the registry
has the group dead with the exit code; the controller puts a new group of the same plan in
rotation and the router routes to it. The second kills both groups while `up` is paused (so
its controller cannot put a replacement in rotation first), so no group is left for a
continuation: HTTP streams (completions and chat) end with an error event then [DONE], gRPC
with UNAVAILABLE, a new request gets 503; both are replaced and serve. The last kills the router,
which stops the whole stack with a non-zero exit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from bench._fleet_stack import driver_pid
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from services.common.registry import ShardRegistry, registry_group_id
from tests.router.processes import REPO, serving_pid
from tests.router.test_up import our_processes, up_command

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
FLEET = "tiny-llama"  # the fleet `up` applies is named after the model directory
PROMPTS = [f"story number {i}: once upon a time" for i in range(8)]
MAX_TOKENS = 512  # ~1.5 s of the tiny model's steps: a kill mid-stream cannot miss on a busy host
LONG = 1000  # tokens of the streams that must still run when both workers die (3 fit the KV budget)


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.registry = f"sqlite:///{tmp / 'registry.db'}"
        argv, env, self.ports = up_command(tmp, "--replicas", "2", "--registry-url", self.registry)
        self.out = tmp / "up.out"
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        self.http = f"http://127.0.0.1:{self.ports['http']}/v1"
        self.client = openai.OpenAI(base_url=self.http, api_key="none", max_retries=0, timeout=60)

    def log(self) -> str:
        return self.out.read_text()

    def wait_log(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while not (match := re.search(pattern, self.log())):
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout_s} s:\n{self.log()}"
            time.sleep(0.2)
        return match

    def groups(self) -> dict[str, str]:
        """The fleet's live groups in the registry: name -> worker address."""
        with ShardRegistry(self.registry) as registry:
            return {g.name: g.endpoint for g in registry.fleet_groups(FLEET) if g.status in ("healthy", "degraded")}

    def wait_groups(self, count: int, timeout_s: float, without: set[str] = frozenset()) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while len(groups := {n: a for n, a in self.groups().items() if n not in without}) < count:
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"not {count} groups in rotation within {timeout_s} s:\n{self.log()}"
            time.sleep(0.2)
        return groups

    def kill(self, group: str, pid: int | None = None) -> str:
        """SIGKILL the group's worker process (its driver; ``pid`` if the caller has looked it up)."""
        os.kill(pid or driver_pid(group), signal.SIGKILL)
        return group


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("up-failover"))
    try:
        s.wait_log(r"Ctrl-C stops the stack\.", 240)
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                s.proc.kill()


def stream(client: openai.OpenAI, prompt: str, progress: list[tuple[str, int]], i: int) -> dict:
    """One greedy streamed completion with per-token logprobs: its tokens, the group of each
    chunk, the header's group, and the error event if it ended with one."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0, logprobs=2, stream=True,
                                                      extra_body={"ignore_eos": True})
    result = {"header": raw.headers["x-shardline-replica-group-id"], "tokens": [], "logprobs": [], "top": [],
              "groups": [], "finish": None, "error": None}
    try:
        for chunk in raw.parse():
            choice = chunk.choices[0]
            result["groups"].append(chunk.replica_group_id)
            if choice.finish_reason:
                result["finish"] = choice.finish_reason
            elif choice.logprobs is not None:
                result["tokens"] += choice.logprobs.tokens
                result["logprobs"] += choice.logprobs.token_logprobs
                result["top"] += choice.logprobs.top_logprobs
                progress[i] = (result["header"], len(result["tokens"]))
    except openai.APIError as exc:  # the stream's error event
        result["error"] = str(exc)
    return result


def agreeing_prefix(ref: dict, got: dict) -> int:
    """Tokens equal to the fault-free run's, all of them or up to a greedy tie: a continuation
    prefills the tokens the dead group had decoded, whose float rounding differs from decoding
    them, so where the tiny random model's two best tokens are within 1e-3 the argmax may flip."""
    for i, (a, b) in enumerate(zip(got["tokens"], ref["tokens"])):
        if a != b:
            alternatives = ref["top"][i]
            assert a in alternatives and abs(alternatives[a] - ref["logprobs"][i]) < 1e-3, (
                f"token {i}: {a!r} where the fault-free run had {b!r} ({alternatives})")
            return i
    return len(ref["tokens"])


def run_streams(client: openai.OpenAI, during=None) -> list[dict]:
    progress = [("", 0)] * len(PROMPTS)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, client, p, progress, i) for i, p in enumerate(PROMPTS)]
        if during is not None:
            during(progress)
        return [f.result(timeout=120) for f in futures]


def test_killed_worker_fails_over_is_marked_dead_and_replaced(stack, alone):
    first, other = sorted(stack.wait_groups(2, 60))
    alone.reserve()  # no test starts beside the reference streams: the block after them need not wait
    for _round in range(3):  # the router passes over a group running a shadow Score, for a whole round at times
        reference = run_streams(stack.client)
        if {r["header"] for r in reference} == {first, other}:
            break
    assert all(r["error"] is None and len(r["tokens"]) == MAX_TOKENS for r in reference), reference
    assert {r["header"] for r in reference} == {first, other}  # both groups took streams

    killed: list[str] = []
    victim_pid = driver_pid(first)  # looked up before the streams: the kill follows the check at once

    def kill_mid_stream(progress: list[tuple[str, int]]) -> None:
        # mid-stream: a client has read tokens of a stream on the first group, so its engine has
        # produced them and, with 512 per stream (~1.5 s of steps), has most still to make however
        # far behind the clients read (one group's streams, decoded in lockstep, were read 70
        # tokens apart). The router may send every stream of a round to the other group (one
        # running a shadow Score is passed over): that round is run again
        deadline = time.monotonic() + 60
        while not any(group == first and n >= 4 for group, n in progress):
            if all(n == MAX_TOKENS for _, n in progress):
                return
            assert time.monotonic() < deadline, progress
            time.sleep(0.005)
        killed.append(stack.kill(first, victim_pid))

    with alone():  # the kill must land while the group decodes (see kill_mid_stream): a busy core misses it
        for _round in range(3):
            t_kill = time.monotonic()
            faulty = run_streams(stack.client, kill_mid_stream)
            if killed:
                break
            print(f"no stream went to {first}: the round is run again")
    assert killed, f"{first} was never caught mid-stream in 3 rounds"
    dead = killed[0]
    identical = errored = continued = before_first = 0
    continued_on: set[str] = set()
    ties: list[int] = []
    for ref, got in zip(reference, faulty):
        if got["error"] is not None:
            errored += 1
            continue
        assert got["finish"] == "length" and len(got["tokens"]) == MAX_TOKENS
        same = agreeing_prefix(ref, got)
        assert got["logprobs"][:same] == pytest.approx(ref["logprobs"][:same], abs=1e-4)
        if same < MAX_TOKENS:
            ties.append(same)
        identical += same == MAX_TOKENS
        if got["header"] == dead and got["groups"][-1] != dead:
            # continued on another group: every chunk from the switch on names it, the last one too.
            # That is the other group, or the replacement when the controller had put it in rotation
            # by then (a replica group forked from the provisioner's fork server serves within a second)
            continued += 1
            switch = next(i for i, g in enumerate(got["groups"]) if g != dead)
            assert set(got["groups"][switch:]) == {got["groups"][-1]}
            continued_on.add(got["groups"][-1])
            assert set(got["groups"][:switch]) <= {dead}
            before_first += switch == 0  # the dead group had produced no token of it
    print(f"\n{identical} of {len(PROMPTS)} streams completed identically ({continued} continued on "
          f"another group, {before_first} of them before their first token), {errored} ended with an error event; "
          f"{len(ties)} agreed up to a greedy tie (at tokens {ties})")
    assert identical + len(ties) + errored == len(PROMPTS) and continued - before_first >= 1

    stack.wait_log(rf"fleet {FLEET}: dead group={dead} status=healthy reason=worker process exited with code -9", 30)
    registry = ShardRegistry(stack.registry)
    try:
        group = registry.get_group(registry_group_id(dead))
        assert group.status == "dead" and "exited with code -9" in group.status_reason
    finally:
        registry.close()

    # the stack keeps serving: on the group that is left, or on the replacement if the controller
    # has already put it in rotation (on a fast machine it can be serving within a second or two)
    done = stack.client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4 and done.replica_group_id != dead
    assert done.replica_group_id == other or done.replica_group_id in stack.groups()

    # the controller puts a new group of the same plan in rotation, and the router routes to it
    (new,) = set(stack.wait_groups(2, 120, without={dead})) - {other}
    with ShardRegistry(stack.registry) as registry:
        plans = {g.name: (g.tp_degree, g.pp_degree, g.dtype)
                 for g in registry.fleet_groups(FLEET, include_dead=True)}
    assert plans[new] == plans[dead], plans
    assert continued_on <= {other, new}, (continued_on, other, new)
    print(f"{dead} replaced by {new}, in rotation {time.monotonic() - t_kill:.1f} s after the kill")
    deadline = time.monotonic() + 30
    seen: set[str] = set()
    while new not in seen:
        assert time.monotonic() < deadline, f"the router never routed to {new}: {seen}"
        with ThreadPoolExecutor(4) as pool:  # concurrent, so that routing by headroom spreads them
            seen |= set(pool.map(lambda _: stack.client.completions.create(
                model=MODEL, prompt="hello", max_tokens=8, temperature=0).replica_group_id, range(4)))
    assert dead not in seen
    # a non-streaming answer names its group in the body and both headers
    raw = stack.client.completions.with_raw_response.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
    body = raw.parse()
    assert raw.headers["x-shardline-replica-group-id"] == raw.headers["x-shardline-replica-group-ids"] \
        == body.replica_group_id != dead


def grpc_stream(address: str, progress: list[int]) -> tuple[int, grpc.StatusCode | None, str]:
    request = router_pb2.RouterGenerateRequest(model=MODEL, text="a long story", sampling=common_pb2.SamplingParameters(
        temperature=0.0, max_tokens=LONG, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        try:
            for response in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=120):
                progress[0] += response.HasField("token")
        except grpc.RpcError as exc:
            return progress[0], exc.code(), exc.details()
    return progress[0], None, ""


def sse_stream(url: str, body: dict, progress: list[int], i: int) -> tuple[int, list[str]]:
    """The status and the data lines of a raw SSE response."""
    with httpx.stream("POST", url, json={**body, "model": MODEL, "stream": True, "max_tokens": LONG,
                                         "ignore_eos": True, "temperature": 0}, timeout=120) as response:
        data = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
                progress[i] = len(data)
        return response.status_code, data


def test_streams_end_with_an_error_when_no_group_is_left(stack):
    serving = stack.wait_groups(2, 120)
    progress = [0, 0, 0]  # tokens (gRPC) and data lines (SSE) each stream has received
    with ThreadPoolExecutor(3) as pool:
        grpc_future = pool.submit(grpc_stream, f"127.0.0.1:{stack.ports['router']}", progress)
        completion = pool.submit(sse_stream, f"{stack.http}/completions", {"prompt": "a long story"}, progress, 1)
        chat = pool.submit(sse_stream, f"{stack.http}/chat/completions",
                           {"messages": [{"role": "user", "content": "a long story"}]}, progress, 2)
        deadline = time.monotonic() + 30
        while min(progress) < 4:  # all three streaming
            assert time.monotonic() < deadline, progress
            time.sleep(0.01)
        # `up` (its fleet controller) is paused while both groups die, so that no replacement can
        # come into rotation in time to continue the streams: that is the first test's case
        os.kill(stack.proc.pid, signal.SIGSTOP)
        try:
            first, second = (stack.kill(group) for group in sorted(serving))
            tokens, code, details = grpc_future.result(timeout=120)
            streams = [completion.result(timeout=120), chat.result(timeout=120)]
            # a request while no group is left: 503, not a hang
            with pytest.raises(openai.APIStatusError) as refused:
                stack.client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
        finally:
            os.kill(stack.proc.pid, signal.SIGCONT)
    assert code == grpc.StatusCode.UNAVAILABLE and tokens > 0, (tokens, code, details)
    assert details, "UNAVAILABLE with a message"
    for status, data in streams:
        assert status == 200
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["type"] and error["message"], error
        assert len(data) > 3  # tokens came before the error
    assert refused.value.status_code == 503

    for group in (first, second):
        stack.wait_log(rf"fleet {FLEET}: dead group={group} status=\w+ reason=worker process exited with code -9", 30)
    replacements = stack.wait_groups(2, 120, without={first, second})
    deadline = time.monotonic() + 30
    while True:
        try:
            done = stack.client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
            break
        except openai.APIStatusError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert done.replica_group_id in replacements
    assert stack.proc.poll() is None  # the stack never stopped


def test_the_routers_death_stops_the_stack(stack):
    os.kill(serving_pid("router", stack.ports["router"]), signal.SIGKILL)
    assert stack.proc.wait(timeout=60) == 1, stack.log()
    assert "router exited with code -9: the router is the stack's front door, so the stack stops" in stack.log()
    assert "shardline up: stopping the stack" in stack.log()
    assert our_processes(stack.ports) == []  # the replica groups too: they name the stack's directory
