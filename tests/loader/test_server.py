"""LoaderService over real gRPC on loopback: manifests recorded in real PostgreSQL, shards staged
into a node-local cache, the S3 path end to end against moto's server, and bad input answered
with the status that says what is wrong."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from services.cli import main as cli_main
from services.common.config import ServerConfig, child_environ
from services.common.grpc_server import GrpcServer, start_server
from services.common.healthcheck import check
from services.common.proto import common_pb2, loader_pb2, loader_pb2_grpc
from services.common.registry import ShardRegistry
from services.loader.catalog import ManifestCatalog
from services.loader.layout import rank_model
from services.loader.manifest import Manifest
from services.loader.server import LoaderServicer, bindings
from services.worker.launch import run_replica_group
from services.worker.rank_loading import load_rank_shard, plan_for_checkpoint
from services.worker.runtime import RankSpec
from services.worker.scoring import score_rank
from tests.loader.conftest import copy_checkpoint
from tests.loader.helpers import hf_rank, score_from_staged_rank, state_dict_diffs
from tests.loader.test_loading import TOKEN_IDS
from tests.loader.test_rejections import edit_manifest
from tests.stack import free_port, fresh_database

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pg_registry_url(postgres_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database for this module's registry."""
    with fresh_database(postgres_url, "loader") as url:
        yield url


class Loader:
    """A running LoaderService and a stub talking to it."""

    def __init__(self, server: GrpcServer, cache_dir: Path) -> None:
        self.server = server
        self.cache_dir = cache_dir
        self.channel = grpc.insecure_channel(server.address)
        self.stub = loader_pb2_grpc.LoaderServiceStub(self.channel)

    def empty_cache(self) -> None:
        """The cache is content-addressed: shards another test staged would be hits."""
        shutil.rmtree(self.cache_dir)
        self.cache_dir.mkdir()

    def register(self, uri: str | Path) -> loader_pb2.RegisterManifestResponse:
        return self.stub.RegisterManifest(loader_pb2.RegisterManifestRequest(manifest_uri=str(uri)), timeout=30)

    def get(self, **key: str) -> loader_pb2.GetManifestResponse:
        return self.stub.GetManifest(loader_pb2.GetManifestRequest(**key), timeout=30)

    def list(self, model_name: str = "", dtype: int = common_pb2.DTYPE_UNSPECIFIED) -> list[str]:
        response = self.stub.ListManifests(loader_pb2.ListManifestsRequest(model_name=model_name, dtype=dtype),
                                           timeout=30)
        return [m.manifest_uri for m in response.manifests]

    def stage(self, uri: str | Path, tp_rank: int, pp_stage: int) -> loader_pb2.StageResponse:
        return self.stub.Stage(loader_pb2.StageRequest(manifest_uri=str(uri), tp_rank=tp_rank, pp_stage=pp_stage),
                               timeout=60)


@pytest.fixture(scope="module")
def loader(pg_registry_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loader]:
    cache_dir = tmp_path_factory.mktemp("loader-cache")
    registry = ShardRegistry(pg_registry_url, migrate_schema=True)
    servicer = LoaderServicer(ManifestCatalog(registry), cache_dir)
    server = start_server(ServerConfig(service="loader", port=0), bindings(servicer))
    running = Loader(server, cache_dir)
    try:
        yield running
    finally:
        running.channel.close()
        server.stop(0)
        registry.close()


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# -- RegisterManifest / GetManifest / ListManifests ----------------------------------------------

