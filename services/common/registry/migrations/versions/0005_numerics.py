"""How a replica group orders its layout-dependent sums.

- ``replica_groups`` gains ``numerics``: ``default`` or ``layout-invariant`` (the same bits at every
  TP and PP degree of the same weights and dtype), recorded by whoever creates the group's row
  (a fleet controller from its spec, a worker from its plan). Existing rows are ``default``.

Self-contained like 0001.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

NUMERICS_CHECK = "numerics IN ('default', 'layout-invariant')"


def upgrade() -> None:
    with op.batch_alter_table("replica_groups") as batch:
        batch.add_column(sa.Column("numerics", sa.Text(), server_default=sa.text("'default'"), nullable=False))
        batch.create_check_constraint(op.f("ck_replica_groups_numerics"), NUMERICS_CHECK)


def downgrade() -> None:
    with op.batch_alter_table("replica_groups") as batch:
        batch.drop_constraint(op.f("ck_replica_groups_numerics"), type_="check")
        batch.drop_column("numerics")
