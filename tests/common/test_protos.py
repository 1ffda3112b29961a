"""The protobuf contracts: generated code is current, CollectiveEvent keeps its 8 fields, and
the conventions (a `///` comment on every field, prefixed enums, the streaming shapes) hold."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from services.common import protogen
from services.common.proto import common_pb2, loader_pb2, planner_pb2, router_pb2, telemetry_pb2, worker_pb2

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_matches_protos() -> None:
    """Fails when someone edited a .proto (or the toolchain changed) without regenerating."""
    result = subprocess.run(
        [sys.executable, "-m", "services.common.protogen", "--check"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, (
        "generated code is stale; run `python -m services.common.protogen`\n" + result.stdout + result.stderr
    )


def test_check_names_stale_missing_and_extra_files(tmp_path: Path) -> None:
    expected = protogen.render()
    protogen.write(expected, tmp_path)
    assert protogen.drift(expected, tmp_path).clean

    stale = "shardline/v1/telemetry_pb2.py"
    missing = "shardline/v1/worker_pb2_grpc.py"
    (tmp_path / stale).write_bytes(b"# edited by hand\n")
    (tmp_path / missing).unlink()
    (tmp_path / "shardline/v1/old_pb2.py").write_bytes(b"")
    found = protogen.drift(expected, tmp_path)
    assert found.stale == (stale,)
    assert found.missing == (missing,)
    assert found.extra == ("shardline/v1/old_pb2.py",)
    assert "stale: services/common/proto/shardline/v1/telemetry_pb2.py" in found.report()

    protogen.write(expected, tmp_path)
    assert protogen.drift(expected, tmp_path).clean


def test_collective_event_keeps_the_seeds_eight_fields_and_extends_them() -> None:
    fields = telemetry_pb2.CollectiveEvent.DESCRIPTOR.fields
    actual = [(f.name, f.number, f.type) for f in fields]
    assert actual[:8] == [
        ("replica_group_id", 1, FieldDescriptor.TYPE_STRING),
        ("gpu_id", 2, FieldDescriptor.TYPE_STRING),
        ("op_type", 3, FieldDescriptor.TYPE_STRING),
        ("bytes", 4, FieldDescriptor.TYPE_INT64),
        ("duration_ms", 5, FieldDescriptor.TYPE_DOUBLE),
        ("group_size", 6, FieldDescriptor.TYPE_INT32),
        ("timestamp_ms", 7, FieldDescriptor.TYPE_INT64),
        ("timed_out", 8, FieldDescriptor.TYPE_BOOL),
    ]
    # added later, under new numbers: an old reader skips them
    assert actual[8:] == [("peer_lost", 9, FieldDescriptor.TYPE_BOOL), ("seq", 10, FieldDescriptor.TYPE_UINT64),
                          ("communicator", 11, FieldDescriptor.TYPE_STRING)]
    assert telemetry_pb2.CollectiveEvent.DESCRIPTOR.full_name == "shardline.v1.CollectiveEvent"


@pytest.mark.parametrize(
    ("module", "service", "method", "client_streaming", "server_streaming"),
    [
        (worker_pb2, "WorkerService", "Generate", False, True),
        (worker_pb2, "WorkerService", "Score", False, False),
        (worker_pb2, "WorkerService", "Stats", False, False),
        (worker_pb2, "WorkerService", "Drain", False, False),
        (router_pb2, "RouterService", "Generate", False, True),
        (router_pb2, "RouterService", "ListModels", False, False),
        (router_pb2, "RouterService", "ListReplicaGroups", False, False),
        (planner_pb2, "PlannerService", "Plan", False, False),
        (planner_pb2, "PlannerService", "Explain", False, False),
        (planner_pb2, "PlannerService", "Capacity", False, False),
        (planner_pb2, "PlannerService", "RecordPlan", False, False),
        (loader_pb2, "LoaderService", "RegisterManifest", False, False),
        (loader_pb2, "LoaderService", "GetManifest", False, False),
        (loader_pb2, "LoaderService", "ListManifests", False, False),
        (loader_pb2, "LoaderService", "Stage", False, False),
        (telemetry_pb2, "TelemetryService", "Report", True, False),
        (telemetry_pb2, "TelemetryService", "Query", False, False),
        (telemetry_pb2, "TelemetryService", "Alerts", False, True),
    ],
)
def test_rpc_shapes(module, service: str, method: str, client_streaming: bool, server_streaming: bool) -> None:
    desc = module.DESCRIPTOR.services_by_name[service]
    assert desc.full_name == f"shardline.v1.{service}"
    rpc = desc.methods_by_name[method]
    assert (rpc.client_streaming, rpc.server_streaming) == (client_streaming, server_streaming)
    # A Request/Response pair per rpc (Alerts streams the Alert messages themselves).
    assert rpc.input_type.name.endswith(f"{method}Request")
    if method != "Alerts":
        assert rpc.output_type.name.endswith(f"{method}Response")


def test_fixed_contract_details() -> None:
    assert [v.name for v in common_pb2.Dtype.DESCRIPTOR.values] == [
        "DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_BFLOAT16", "DTYPE_FLOAT16", "DTYPE_INT8", "DTYPE_FP8",
    ]
    assert [v.name for v in common_pb2.FinishReason.DESCRIPTOR.values] == [
        "FINISH_REASON_UNSPECIFIED", "FINISH_REASON_LENGTH", "FINISH_REASON_EOS_TOKEN",
        "FINISH_REASON_STOP_SEQUENCE", "FINISH_REASON_CANCELLED", "FINISH_REASON_ERROR",
    ]
    # The prompt is text or token ids, never both.
    request = worker_pb2.GenerateRequest(text="hi")
    request.token_ids.ids.extend([1, 2])
    assert request.WhichOneof("prompt") == "token_ids" and request.text == ""
    # Unset sampling fields are distinguishable from explicit (possibly invalid) zeros.
    sampling = common_pb2.SamplingParameters()
    assert not sampling.HasField("top_p")
    sampling.top_p = 0.0
    assert sampling.HasField("top_p")
    # Planner candidates carry every key of issue 6's JSON.
    candidate_fields = {f.name for f in planner_pb2.Candidate.DESCRIPTOR.fields}
    assert {
        "tp", "pp", "dtype", "gpus", "feasible", "rejected_reason", "weight_bytes_per_gpu",
        "kv_bytes_per_token_per_gpu", "kv_tokens_per_gpu", "max_concurrent_sequences",
        "replicas_per_node", "predicted_tpot_ms", "tokens_per_s_per_replica",
        "usd_per_million_tokens", "bubble_fraction", "shortfall_bytes",
    } <= candidate_fields


def _descriptor_set_with_comments() -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        files = [str(p.relative_to(protogen.PROTO_ROOT)) for p in protogen.proto_files()]
        code = protoc.main([
            "grpc_tools.protoc", f"--proto_path={protogen.PROTO_ROOT}",
            f"--descriptor_set_out={out}", "--include_source_info", *files,
        ])
        assert code == 0
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _uncommented(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Names of fields, enum values and rpcs without a `///` leading comment."""
    comments = {
        tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location
    }

    def has_doc(path: tuple[int, ...]) -> bool:
        # protoc strips the `//`, so `/// text` arrives as `/ text`.
        return comments.get(path, "").startswith("/")

    missing: list[str] = []

    def visit_enum(enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], scope: str) -> None:
        for i, value in enumerate(enum.value):
            if not has_doc((*path, 2, i)):
                missing.append(f"{scope}{enum.name}.{value.name}")

    def visit_message(msg: descriptor_pb2.DescriptorProto, path: tuple[int, ...], scope: str) -> None:
        for i, field in enumerate(msg.field):
            if not has_doc((*path, 2, i)):
                missing.append(f"{scope}{msg.name}.{field.name}")
        for i, nested in enumerate(msg.nested_type):
            if not nested.options.map_entry:  # a map field's synthetic entry type: nothing to comment
                visit_message(nested, (*path, 3, i), f"{scope}{msg.name}.")
        for i, enum in enumerate(msg.enum_type):
            visit_enum(enum, (*path, 4, i), f"{scope}{msg.name}.")

    for i, msg in enumerate(file.message_type):
        visit_message(msg, (4, i), "")
    for i, enum in enumerate(file.enum_type):
        visit_enum(enum, (5, i), "")
    for i, service in enumerate(file.service):
        for j, method in enumerate(service.method):
            if not has_doc((6, i, 2, j)):
                missing.append(f"{service.name}.{method.name}")
    return missing


