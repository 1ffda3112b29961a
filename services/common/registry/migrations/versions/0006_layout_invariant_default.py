"""The layout-invariant numerics become the default; the other mode is named ``per-layout``.

- ``replica_groups.numerics``: rows that said ``default`` (the backend's all-reduce order, which
  each TP degree rounds differently) say ``per-layout``; a row written without a value is
  ``layout-invariant``, what a plan now runs unless told otherwise.

Self-contained like 0001.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

OLD_CHECK = "numerics IN ('default', 'layout-invariant')"
NEW_CHECK = "numerics IN ('layout-invariant', 'per-layout')"


def _rename(old: str, new: str, server_default: str, check: str) -> None:
    """Rows saying ``old`` say ``new``; the column's default and check follow."""
    with op.batch_alter_table("replica_groups") as batch:
        batch.drop_constraint(op.f("ck_replica_groups_numerics"), type_="check")
    op.execute(sa.text("UPDATE replica_groups SET numerics = :new WHERE numerics = :old").bindparams(old=old, new=new))
    with op.batch_alter_table("replica_groups") as batch:
        batch.alter_column("numerics", existing_type=sa.Text(), server_default=sa.text(f"'{server_default}'"))
        batch.create_check_constraint(op.f("ck_replica_groups_numerics"), check)


def upgrade() -> None:
    _rename("default", "per-layout", "layout-invariant", NEW_CHECK)


def downgrade() -> None:
    _rename("per-layout", "default", "default", OLD_CHECK)
