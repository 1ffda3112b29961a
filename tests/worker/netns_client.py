"""Run inside a test's network namespace (``ip netns exec NS python -m tests.worker.netns_client``):
a driver's health, one greedy completion from it or through a router, the router's groups once idle,
or a telemetry service's windows and alerts of a group, printed as one JSON line."""

from __future__ import annotations

import json
import sys
import time

import grpc

from services.common.healthcheck import check
from services.common.proto import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    telemetry_pb2,
    telemetry_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)


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
    elif command == "route":  # a greedy stream through a router: "streaming" once `after` tokens came, then the result
        prompt, n, after = [int(t) for t in argv[2].split(",")], int(argv[3]), int(argv[4])
        ids, groups, finish = [], [], None
        with grpc.insecure_channel(address) as channel:
            for r in router_pb2_grpc.RouterServiceStub(channel).Generate(router_pb2.RouterGenerateRequest(
                    token_ids=common_pb2.TokenIds(ids=prompt),
                    sampling=common_pb2.SamplingParameters(temperature=0, max_tokens=n, ignore_eos=True)), timeout=120):
                if r.HasField("token"):
                    ids.append(r.token.token_id)
                    groups.append(r.replica_group_id)
                    if len(ids) == after:
                        print("streaming", flush=True)
                elif r.HasField("finished"):
                    finish = common_pb2.FinishReason.Name(r.finished.finish_reason)
        print(json.dumps({"ids": ids, "groups": groups, "finish_reason": finish}))
    elif command == "idle":  # until the router sees `n` healthy groups with nothing committed: the groups seen
        n, deadline, seen = int(argv[2]), time.monotonic() + float(argv[3]), []
        with grpc.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            while time.monotonic() < deadline:
                groups = stub.ListReplicaGroups(router_pb2.ListReplicaGroupsRequest(), timeout=10).groups
                seen = [[g.replica_group_id, common_pb2.ReplicaGroupStatus.Name(g.status), g.kv_bytes_committed,
                         g.running + g.waiting] for g in groups]
                if len(seen) == n and all(s == "REPLICA_GROUP_STATUS_HEALTHY" and not c + q for _, s, c, q in seen):
                    break
                time.sleep(0.2)
        print(json.dumps({"groups": seen}))
    elif command == "events":  # the telemetry service's windows of one group: [gpu_id, op_type, count]
        with grpc.insecure_channel(address) as channel:
            reply = telemetry_pb2_grpc.TelemetryServiceStub(channel).Query(
                telemetry_pb2.QueryRequest(replica_group_id=argv[2]), timeout=10)
        print(json.dumps({"windows": [[w.gpu_id, w.op_type, w.count] for w in reply.windows]}))
    elif command == "alerts":  # the group's alerts (retained ones first) until one names a node, or the deadline
        messages, deadline = [], time.monotonic() + float(argv[3])
        with grpc.insecure_channel(address) as channel:
            stream = telemetry_pb2_grpc.TelemetryServiceStub(channel).Alerts(
                telemetry_pb2.AlertsRequest(replica_group_id=argv[2]), timeout=float(argv[3]))
            try:
                for alert in stream:
                    messages.append(alert.message)
                    if "[on node " in alert.message or time.monotonic() > deadline:
                        break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
        print(json.dumps({"messages": messages}))
    elif command == "until-down":  # seconds until it stops saying SERVING (or the deadline)
        t0, deadline = time.monotonic(), time.monotonic() + float(argv[2])
        while (state := status(address)) == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        print(json.dumps({"status": state, "seconds": time.monotonic() - t0}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
