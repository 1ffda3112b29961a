"""A step's sequences laid out as one batch of rows: the only place the engine flattens them.

Each sequence of a step (the scheduler's :class:`~services.worker.engine.scheduler.ScheduledSequence`
or the plan's :class:`~services.worker.engine.step.SeqStep`: both carry ``token_ids``,
``positions``, ``slots``, ``block_table``, ``context_len`` and ``sample``) contributes its tokens
as consecutive rows, in the step's order; the attention metadata describes the same rows, and a
sampled sequence's logits come from its last row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.modeling.attention import AttentionMetadata


class StepRows(Protocol):
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_table: list[int]
    context_len: int
    sample: bool


@dataclass(frozen=True)
class FlatBatch:
    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # the row of each sampled sequence's last token, in step order

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


def flatten(seqs: Sequence[StepRows], device: torch.device | str = "cpu") -> FlatBatch:
    """The rows of ``seqs`` in order; block tables padded with block 0 to the longest."""
    width = max(len(s.block_table) for s in seqs)
    # one tensor from one padded list: a row at a time cost 12 us a sequence
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int64)
    sample_rows, end = [], 0
    for s in seqs:
        end += len(s.token_ids)
        if s.sample:
            sample_rows.append(end - 1)
    meta = AttentionMetadata(
        query_lens=[len(s.token_ids) for s in seqs],
        context_lens=[s.context_len for s in seqs],
        slot_mapping=torch.tensor([x for s in seqs for x in s.slots], dtype=torch.int64, device=device),
        block_tables=tables.to(device),
    )
    return FlatBatch(torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=device),
                     torch.tensor([p for s in seqs for p in s.positions], dtype=torch.int64, device=device),
                     meta, sample_rows)
