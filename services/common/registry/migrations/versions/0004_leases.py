"""Leadership leases: one fleet controller acts at a time, and a deposed one cannot write.

- ``leases``: a lease by name (``fleet-controller/<fleet>``): its holder, its term (one more with every
  new holder), how many times the holder renewed it, the holder's TTL, and when it last renewed
  (for people: observers time expiry on their own clocks).

Self-contained like 0001.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

NOW = sa.text("CURRENT_TIMESTAMP")


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("renewals", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("ttl_s", sa.Double(), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leases")),
        sa.CheckConstraint("term > 0", name=op.f("ck_leases_term_positive")),
        sa.CheckConstraint("ttl_s > 0", name=op.f("ck_leases_ttl_positive")),
    )


def downgrade() -> None:
    op.drop_table("leases")