def test_register_records_the_manifest_in_postgres_and_reads_it_back(loader: Loader, tiny_dir: Path, bf16_dir: Path,
                                                                     sharded, pg_registry_url: str) -> None:
    tp2pp2, tp4pp1, bf16 = sharded(tiny_dir, 2, 2), sharded(tiny_dir, 4, 1), sharded(bf16_dir, 2, 1)
    manifest = Manifest.load(tp2pp2 / "manifest.json")

    first = loader.register(tp2pp2 / "manifest.json")
    assert first.created
    summary = first.manifest
    assert (summary.model_name, summary.manifest_uri, summary.shard_uri_prefix) == (
        "tiny", str(tp2pp2.resolve() / "manifest.json"), str(tp2pp2.resolve()))
    assert (summary.layout.tp_degree, summary.layout.pp_degree, summary.layout.dtype) == (
        2, 2, common_pb2.DTYPE_FLOAT32)
    assert (summary.total_bytes, summary.shard_count) == (manifest.total_bytes, 4)
    assert summary.model_fingerprint == manifest.model_fingerprint
    assert abs(summary.created_at_ms / 1000 - time.time()) < 60

    # the same checkpoint by another spelling of its URI: the same record, not a second one
    again = loader.register(f"{tp2pp2}/")
    assert (again.created, again.manifest.manifest_id) == (False, summary.manifest_id)
    assert loader.register(tp4pp1).created and loader.register(bf16).created

    # what PostgreSQL itself holds
    engine = sa.create_engine(make_url(pg_registry_url).set(drivername="postgresql+psycopg"))
    try:
        with engine.connect() as conn:
            row = conn.execute(sa.text(
                "SELECT model_name, dtype, shard_uri_prefix, total_bytes, shard_count, tp_degree, pp_degree "
                "FROM checkpoint_manifests WHERE manifest_id = :id"), {"id": summary.manifest_id}).one()
            count = conn.execute(sa.text("SELECT count(*) FROM checkpoint_manifests")).scalar_one()
    finally:
        engine.dispose()
    assert tuple(row) == ("tiny", "fp32", str(tp2pp2.resolve()), manifest.total_bytes, 4, 2, 2)
    assert count == 3

    by_id = loader.get(manifest_id=summary.manifest_id)
    by_uri = loader.get(manifest_uri=str(tp2pp2))
    assert by_id == by_uri
    assert by_id.manifest == summary
    assert by_id.manifest_json == (tp2pp2 / "manifest.json").read_text()
    assert [(s.file_name, s.tp_rank, s.pp_stage, s.layer_start, s.layer_end) for s in by_id.shards] == [
        ("model-tp00-pp00.safetensors", 0, 0, 0, 2), ("model-tp01-pp00.safetensors", 1, 0, 0, 2),
        ("model-tp00-pp01.safetensors", 0, 1, 2, 4), ("model-tp01-pp01.safetensors", 1, 1, 2, 4)]
    for shard in by_id.shards:
        entry = manifest.shard(shard.tp_rank, shard.pp_stage)
        assert (shard.bytes, shard.sha256, shard.tensor_count) == (entry.bytes, entry.sha256, len(entry.tensors))
    assert [f.file_name for f in by_id.model_files] == ["config.json", "generation_config.json"]

    tiny_uris = {str(p.resolve() / "manifest.json") for p in (tp2pp2, tp4pp1)}
    assert set(loader.list(model_name="tiny")) == tiny_uris
    assert loader.list(dtype=common_pb2.DTYPE_BFLOAT16) == [str(bf16.resolve() / "manifest.json")]
    assert loader.list(model_name="tiny", dtype=common_pb2.DTYPE_BFLOAT16) == []
    assert set(loader.list()) >= tiny_uris | {str(bf16.resolve() / "manifest.json")}
    listed = loader.stub.ListManifests(loader_pb2.ListManifestsRequest(model_name="bf16")).manifests
    assert [(m.model_name, m.layout.dtype, m.total_bytes, m.shard_count) for m in listed] == [
        ("bf16", common_pb2.DTYPE_BFLOAT16, Manifest.load(bf16 / "manifest.json").total_bytes, 2)]


# -- Stage -----------------------------------------------------------------------------------------

def test_stage_twice_the_second_is_a_verified_cache_hit(loader: Loader, tiny_dir: Path, sharded) -> None:
    ckpt = sharded(tiny_dir, 2, 2)
    entry = Manifest.load(ckpt / "manifest.json").shard(1, 0)
    loader.empty_cache()
    first = loader.stage(ckpt / "manifest.json", 1, 0)
    assert (first.cache_hit, first.attempts, first.sha256, first.bytes) == (False, 1, entry.sha256, entry.bytes)
    assert Path(first.local_path).is_relative_to(loader.cache_dir.resolve())
    assert Path(first.local_path).read_bytes() == (ckpt / entry.file).read_bytes()
    assert first.verify_ns > 0

    second = loader.stage(ckpt, 1, 0)
    assert (second.cache_hit, second.attempts, second.download_ns) == (True, 0, 0)
    assert second.local_path == first.local_path and second.sha256 == entry.sha256
    assert second.verify_ns > 0  # a hit is re-hashed, not trusted

    # the staged file is the rank's weights, bitwise
    plan = plan_for_checkpoint(ckpt, tp_degree=2, pp_degree=2)
    model = rank_model(plan, 1, device="cpu")
    load_rank_shard(model, Manifest.load(ckpt / "manifest.json"), first.local_path, plan, 1)
    assert state_dict_diffs(model, hf_rank(tiny_dir, plan, 1)) == []


