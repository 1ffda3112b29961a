"""The original registry tables (replica_groups, gpu_shards, checkpoint_manifests) with extensions.

Constraint names are wrapped in ``op.f()`` (final names: the models' naming convention is not
applied again). Self-contained on purpose: it spells the schema out instead of importing the models, so later
model changes need a new revision rather than silently changing this one.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

DTYPE_CHECK = "dtype IN ('fp16', 'bf16', 'fp32', 'int8', 'fp8')"
GROUP_STATUS_CHECK = "status IN ('provisioning', 'healthy', 'degraded', 'draining', 'dead')"
SHARD_STATUS_CHECK = "status IN ('starting', 'healthy', 'degraded', 'unhealthy', 'draining')"
NOW = sa.text("CURRENT_TIMESTAMP")


def upgrade() -> None:
    op.create_table(
        "replica_groups",
        sa.Column("replica_group_id", sa.Uuid(), nullable=False),
        sa.Column("model_name", sa.Text(), nullable=False),
        sa.Column("tp_degree", sa.Integer(), nullable=False),
        sa.Column("pp_degree", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.Text(), nullable=False),
        sa.Column("kv_cache_cap_bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("endpoint", sa.Text(), nullable=True),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("replica_group_id", name=op.f("pk_replica_groups")),
        sa.CheckConstraint(DTYPE_CHECK, name=op.f("ck_replica_groups_dtype")),
        sa.CheckConstraint(GROUP_STATUS_CHECK, name=op.f("ck_replica_groups_status")),
        sa.CheckConstraint("tp_degree > 0", name=op.f("ck_replica_groups_tp_degree_positive")),
        sa.CheckConstraint("pp_degree > 0", name=op.f("ck_replica_groups_pp_degree_positive")),
        sa.CheckConstraint("kv_cache_cap_bytes >= 0",
                           name=op.f("ck_replica_groups_kv_cache_cap_nonnegative")),
    )
    op.create_index("idx_replica_groups_model_status", "replica_groups", ["model_name", "status"])

    op.create_table(
        "gpu_shards",
        sa.Column("gpu_id", sa.Text(), nullable=False),
        sa.Column("replica_group_id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("tp_rank", sa.Integer(), nullable=False),
        sa.Column("pp_stage", sa.Integer(), nullable=False),
        sa.Column("weight_bytes", sa.BigInteger(), nullable=False),
        sa.Column("kv_used_bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'starting'"), nullable=False),
        sa.PrimaryKeyConstraint("gpu_id", name=op.f("pk_gpu_shards")),
        sa.ForeignKeyConstraint(["replica_group_id"], ["replica_groups.replica_group_id"],
                                name=op.f("fk_gpu_shards_replica_group_id_replica_groups")),
        sa.UniqueConstraint("replica_group_id", "tp_rank", "pp_stage",
                            name=op.f("uq_gpu_shards_replica_group_id_tp_rank_pp_stage")),
        sa.CheckConstraint(SHARD_STATUS_CHECK, name=op.f("ck_gpu_shards_status")),
        sa.CheckConstraint("tp_rank >= 0", name=op.f("ck_gpu_shards_tp_rank_nonnegative")),
        sa.CheckConstraint("pp_stage >= 0", name=op.f("ck_gpu_shards_pp_stage_nonnegative")),
    )
    op.create_index("idx_gpu_shards_group", "gpu_shards", ["replica_group_id", "pp_stage", "tp_rank"])

    op.create_table(
        "checkpoint_manifests",
        sa.Column("manifest_id", sa.Uuid(), nullable=False),
        sa.Column("model_name", sa.Text(), nullable=False),
        sa.Column("dtype", sa.Text(), nullable=False),
        sa.Column("shard_uri_prefix", sa.Text(), nullable=False),
        sa.Column("total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("shard_count", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.Column("manifest_uri", sa.Text(), nullable=True),
        sa.Column("tp_degree", sa.Integer(), nullable=True),
        sa.Column("pp_degree", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("manifest_id", name=op.f("pk_checkpoint_manifests")),
        sa.UniqueConstraint("manifest_uri", name=op.f("uq_checkpoint_manifests_manifest_uri")),
        sa.CheckConstraint(DTYPE_CHECK, name=op.f("ck_checkpoint_manifests_dtype")),
    )
    op.create_index("idx_checkpoint_manifests_model_dtype", "checkpoint_manifests",
                    ["model_name", "dtype"])


def downgrade() -> None:
    op.drop_index("idx_checkpoint_manifests_model_dtype", table_name="checkpoint_manifests")
    op.drop_table("checkpoint_manifests")
    op.drop_index("idx_gpu_shards_group", table_name="gpu_shards")
    op.drop_table("gpu_shards")
    op.drop_index("idx_replica_groups_model_status", table_name="replica_groups")
    op.drop_table("replica_groups")
