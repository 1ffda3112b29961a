"""Run inside a test's network namespace (``ip netns exec NS python -m tests.worker.netns_client``):
a driver's health, or one greedy completion from it, printed as one JSON line."""

from __future__ import annotations

import json
import sys
import time

import grpc

from services.common.healthcheck import check
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc


def status(address: str) -> str:
    try:
        return check(address, timeout_s=1.0)
    except grpc.RpcError:
        return "GONE"


def main(argv: list[str]) -> int:
    command, address = argv[0], argv[1]
    if command == "wait":  # until SERVING or the deadline: the last status
        deadline = time.monotonic() + float(argv[2])
        while (state := status(address)) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.2)
        print(json.dumps({"status": state}))
    elif command == "generate":
        prompt, n = [int(t) for t in argv[2].split(",")], int(argv[3])
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            events = stub.Generate(worker_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParameters(temperature=0, max_tokens=n, ignore_eos=True)), timeout=60)
            ids = [e.token.token_id for e in events if e.WhichOneof("event") == "token"]
        print(json.dumps({"ids": ids}))
    elif command == "until-down":  # seconds until it stops saying SERVING (or the deadline)
        t0, deadline = time.monotonic(), time.monotonic() + float(argv[2])
        while (state := status(address)) == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        print(json.dumps({"status": state, "seconds": time.monotonic() - t0}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
