"""The shard registry's schema: its migrations, against real PostgreSQL (psycopg 3) and a SQLite
file (the ``db_url`` fixture in conftest.py), the models' agreement with them, and ``shardline db``."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from services.cli import main as cli_main
from services.common.registry import make_engine, migrate
from services.common.registry.models import Base

SEED_COLUMNS = {
    "replica_groups": {"replica_group_id", "model_name", "tp_degree", "pp_degree", "dtype",
                       "kv_cache_cap_bytes", "status", "created_at"},
    "gpu_shards": {"gpu_id", "replica_group_id", "node_id", "tp_rank", "pp_stage", "weight_bytes",
                   "kv_used_bytes", "last_heartbeat"},
    "checkpoint_manifests": {"manifest_id", "model_name", "dtype", "shard_uri_prefix",
                             "total_bytes", "shard_count", "created_at"},
}
EXTENSION_COLUMNS = {
    "replica_groups": {"name", "endpoint", "status_reason", "updated_at", "fleet_name", "fleet_revision",
                       "manifest_uri", "numerics"},
    "gpu_shards": {"status"},
    "checkpoint_manifests": {"manifest_uri", "tp_degree", "pp_degree"},
}

def test_migration_creates_seed_tables_constraints_and_index(db_url: str) -> None:
    assert migrate.current_revision(db_url) is None
    migrate.upgrade(db_url)
    assert migrate.current_revision(db_url) == migrate.head_revision() == "0006"
    engine = make_engine(db_url)
    try:
        inspector = sa.inspect(engine)
        assert set(inspector.get_table_names()) == {
            "alembic_version", "replica_groups", "gpu_shards", "checkpoint_manifests", "quality_gate_results",
            "fleet_revisions", "fleet_rollouts", "leases"}
        for table, seed in SEED_COLUMNS.items():
            columns = {c["name"]: c for c in inspector.get_columns(table)}
            assert set(columns) == seed | EXTENSION_COLUMNS[table]
            assert all(not columns[c]["nullable"] for c in seed)
        uniques = {u["name"]: u["column_names"] for u in inspector.get_unique_constraints("gpu_shards")}
        assert uniques == {"uq_gpu_shards_replica_group_id_tp_rank_pp_stage":
                           ["replica_group_id", "tp_rank", "pp_stage"]}
        indexes = {i["name"]: i["column_names"] for i in inspector.get_indexes("gpu_shards")}
        assert indexes["idx_gpu_shards_group"] == ["replica_group_id", "pp_stage", "tp_rank"]
        manifest_uniques = [u["column_names"] for u in inspector.get_unique_constraints("checkpoint_manifests")]
        assert manifest_uniques == [["manifest_uri"]]
        checks = {c["name"]: c["sqltext"] for c in inspector.get_check_constraints("replica_groups")}
        assert "fp16" in checks["ck_replica_groups_dtype"] and "bf16" in checks["ck_replica_groups_dtype"]
        assert "draining" in checks["ck_replica_groups_status"]
        assert "layout-invariant" in checks["ck_replica_groups_numerics"]
        fks = inspector.get_foreign_keys("gpu_shards")
        assert [(f["constrained_columns"], f["referred_table"]) for f in fks] == [
            (["replica_group_id"], "replica_groups")]
        if engine.dialect.name == "postgresql":  # native uuid, timestamptz
            columns = {c["name"]: c for c in inspector.get_columns("replica_groups")}
            assert isinstance(columns["replica_group_id"]["type"], sa.UUID)
            assert columns["created_at"]["type"].timezone is True
    finally:
        engine.dispose()


def test_models_agree_with_migration(db_url: str) -> None:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_a_group_recorded_in_the_old_default_numerics_reads_per_layout(db_url: str) -> None:
    """0006: the layout-invariant numerics became the default; a row written before it in the
    then-default (the backend's all-reduce order) is per-layout, and back on a downgrade. The
    group has a shard: SQLite rebuilds the table to change its check, which its foreign key must
    survive."""
    migrate.upgrade(db_url, "0005")
    engine = make_engine(db_url)
    group = uuid.uuid4()
    key = group if engine.dialect.name == "postgresql" else group.hex  # SQLite keeps a uuid as 32 hex digits
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO replica_groups (replica_group_id, model_name, tp_degree, pp_degree, "
                                 "dtype, kv_cache_cap_bytes, status) VALUES (:id, 'm', 2, 1, 'bf16', 1, 'healthy')"),
                         {"id": key})
            conn.execute(sa.text("INSERT INTO gpu_shards (gpu_id, replica_group_id, node_id, tp_rank, pp_stage, "
                                 "weight_bytes) VALUES ('g0', :id, 'n0', 0, 0, 1)"), {"id": key})
        numerics = sa.text("SELECT numerics FROM replica_groups")
        with engine.connect() as conn:
            assert conn.execute(numerics).scalar_one() == "default"
        migrate.upgrade(db_url)
        with engine.connect() as conn:
            assert conn.execute(numerics).scalar_one() == "per-layout"
        migrate.downgrade(db_url, "0005")
        with engine.connect() as conn:
            assert conn.execute(numerics).scalar_one() == "default"
    finally:
        engine.dispose()


def test_upgrade_is_idempotent_and_downgrade_drops_tables(db_url: str) -> None:
    migrate.upgrade(db_url)
    migrate.upgrade(db_url)
    migrate.downgrade(db_url)
    engine = make_engine(db_url)
    try:
        assert set(sa.inspect(engine).get_table_names()) == {"alembic_version"}
    finally:
        engine.dispose()
    assert migrate.current_revision(db_url) is None


def test_cli_db_upgrade(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["db", "current", "--url", db_url]) == 1
    assert "revision none" in capsys.readouterr().out
    assert cli_main(["db", "upgrade", "--url", db_url]) == 0
    assert "schema at revision 0006 (head)" in capsys.readouterr().out
    assert cli_main(["db", "current", "--url", db_url]) == 0


def test_cli_db_upgrade_default_url_is_sqlite_in_state_dir(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SHARDLINE_REGISTRY_URL", raising=False)
    monkeypatch.setenv("SHARDLINE_STATE_DIR", str(tmp_path / "state"))
    assert cli_main(["db", "upgrade"]) == 0
    assert (tmp_path / "state" / "registry.db").is_file()
    assert f"sqlite:///{tmp_path}/state/registry.db" in capsys.readouterr().out
