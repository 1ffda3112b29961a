"""Shard registry: the same suite against real PostgreSQL (psycopg 3) and a SQLite file."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from services.common.registry import (
    ALLOWED_TRANSITIONS,
    GROUP_STATUSES,
    DuplicateManifest,
    DuplicateShard,
    GroupIsDead,
    GroupNotFound,
    IllegalTransition,
    InvalidValue,
    ManifestNotFound,
    ShardNotFound,
    ShardRegistry,
    make_engine,
)
from services.common.registry.models import Base

GIB = 1 << 30
# a legal path from provisioning to each status
PATH_TO = {
    "provisioning": [],
    "healthy": ["healthy"],
    "degraded": ["healthy", "degraded"],
    "draining": ["healthy", "draining"],
    "dead": ["dead"],
}


@pytest.fixture
def registry(db_url: str) -> Iterator[ShardRegistry]:
    with ShardRegistry(db_url, migrate_schema=True) as reg:
        yield reg


def _group(registry: ShardRegistry, model: str = "llama-3-70b", *, tp: int = 2, pp: int = 2,
           dtype: str = "fp16", name: str | None = None):
    return registry.create_replica_group(model, tp, pp, dtype, 20 * GIB, name=name)


def _walk(registry: ShardRegistry, group_id: uuid.UUID, target: str) -> None:
    for status in PATH_TO[target]:
        registry.set_status(group_id, status, by="operator")


# ---- replica groups and lifecycle --------------------------------------------------------------


def test_create_group_starts_provisioning(registry: ShardRegistry) -> None:
    before = datetime.now(UTC) - timedelta(seconds=1)
    group = registry.create_replica_group("llama-3-70b", 4, 2, "bfloat16", 20 * GIB, name="replica-03")
    assert group.status == "provisioning"
    assert (group.tp_degree, group.pp_degree, group.world_size) == (4, 2, 8)
    assert (group.dtype, group.project_dtype) == ("bf16", "bfloat16")
    assert group.name == "replica-03" and group.status_reason is None
    fetched = registry.get_group(str(group.replica_group_id))
    assert fetched == group
    assert fetched.created_at.tzinfo is UTC and fetched.created_at > before


def test_lifecycle_happy_path(registry: ShardRegistry) -> None:
    gid = _group(registry).replica_group_id
    assert registry.set_status(gid, "healthy", by="operator").status == "healthy"
    degraded = registry.set_status(gid, "degraded", reason="gpu-3 all_reduce p99 4.1x baseline", by="operator")
    assert (degraded.status, degraded.status_reason) == ("degraded", "gpu-3 all_reduce p99 4.1x baseline")
    recovered = registry.set_status(gid, "healthy", by="operator")
    assert (recovered.status, recovered.status_reason) == ("healthy", None)
    assert registry.set_status(gid, "draining", reason="scale down", by="operator").status == "draining"
    dead = registry.set_status(gid, "dead", reason="drained", by="operator")
    assert (dead.status, dead.status_reason) == ("dead", "drained")
    assert dead.updated_at >= degraded.updated_at >= dead.created_at


def test_every_legal_transition_is_accepted(registry: ShardRegistry) -> None:
    for source, targets in ALLOWED_TRANSITIONS.items():
        for target in targets:
            gid = _group(registry).replica_group_id
            _walk(registry, gid, source)
            assert registry.set_status(gid, target, by="operator").status == target


def test_every_illegal_transition_raises_naming_from_to_and_allowed(registry: ShardRegistry) -> None:
    illegal = [(s, t) for s in GROUP_STATUSES for t in GROUP_STATUSES if t not in ALLOWED_TRANSITIONS[s]]
    assert len(illegal) == 16  # 25 pairs, 9 allowed
    for source, target in illegal:
        gid = _group(registry).replica_group_id
        _walk(registry, gid, source)
        allowed = ", ".join(ALLOWED_TRANSITIONS[source]) or "none (terminal state)"
        with pytest.raises(IllegalTransition) as info:
            registry.set_status(gid, target, by="operator")
        assert str(info.value) == (f"illegal replica group transition {source} -> {target} for {gid}: "
                                   f"from {source} the allowed targets are {allowed}")
        assert (info.value.from_status, info.value.to_status) == (source, target)
        assert registry.get_group(gid).status == source


def test_dead_to_healthy_message(registry: ShardRegistry) -> None:
    gid = _group(registry).replica_group_id
    registry.set_status(gid, "dead", by="operator")
    with pytest.raises(IllegalTransition, match=r"dead -> healthy .*allowed targets are none \(terminal state\)$"):
        registry.set_status(gid, "healthy", by="operator")
    gid2 = _group(registry).replica_group_id
    registry.set_status(gid2, "healthy", by="operator")
    registry.set_status(gid2, "draining", by="operator")
    with pytest.raises(IllegalTransition, match=r"draining -> healthy .*allowed targets are dead$"):
        registry.set_status(gid2, "healthy", by="operator")


def test_unknown_group_status_and_bad_ids(registry: ShardRegistry) -> None:
    gid = _group(registry).replica_group_id
    with pytest.raises(InvalidValue, match=r"unknown replica group status 'alive': expected one of "
                                           r"provisioning, healthy, degraded, draining, dead"):
        registry.set_status(gid, "alive", by="operator")
    missing = uuid.uuid4()
    with pytest.raises(GroupNotFound) as info:
        registry.set_status(missing, "healthy", by="operator")
    assert str(info.value) == f"replica group {missing} not found in the shard registry"
    with pytest.raises(GroupNotFound):
        registry.get_group(missing)
    with pytest.raises(GroupNotFound):
        registry.shards_of(missing)
    with pytest.raises(InvalidValue, match=r"replica_group_id must be a UUID, got 'replica-03'"):
        registry.get_group("replica-03")


def test_create_group_validates_before_the_database(registry: ShardRegistry) -> None:
    with pytest.raises(InvalidValue, match=r"unknown dtype 'fp64': expected one of"):
        registry.create_replica_group("m", 1, 1, "fp64", GIB)
    with pytest.raises(InvalidValue, match=r"tp_degree must be >= 1, got 0"):
        registry.create_replica_group("m", 0, 1, "fp16", GIB)
    with pytest.raises(InvalidValue, match=r"kv_cache_cap_bytes must be >= 0, got -1"):
        registry.create_replica_group("m", 1, 1, "fp16", -1)
    assert registry.list_groups() == []


def test_list_groups_filters_by_model_and_status(registry: ShardRegistry) -> None:
    a = _group(registry, "llama-3-70b", name="a").replica_group_id
    b = _group(registry, "llama-3-70b", name="b").replica_group_id
    c = _group(registry, "smollm2-135m", tp=1, pp=1, name="c").replica_group_id
    d = _group(registry, "smollm2-135m", tp=1, pp=1, name="d").replica_group_id
    registry.set_status(a, "healthy", by="operator")
    registry.set_status(c, "healthy", by="operator")
    registry.set_status(d, "healthy", by="operator")
    registry.set_status(d, "degraded", by="operator")

    def names(groups) -> list[str]:
        return [g.name for g in groups]

    assert names(registry.list_groups()) == ["a", "b", "c", "d"]
    assert names(registry.list_groups(model_name="llama-3-70b")) == ["a", "b"]
    assert names(registry.list_groups(status="healthy")) == ["a", "c"]
    assert names(registry.list_groups(model_name="smollm2-135m", status="healthy")) == ["c"]
    assert names(registry.list_groups(status=["healthy", "degraded"])) == ["a", "c", "d"]
    assert names(registry.list_groups(model_name="llama-3-70b", status="provisioning")) == ["b"]
    assert registry.list_groups(model_name="nope") == []
    with pytest.raises(InvalidValue, match=r"unknown status 'up'"):
        registry.list_groups(status="up")
    assert registry.get_group(b).replica_group_id == b


def test_racing_status_changes_one_wins(registry: ShardRegistry) -> None:
    """Compare-and-set: of writers racing healthy -> dead, exactly one succeeds."""
    gid = _group(registry).replica_group_id
    registry.set_status(gid, "healthy", by="operator")
    outcomes: list[str] = []
    lock = threading.Lock()

    def kill() -> None:
        try:
            registry.set_status(gid, "dead", reason=threading.current_thread().name, by="operator")
            result = "ok"
        except IllegalTransition as exc:
            result = f"{exc.from_status}->{exc.to_status}"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=kill, name=f"killer-{i}") for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["dead->dead"] * 5 + ["ok"]
    assert registry.get_group(gid).status == "dead"


# ---- shards ------------------------------------------------------------------------------------


def test_register_shards_in_global_rank_order(registry: ShardRegistry) -> None:
    gid = _group(registry, tp=2, pp=2).replica_group_id
    for pp_stage in (1, 0):
        for tp_rank in (1, 0):
            shard = registry.register_shard(gid, f"node0:gpu{pp_stage * 2 + tp_rank}", "node0",
                                            tp_rank, pp_stage, 8 * GIB)
            assert (shard.status, shard.kv_used_bytes) == ("starting", 0)
    shards = registry.shards_of(gid)
    assert [(s.pp_stage, s.tp_rank, s.gpu_id) for s in shards] == [
        (0, 0, "node0:gpu0"), (0, 1, "node0:gpu1"), (1, 0, "node0:gpu2"), (1, 1, "node0:gpu3")]
    assert registry.get_shard("node0:gpu3").replica_group_id == gid


def test_duplicate_rank_and_busy_gpu_rejected(registry: ShardRegistry) -> None:
    gid = _group(registry, tp=2, pp=1).replica_group_id
    registry.register_shard(gid, "gpu-a", "node0", 0, 0, GIB)
    with pytest.raises(DuplicateShard) as info:
        registry.register_shard(gid, "gpu-b", "node0", 0, 0, GIB)
    assert str(info.value) == (f"replica group {gid} already has a shard at pp_stage=0 tp_rank=0 "
                               f"(gpu gpu-a); cannot also place gpu gpu-b")
    other = _group(registry, tp=2, pp=1).replica_group_id
    with pytest.raises(DuplicateShard, match=rf"gpu gpu-a already serves replica group {gid} "
                                             r"\(status provisioning\) at pp_stage=0 tp_rank=0"):
        registry.register_shard(other, "gpu-a", "node0", 1, 0, GIB)
    assert [s.gpu_id for s in registry.shards_of(gid)] == ["gpu-a"]
    assert registry.shards_of(other) == []


def test_rank_beyond_degree_rejected(registry: ShardRegistry) -> None:
    gid = _group(registry, tp=2, pp=2).replica_group_id
    with pytest.raises(InvalidValue, match=r"^tp_rank must be >= 0 and <= 1, got 2$"):
        registry.register_shard(gid, "gpu-x", "node0", 2, 0, GIB)
    with pytest.raises(InvalidValue, match=r"^pp_stage must be >= 0 and <= 1, got 2$"):
        registry.register_shard(gid, "gpu-x", "node0", 0, 2, GIB)
    with pytest.raises(InvalidValue, match=r"^tp_rank must be >= 0 and <= 1, got -1$"):
        registry.register_shard(gid, "gpu-x", "node0", -1, 0, GIB)
    with pytest.raises(GroupNotFound):
        registry.register_shard(uuid.uuid4(), "gpu-x", "node0", 0, 0, GIB)
    assert registry.shards_of(gid) == []


def test_gpu_of_dead_group_is_taken_over(registry: ShardRegistry) -> None:
    old = _group(registry, tp=1, pp=1).replica_group_id
    registry.register_shard(old, "gpu-0", "node0", 0, 0, GIB)
    registry.heartbeat("gpu-0", 5000, status="healthy")
    registry.set_status(old, "dead", reason="all_reduce timed out", by="operator")
    with pytest.raises(GroupIsDead, match=rf"replica group {old} is dead: cannot register gpu gpu-1"):
        registry.register_shard(old, "gpu-1", "node0", 0, 0, GIB)
    new = _group(registry, tp=1, pp=1).replica_group_id
    shard = registry.register_shard(new, "gpu-0", "node0", 0, 0, 2 * GIB)
    assert (shard.replica_group_id, shard.kv_used_bytes, shard.status, shard.weight_bytes) == (
        new, 0, "starting", 2 * GIB)
    assert registry.shards_of(old) == []


def test_heartbeat_updates_kv_status_and_time(registry: ShardRegistry) -> None:
    gid = _group(registry, tp=1, pp=1).replica_group_id
    first = registry.register_shard(gid, "gpu-0", "node0", 0, 0, GIB)
    registry.heartbeat("gpu-0", 123_456, status="healthy")
    after = registry.get_shard("gpu-0")
    assert (after.kv_used_bytes, after.status) == (123_456, "healthy")
    assert after.last_heartbeat > first.last_heartbeat
    assert after.last_heartbeat.tzinfo is UTC
    assert abs((datetime.now(UTC) - after.last_heartbeat).total_seconds()) < 5
    registry.heartbeat("gpu-0", 0)
    assert registry.get_shard("gpu-0").status == "healthy"  # status unchanged when not given
    with pytest.raises(ShardNotFound, match=r"^gpu shard gpu-9 not found in the shard registry$"):
        registry.heartbeat("gpu-9", 1)
    with pytest.raises(InvalidValue, match=r"unknown status 'ok'"):
        registry.heartbeat("gpu-0", 1, status="ok")
    with pytest.raises(InvalidValue, match=r"kv_used_bytes must be >= 0, got -5"):
        registry.heartbeat("gpu-0", -5)


def test_stale_shards(registry: ShardRegistry) -> None:
    gid = _group(registry, tp=2, pp=1).replica_group_id
    registry.register_shard(gid, "gpu-0", "node0", 0, 0, GIB)
    registry.register_shard(gid, "gpu-1", "node0", 1, 0, GIB)
    with registry.engine.begin() as conn:  # gpu-1 last beat two minutes ago
        conn.execute(sa.text("UPDATE gpu_shards SET last_heartbeat = :t WHERE gpu_id = 'gpu-1'")
                     .bindparams(sa.bindparam("t", datetime.now(UTC) - timedelta(minutes=2),
                                              type_=Base.metadata.tables["gpu_shards"].c.last_heartbeat.type)))
    assert [s.gpu_id for s in registry.stale_shards(60)] == ["gpu-1"]
    assert registry.stale_shards(600) == []
    registry.heartbeat("gpu-1", 0)
    assert registry.stale_shards(60) == []
    with pytest.raises(InvalidValue):
        registry.stale_shards(-1)
    registry.set_status(gid, "dead", by="operator")
    assert registry.stale_shards(0) == []
    assert {s.gpu_id for s in registry.stale_shards(0, include_dead=True)} == {"gpu-0", "gpu-1"}


# ---- database-level constraints ----------------------------------------------------------------


def test_database_rejects_bad_dtype_status_and_duplicate_rank(registry: ShardRegistry) -> None:
    """The constraints hold for writers that bypass the repository."""
    insert_group = sa.text(
        "INSERT INTO replica_groups (replica_group_id, model_name, tp_degree, pp_degree, dtype, "
        "kv_cache_cap_bytes, status) VALUES (:id, 'm', 1, 1, :dtype, 0, :status)"
    ).bindparams(sa.bindparam("id", type_=sa.Uuid()))
    for dtype, status in (("fp64", "healthy"), ("float16", "healthy"), ("fp16", "alive")):
        with pytest.raises(IntegrityError), registry.engine.begin() as conn:
            conn.execute(insert_group, {"id": uuid.uuid4(), "dtype": dtype, "status": status})
    good = uuid.uuid4()
    with registry.engine.begin() as conn:  # the original columns suffice: extensions default
        conn.execute(insert_group, {"id": good, "dtype": "int8", "status": "healthy"})
    group = registry.get_group(good)
    assert (group.dtype, group.status, group.name) == ("int8", "healthy", None)
    assert group.created_at.tzinfo is UTC

    insert_shard = sa.text(
        "INSERT INTO gpu_shards (gpu_id, replica_group_id, node_id, tp_rank, pp_stage, weight_bytes) "
        "VALUES (:gpu, :gid, 'node0', 0, 0, 1)"
    ).bindparams(sa.bindparam("gid", type_=sa.Uuid()))
    with registry.engine.begin() as conn:
        conn.execute(insert_shard, {"gpu": "gpu-0", "gid": good})
    with pytest.raises(IntegrityError), registry.engine.begin() as conn:
        conn.execute(insert_shard, {"gpu": "gpu-1", "gid": good})
    with pytest.raises(IntegrityError), registry.engine.begin() as conn:  # foreign key
        conn.execute(insert_shard, {"gpu": "gpu-2", "gid": uuid.uuid4()})
    shard = registry.get_shard("gpu-0")
    assert (shard.kv_used_bytes, shard.status) == (0, "starting")


# ---- manifests ---------------------------------------------------------------------------------


def test_manifests(registry: ShardRegistry) -> None:
    m1 = registry.register_manifest("llama-3-70b", "float16", "s3://ckpt/llama3-70b/tp4pp2-fp16/",
                                    141 * GIB, 8, manifest_uri="s3://ckpt/llama3-70b/tp4pp2-fp16/manifest.json",
                                    tp_degree=4, pp_degree=2)
    m2 = registry.register_manifest("llama-3-70b", "int8", "s3://ckpt/llama3-70b/tp4pp2-int8/",
                                    71 * GIB, 8, manifest_uri="s3://ckpt/llama3-70b/tp4pp2-int8/manifest.json")
    m3 = registry.register_manifest("smollm2-135m", "bf16", "/tmp/ckpt/smollm2/", 270_000_000, 1)
    assert m1.dtype == "fp16" and (m1.tp_degree, m1.pp_degree) == (4, 2)
    assert registry.get_manifest(m1.manifest_id) == m1
    assert registry.get_manifest(str(m2.manifest_id)) == m2
    assert registry.get_manifest_by_uri("s3://ckpt/llama3-70b/tp4pp2-int8/manifest.json") == m2
    assert {m.manifest_id for m in registry.list_manifests()} == {m1.manifest_id, m2.manifest_id, m3.manifest_id}
    assert registry.list_manifests("llama-3-70b", "fp16") == [m1]
    assert registry.list_manifests("llama-3-70b", "float16") == [m1]
    assert registry.list_manifests(dtype="bfloat16") == [m3]
    assert {m.manifest_id for m in registry.list_manifests("llama-3-70b")} == {m1.manifest_id, m2.manifest_id}
    assert registry.list_manifests("llama-3-70b", "fp8") == []
    with pytest.raises(DuplicateManifest) as info:
        registry.register_manifest("llama-3-70b", "fp16", "s3://elsewhere/", 1, 1,
                                   manifest_uri="s3://ckpt/llama3-70b/tp4pp2-fp16/manifest.json")
    assert str(info.value) == (f"manifest_uri s3://ckpt/llama3-70b/tp4pp2-fp16/manifest.json is already "
                               f"registered as manifest {m1.manifest_id}; a new layout needs a new manifest URI")
    missing = uuid.uuid4()
    with pytest.raises(ManifestNotFound, match=rf"^checkpoint manifest {missing} not found"):
        registry.get_manifest(missing)
    with pytest.raises(ManifestNotFound):
        registry.get_manifest_by_uri("s3://nope/manifest.json")
    with pytest.raises(InvalidValue, match=r"shard_count must be >= 1, got 0"):
        registry.register_manifest("m", "fp16", "/x/", 1, 0)


# ---- no database -------------------------------------------------------------------------------


def test_in_memory_sqlite_registry() -> None:
    with ShardRegistry("sqlite:///:memory:", migrate_schema=True) as reg:
        gid = reg.create_replica_group("tiny", 2, 1, "float32", GIB).replica_group_id
        reg.register_shard(gid, "cpu-0", "localhost", 0, 0, 1)
        assert [s.gpu_id for s in reg.shards_of(gid)] == ["cpu-0"]


def test_unsupported_url_scheme() -> None:
    with pytest.raises(InvalidValue, match=r"unsupported registry URL scheme 'mysql': expected one of "
                                           r"postgresql\+psycopg://, sqlite://"):
        make_engine("mysql://localhost/x")
