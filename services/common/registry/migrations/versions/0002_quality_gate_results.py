"""quality_gate_results: every verdict of the golden-set gate, with its figures.

Self-contained like 0001: the schema is spelled out here, not imported from the models.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

NOW = sa.text("CURRENT_TIMESTAMP")
FIGURES = ("reference_perplexity", "candidate_perplexity", "perplexity_delta_pct", "delta_low_pct",
           "delta_high_pct", "mean_abs_logprob_delta", "p99_abs_logprob_delta", "top1_agreement", "threshold_pct")


def upgrade() -> None:
    op.create_table(
        "quality_gate_results",
        sa.Column("gate_id", sa.Uuid(), nullable=False),
        sa.Column("model_name", sa.Text(), nullable=False),
        sa.Column("reference", sa.Text(), nullable=False),
        sa.Column("candidate", sa.Text(), nullable=False),
        sa.Column("candidate_dtype", sa.Text(), nullable=False),
        sa.Column("text_fingerprint", sa.Text(), nullable=False),
        sa.Column("chunks", sa.Integer(), nullable=False),
        sa.Column("scored_tokens", sa.Integer(), nullable=False),
        *(sa.Column(name, sa.Double(), nullable=False) for name in FIGURES),
        sa.Column("min_top1_agreement", sa.Double(), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("reasons", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("gate_id", name=op.f("pk_quality_gate_results")),
        sa.CheckConstraint("chunks > 0", name=op.f("ck_quality_gate_results_chunks_positive")),
    )
    op.create_index("idx_quality_gate_results_model_candidate", "quality_gate_results",
                    ["model_name", "candidate", "created_at"])


def downgrade() -> None:
    op.drop_index("idx_quality_gate_results_model_candidate", table_name="quality_gate_results")
    op.drop_table("quality_gate_results")
