"""The fleet: declared specs by revision, rollouts, and each replica group's origin.

- ``fleet_revisions``: every applied fleet spec (JSON), numbered 1, 2, ... per fleet, never edited.
- ``fleet_rollouts``: one row per move of a fleet from one revision to another, its state and why.
- ``replica_groups`` gains ``fleet_name``, ``fleet_revision`` and ``manifest_uri``: the revision and
  the checkpoint (a manifest URI or a model directory) a group was built from.

Self-contained like 0001.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None

NOW = sa.text("CURRENT_TIMESTAMP")
ROLLOUT_STATUS_CHECK = "status IN ('running', 'succeeded', 'failed', 'aborting', 'aborted')"


def upgrade() -> None:
    op.create_table(
        "fleet_revisions",
        sa.Column("fleet_name", sa.Text(), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("fleet_name", "revision", name=op.f("pk_fleet_revisions")),
        sa.CheckConstraint("revision > 0", name=op.f("ck_fleet_revisions_revision_positive")),
    )
    op.create_table(
        "fleet_rollouts",
        sa.Column("rollout_id", sa.Uuid(), nullable=False),
        sa.Column("fleet_name", sa.Text(), nullable=False),
        sa.Column("from_revision", sa.Integer(), nullable=True),
        sa.Column("to_revision", sa.Integer(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("events", sa.Text(), server_default=sa.text("'[]'"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("rollout_id", name=op.f("pk_fleet_rollouts")),
        sa.CheckConstraint(ROLLOUT_STATUS_CHECK, name=op.f("ck_fleet_rollouts_status")),
    )
    op.create_index("idx_fleet_rollouts_fleet", "fleet_rollouts", ["fleet_name", "created_at"])
    op.add_column("replica_groups", sa.Column("fleet_name", sa.Text(), nullable=True))
    op.add_column("replica_groups", sa.Column("fleet_revision", sa.Integer(), nullable=True))
    op.add_column("replica_groups", sa.Column("manifest_uri", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replica_groups") as batch:
        batch.drop_column("manifest_uri")
        batch.drop_column("fleet_revision")
        batch.drop_column("fleet_name")
    op.drop_index("idx_fleet_rollouts_fleet", table_name="fleet_rollouts")
    op.drop_table("fleet_rollouts")
    op.drop_table("fleet_revisions")
