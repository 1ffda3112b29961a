"""Attention over a flattened batch, reading past keys and values through block tables.

A step's tokens from every sequence are concatenated (``query_lens`` says how many belong to
each). With a paged KV cache, new keys/values are written to their ``slot_mapping`` slots first,
then each sequence's context is gathered block by block through its ``block_table``. This gather
+ ``scaled_dot_product_attention`` is the reference path (the CPU kernels read the blocks in place
and take a prefill's tokens as decode rows, :attr:`AttentionMetadata.per_token`); a paged-attention
kernel can replace :func:`paged_attention` on GPU without touching the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Layout of one forward step. ``context_lens[i]`` counts sequence i's tokens in the cache
    after this step (past + new); without a cache it equals ``query_lens[i]``."""

    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor | None = None  # [n_tokens] flat slot = block * block_size + offset
    block_tables: torch.Tensor | None = None  # [n_seqs, max_blocks] int64, padded with 0
    # a decode step replayed from a CUDA graph reads everything from tensors: every sequence's
    # context padded to ``static_width`` keys (block_tables' width in tokens), masked from
    # ``_context_lens``; the lists above are not read then (no host value may reach the graph)
    static_width: int | None = None
    _decode_mask: torch.Tensor | None = None
    _context_lens: torch.Tensor | None = None

    def context_lens_tensor(self, device: torch.device) -> torch.Tensor:
        """``context_lens`` as an int64 tensor, built once per step."""
        if self._context_lens is None:
            self._context_lens = torch.tensor(self.context_lens, dtype=torch.int64, device=device)
        return self._context_lens

    def decode_mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, 1, 1, max_ctx] additive padding mask of a decode batch (0 or -inf, in the query's
        dtype: a boolean mask would be converted by every layer); None when no row is padded.
        Built once per step, shared by every layer."""
        if self._decode_mask is None and self.static_width is not None:
            assert self._context_lens is not None, "a static-width step brings its context lengths as a tensor"
            padding = torch.arange(self.static_width, device=device)[None, :] >= self._context_lens[:, None]
            mask = torch.zeros(padding.shape, dtype=dtype, device=device).masked_fill_(padding, float("-inf"))
            self._decode_mask = mask[:, None, None, :]
        if self._decode_mask is None and len(set(self.context_lens)) > 1:
            lens = torch.tensor(self.context_lens, device=device)
            max_ctx = max(self.context_lens)
            padding = torch.arange(max_ctx, device=device)[None, :] >= lens[:, None]
            mask = torch.zeros(padding.shape, dtype=dtype, device=device).masked_fill_(padding, float("-inf"))
            self._decode_mask = mask[:, None, None, :]
        return self._decode_mask

    @classmethod
    def prefill(cls, lengths: list[int]) -> AttentionMetadata:
        return cls(query_lens=list(lengths), context_lens=list(lengths))

    @functools.cached_property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @functools.cached_property
    def per_token(self) -> AttentionMetadata:
        """This step as a decode step of one-token rows, one per query token: token j of a
        sequence with n new tokens and ctx in the cache sees its first ctx - n + j + 1 keys,
        through the sequence's block table. Built once per step."""
        assert self.block_tables is not None
        lens: list[int] = []
        for n, ctx in zip(self.query_lens, self.context_lens):
            lens.extend(range(ctx - n + 1, ctx + 1))
        device = self.block_tables.device
        seqs = torch.repeat_interleave(torch.arange(len(self.query_lens), device=device),
                                       torch.tensor(self.query_lens, device=device))
        return AttentionMetadata(query_lens=[1] * len(lens), context_lens=lens,
                                 block_tables=self.block_tables.index_select(0, seqs))


def _causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor | None:
    """Query i sits at absolute position ctx_len - q_len + i and may see keys up to there."""
    if q_len == 1:
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    return k_pos <= q_pos


def attention_no_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                       scale: float) -> torch.Tensor:
    """Causal self-attention over each sequence's new tokens only (a whole-prompt prefill)."""
    outs, start = [], 0
    for n in meta.query_lens:
        # 4-D inputs take the CPU flash kernel; 3-D ones fall back to the math path (two bmm)
        qi, ki, vi = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=n > 1, scale=scale,
                                                   enable_gqa=True)[0].transpose(0, 1))
        start += n
    return torch.cat(outs, dim=0)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The blocks ``tables`` [B, n] names, as [B, n · block_size, kv_heads, d]. ``index_select``
    copies whole contiguous blocks; advanced indexing (``cache[tables]``) is ~8x slower on CPU."""
    rows = cache.index_select(0, tables.reshape(-1))
    return rows.view(tables.shape[0], -1, *cache.shape[2:])


def gather_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence (``q`` [B, heads, d]): gather every context padded to the longest,
    mask the padding, SDPA. The reference for the paged decode kernels (LayerOps)."""
    assert meta.block_tables is not None
    max_ctx = meta.static_width or max(meta.context_lens)
    n_blocks = -(-max_ctx // k_cache.shape[1])
    tables = meta.block_tables[:, :n_blocks]
    keys = gather_blocks(k_cache, tables)[:, :max_ctx].transpose(1, 2)  # [B, kv, L, d]
    values = gather_blocks(v_cache, tables)[:, :max_ctx].transpose(1, 2)
    mask = meta.decode_mask(q.device, q.dtype)
    # the query heads sharing a KV head (h // group) as that head's rows: the same products as
    # enable_gqa without copying keys and values per query head, and a shape every SDPA backend
    # takes with a mask (with enable_gqa and a mask CUDA falls back to the math kernel)
    b, heads, d = q.shape
    out = F.scaled_dot_product_attention(q.view(b, keys.shape[1], heads // keys.shape[1], d), keys, values,
                                         attn_mask=mask, scale=scale)
    return out.reshape(b, heads, d)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Each sequence's queries (``q``: [tokens, heads, d]) against its cached context, causally
    (caches: [blocks, block_size, kv_heads, d]): the prefill and mixed-step path. Decode-only
    steps go through ``LayerOps.decode_attention``."""
    assert meta.block_tables is not None
    block_size = k_cache.shape[1]
    outs, start = [], 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        n_blocks = -(-ctx // block_size)
        table = meta.block_tables[i:i + 1, :n_blocks]
        keys = gather_blocks(k_cache, table)[:, :ctx].transpose(1, 2)  # [1, kv, ctx, d]
        values = gather_blocks(v_cache, table)[:, :ctx].transpose(1, 2)
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qi, keys, values, attn_mask=_causal_mask(n, ctx, q.device),
                                             scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
        start += n
    return torch.cat(outs, dim=0)