@pytest.mark.slow
def test_s3_shard_register_stage_load_and_score(loader: Loader, tiny_dir: Path, s3_bucket: str,
                                                capsys: pytest.CaptureFixture) -> None:
    prefix = f"s3://{s3_bucket}/llama/tiny/fp32-tp2-pp2"
    assert cli_main(["shard", "--model", str(tiny_dir), "--tp", "2", "--pp", "2", "--out", prefix, "--json"]) == 0
    capsys.readouterr()
    loader.empty_cache()

    registered = loader.register(f"{prefix}/manifest.json")
    assert registered.created
    assert (registered.manifest.manifest_uri, registered.manifest.shard_uri_prefix) == (f"{prefix}/manifest.json",
                                                                                        prefix)
    assert registered.manifest.shard_count == 4
    got = loader.get(manifest_uri=prefix)
    assert got.manifest.manifest_id == registered.manifest.manifest_id
    assert {f.file_name for f in got.model_files} >= {"config.json", "generation_config.json"}

    staged = {}
    plan = plan_for_checkpoint(f"{prefix}/manifest.json", tp_degree=2, pp_degree=2)
    for rank in range(plan.world_size):
        pp_stage, tp_rank = plan.coords(rank)
        response = loader.stage(f"{prefix}/manifest.json", tp_rank, pp_stage)
        assert (response.cache_hit, response.attempts) == (False, 1)
        assert response.sha256 == got.shards[rank].sha256  # shards come in (pp_stage, tp_rank) order
        staged[rank] = response.local_path
    assert loader.stage(f"{prefix}/manifest.json", 1, 1).cache_hit

    spec = RankSpec(str(tiny_dir), tp_degree=2, pp_degree=2, dtype="float32", collective_timeout_s=10.0)
    from_hf = run_replica_group(4, score_rank, spec, TOKEN_IDS, failure_grace_s=15.0)
    from_staged = run_replica_group(4, score_from_staged_rank, f"{prefix}/manifest.json", staged, 2, 2, TOKEN_IDS,
                                    failure_grace_s=15.0)
    assert from_staged.logprobs == from_hf.logprobs
    assert from_staged.nll == from_hf.nll


# -- bad input: the status says what is wrong ------------------------------------------------------

def test_unknown_manifests_are_not_found(loader: Loader, tmp_path: Path) -> None:
    code, details = status_of(lambda: loader.get(manifest_id=str(uuid.uuid4())))
    assert code == grpc.StatusCode.NOT_FOUND and "checkpoint manifest" in details
    code, details = status_of(lambda: loader.get(manifest_uri=str(tmp_path / "nothing" / "manifest.json")))
    assert code == grpc.StatusCode.NOT_FOUND and "nothing/manifest.json" in details
    for call in (lambda: loader.register(tmp_path / "nothing"), lambda: loader.stage(tmp_path / "nothing", 0, 0)):
        code, details = status_of(call)
        assert code == grpc.StatusCode.NOT_FOUND and f"{tmp_path}/nothing/manifest.json" in details


def test_malformed_requests_are_invalid_argument(loader: Loader) -> None:
    for call, says in [(lambda: loader.get(manifest_id="not-a-uuid"), "manifest_id must be a UUID"),
                       (lambda: loader.get(), "manifest_id or manifest_uri"),
                       (lambda: loader.register(""), "manifest_uri is empty"),
                       (lambda: loader.stage("http://example.com/manifest.json", 0, 0), "expected a directory")]:
        code, details = status_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details, details