def test_every_field_enum_value_and_rpc_has_a_doc_comment() -> None:
    descriptor_set = _descriptor_set_with_comments()
    assert {f.name for f in descriptor_set.file} == {
        f"shardline/v1/{n}.proto" for n in ("common", "worker", "router", "planner", "loader", "telemetry")
    }
    missing = [f"{f.name}: {name}" for f in descriptor_set.file for name in _uncommented(f)]
    assert missing == []


def test_enum_values_are_prefixed_and_zero_is_unspecified() -> None:
    descriptor_set = _descriptor_set_with_comments()
    for file in descriptor_set.file:
        assert file.package == "shardline.v1"
        enums = list(file.enum_type) + [e for m in file.message_type for e in m.enum_type]
        for enum in enums:
            prefix = "".join(f"_{c}" if c.isupper() else c.upper() for c in enum.name).lstrip("_") + "_"
            assert all(v.name.startswith(prefix) for v in enum.value), (enum.name, prefix)
            zero = next(v for v in enum.value if v.number == 0)
            assert zero.name == f"{prefix}UNSPECIFIED"


def test_the_generated_modules_import_each_other_by_full_name_and_leave_sys_path_alone() -> None:
    script = ("import sys\nbefore = list(sys.path)\nfrom services.common.proto import worker_pb2_grpc\n"
              "assert sys.path == before, 'sys.path changed'\n"
              "assert not [m for m in sys.modules if m.split('.')[0] == 'shardline'], 'a top-level shardline'\n"
              "print(worker_pb2_grpc.__name__)")
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "services.common.proto.shardline.v1.worker_pb2_grpc"
