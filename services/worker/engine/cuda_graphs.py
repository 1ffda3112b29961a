"""Decode steps replayed from CUDA graphs: one graph per (batch-size bucket, context bucket).

A decode step of a large model on one GPU is a few hundred kernel launches whose host-side cost
(Python, dispatch, launch) can exceed the GPU time they take at small batches. As vLLM does,
the step is captured once into a CUDA graph and replayed: the inputs are copied into static
buffers, one ``replay()`` launches everything, and the logits come back in a static buffer.

A graph has fixed shapes, so a batch of ``n`` sequences is padded up to the next captured batch
size (:data:`BATCH_BUCKETS`) and every context up to a power-of-two number of KV blocks (the
attention reads and masks that many keys per sequence: padding to the longest context the
group allows would make a short step read the whole budget). A padded row is a dummy sequence:
its one token is written to the KV cache's scratch block (one block past those the allocator
hands out) and it attends to that slot alone, so it never reads or writes a real sequence's
blocks and never sees an all-masked row; its logits are dropped.

Graphs are captured lazily, the first time a (batch, context) bucket is met, after two eager
warm-up runs on a side stream (lazy initialisation, library handles, the fp8 path's probe),
all in one memory pool. The warm-ups and the capture see the step's real inputs and write the
same keys and values twice into the same slots, which leaves the cache as one run would.

With ``capture=False`` (any device) the same padded static-buffer step runs eagerly: how the
CPU tests check the padding, bucketing and scratch-block rules that the graphs replay.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from services.modeling.attention import AttentionMetadata
from services.modeling.llama import LlamaForCausalLM
from services.worker.engine.step import SeqStep

log = logging.getLogger(__name__)

# the batch sizes graphs are captured for (vLLM's list, capped by the scheduler's max_num_seqs)
BATCH_BUCKETS = (1, 2, 4, 8, *range(16, 257, 16))
WARMUP_RUNS = 2


def bucket_of(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (``buckets`` ascending; ``n`` at most the last)."""
    return buckets[bisect.bisect_left(buckets, n)]


def context_buckets(max_blocks: int) -> tuple[int, ...]:
    """Powers of two below ``max_blocks``, then ``max_blocks`` itself: the widths, in KV blocks,
    that a step's contexts are padded to."""
    widths, w = [], 1
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return (*widths, max_blocks)


class DecodeGraphs:
    """The decode steps of one single-rank group (embedding, layers, lm_head: no collectives),
    from static buffers; captured into CUDA graphs when ``capture`` (a CUDA device)."""

    def __init__(self, model: LlamaForCausalLM, *, max_batch: int, max_blocks_per_seq: int, block_size: int,
                 scratch_block: int, capture: bool) -> None:
        if not (model.is_first_stage and model.is_last_stage):
            raise ValueError("decode graphs need the whole model on one rank (TP = PP = 1)")
        self.model = model
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture = capture
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.context_buckets = context_buckets(max_blocks_per_seq)
        device = model.lm_head.weight.device
        self.device = device
        n = self.max_batch = max_batch
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, **long)
        self.context_lens = torch.ones(n, **long)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, **long)
        self.logits = torch.empty(n, model.config.vocab_size, dtype=model.plan.torch_dtype, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.steps = self.replays = 0  # steps run here, and those replayed from a graph (tests, bench)

    def fits(self, seqs: Sequence[SeqStep]) -> bool:
        """A decode-only step (one token per sequence, each sampled) within the largest bucket."""
        return (0 < len(seqs) <= self.max_batch
                and all(len(s.token_ids) == 1 and s.sample for s in seqs)
                and max(len(s.block_table) for s in seqs) <= self.block_tables.shape[1])

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (batch, context blocks) buckets captured so far."""
        return sorted(self._graphs)

    @torch.inference_mode()
    def run(self, seqs: Sequence[SeqStep]) -> torch.Tensor:
        """The step's logits, ``[len(seqs), vocab]`` in the model's dtype (a view of the static
        buffer: read it before the next step)."""
        n = len(seqs)
        batch = bucket_of(n, self.batch_buckets)
        width = bucket_of(max(len(s.block_table) for s in seqs), self.context_buckets)
        self._load(seqs, batch, width)
        self.steps += 1
        key = (batch, width)
        graph = self._graphs.get(key) if self.capture else None
        if graph is None and self.capture:
            graph = self._capture(batch, width)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self._forward(batch, width, [s.context_len for s in seqs] + [1] * (batch - n))
        return self.logits[:n]

    def _load(self, seqs: Sequence[SeqStep], batch: int, width: int) -> None:
        """The step's inputs into the static buffers' first ``batch`` rows: real rows, then
        dummy rows on the scratch block. One host-to-device copy per buffer."""
        pad = batch - len(seqs)
        scratch_slot = self.scratch_block * self.block_size
        ids = [s.token_ids[0] for s in seqs] + [0] * pad
        positions = [s.positions[0] for s in seqs] + [0] * pad
        slots = [s.slots[0] for s in seqs] + [scratch_slot] * pad
        lens = [s.context_len for s in seqs] + [1] * pad
        tables = [s.block_table + [self.scratch_block] * (width - len(s.block_table)) for s in seqs]
        tables += [[self.scratch_block] * width] * pad
        for buffer, rows in ((self.input_ids, ids), (self.positions, positions), (self.slot_mapping, slots),
                             (self.context_lens, lens)):
            buffer[:batch].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        self.block_tables[:batch, :width].copy_(torch.tensor(tables, dtype=torch.int64), non_blocking=True)

    def _forward(self, batch: int, width: int, context_lens: list[int] | None = None) -> None:
        """One padded decode step from the static buffers into ``self.logits``; reads no host
        value (``context_lens``, the host copy, only for kernels that take the lists: eager
        runs on the CPU)."""
        meta = AttentionMetadata(query_lens=[1] * batch, context_lens=context_lens or [width * self.block_size] * batch,
                                 slot_mapping=self.slot_mapping[:batch], block_tables=self.block_tables[:batch, :width],
                                 static_width=width * self.block_size, _context_lens=self.context_lens[:batch])
        hidden = self.model(self.positions[:batch], meta, input_ids=self.input_ids[:batch])
        self.logits[:batch] = self.model.compute_logits(hidden, float32=False)

    def _capture(self, batch: int, width: int) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward(batch, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(batch, width)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(batch, width)] = graph
        log.info("captured a decode CUDA graph for %d sequences of up to %d tokens", batch, width * self.block_size)
        return graph