def test_a_manifest_listing_a_parent_path_is_invalid_argument(loader: Loader, tiny_dir: Path, sharded,
                                                              tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")
    (tmp_path / "x.safetensors").write_bytes((ckpt / "model-tp00-pp00.safetensors").read_bytes())
    edit_manifest(ckpt, lambda raw: raw["shards"][0].update(file="../x.safetensors"))
    for call in (lambda: loader.register(ckpt), lambda: loader.stage(ckpt, 0, 0)):
        code, details = status_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "'../x.safetensors' is not a plain file name" in details
    assert not list(loader.cache_dir.rglob("x.safetensors"))
    assert str(ckpt.resolve() / "manifest.json") not in loader.list()


def test_tp4_shards_relabelled_as_tp2_are_failed_precondition(loader: Loader, tiny_dir: Path, sharded,
                                                              tmp_path: Path) -> None:
    """The manifest claims a TP=2 cut, but its entries hold TP=4 slices: registration compares
    every entry with what the TP=2 rank's model holds."""
    ckpt = copy_checkpoint(sharded(tiny_dir, 4, 1), tmp_path / "ckpt")

    def relabel(raw: dict) -> None:
        raw["plan"]["tp_degree"] = 2
        raw["shards"] = [s for s in raw["shards"] if s["tp_rank"] < 2]
        raw["total_bytes"] = sum(s["bytes"] for s in raw["shards"])
    edit_manifest(ckpt, relabel)
    code, details = status_of(lambda: loader.register(ckpt))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not hold what this rank's model expects" in details and "expected [" in details
    # staging the bytes finds the same lie in the file's own header
    code, details = status_of(lambda: loader.stage(ckpt, 1, 0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "tp_degree: expected '2', file has '4'" in details


def test_stage_refuses_damaged_and_unknown_shards_with_failed_precondition(loader: Loader, tiny_dir: Path,
                                                                           sharded, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")
    path = ckpt / "model-tp01-pp01.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    loader.empty_cache()
    code, details = status_of(lambda: loader.stage(ckpt, 1, 1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "still wrong after 3 download attempt(s)" in details
    code, details = status_of(lambda: loader.stage(ckpt, 2, 0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no shard for tp_rank=2 pp_stage=0: the manifest was cut for tp=2 pp=2" in details


def test_register_refuses_missing_or_resized_shards(loader: Loader, tiny_dir: Path, sharded,
                                                    tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 1), tmp_path / "ckpt")
    shard = ckpt / "model-tp01-pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    code, details = status_of(lambda: loader.register(ckpt))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "1000 bytes, the manifest at" in details
    shard.unlink()
    code, details = status_of(lambda: loader.register(ckpt))
    assert code == grpc.StatusCode.NOT_FOUND and "model-tp01-pp00.safetensors" in details


def test_a_changed_checkpoint_under_a_registered_uri_is_refused(loader: Loader, tiny_dir: Path, sharded,
                                                                tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 1), tmp_path / "ckpt")
    assert loader.register(ckpt).created
    shutil.rmtree(ckpt)
    copy_checkpoint(sharded(tiny_dir, 4, 1), ckpt)  # another cut written over the same prefix
    code, details = status_of(lambda: loader.register(ckpt))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "shard_count: recorded 2, manifest now says 4" in details
    code, details = status_of(lambda: loader.get(manifest_uri=str(ckpt)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "changed since it was registered" in details


# -- the real command ------------------------------------------------------------------------------

def test_shardline_serve_loader_with_sqlite_registry_and_cache_dir(tiny_dir: Path, sharded, tmp_path: Path) -> None:
    """`shardline serve loader` wires --registry-url and --cache-dir (flags), and exits 0 on SIGTERM."""
    ckpt = sharded(tiny_dir, 2, 1)
    port = free_port()
    log = tmp_path / "loader.log"
    env = child_environ()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "loader", "--port", str(port),
                                 "--registry-url", f"sqlite:///{tmp_path / 'registry.db'}",
                                 "--cache-dir", str(tmp_path / "cache")],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if check(address, timeout_s=1) == "SERVING":
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        with grpc.insecure_channel(address) as channel:
            stub = loader_pb2_grpc.LoaderServiceStub(channel)
            registered = stub.RegisterManifest(loader_pb2.RegisterManifestRequest(manifest_uri=str(ckpt)), timeout=30)
            staged = stub.Stage(loader_pb2.StageRequest(manifest_uri=str(ckpt), tp_rank=1), timeout=30)
        assert registered.created and registered.manifest.shard_count == 2
        assert Path(staged.local_path).is_relative_to((tmp_path / "cache").resolve())
        with ShardRegistry(f"sqlite:///{tmp_path / 'registry.db'}") as registry:
            assert [m.model_name for m in registry.list_manifests()] == ["tiny"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
