"""Memory, time and money for one shard layout (tp, pp, dtype) of a model on a topology.

Memory, per GPU of pipeline stage s with L_s layers, TP degree t (Megatron sharding):

    heads_r   = heads / t                       query heads per rank
    kv_r      = kv_heads / t, or 1 when t > kv_heads (each KV head replicated t / kv_heads times)
    layer     = hidden·(heads_r·hd) + 2·hidden·(kv_r·hd) + (heads_r·hd)·hidden   q, k, v, o
              + 3·hidden·(intermediate / t)                                      gate, up, down
              at weight_bytes each, + one scale per output channel (quantized dtypes),
              + 2·hidden norm weights at activation bytes (replicated on every rank)
    stage 0   += ⌈vocab / t⌉·hidden               vocab-parallel embedding
    last      += ⌈vocab / t⌉·hidden + hidden      column-parallel lm_head (a tied lm_head is a
                                                 second copy when pp > 1) and the final norm
              a quantized dtype quantizes the lm_head too (weight_bytes + a scale per vocab row),
              and with it a tied embedding (the one table both use); an untied embedding stays
              at activation bytes
    weights_s = L_s·layer + those extras;  the layout needs, on its fullest stage,
                max_s weights_s + reserve + kv_cap ≤ gpu_memory

KV cache:  kv_bytes_per_token_per_gpu = 2 · L_max · kv_r · head_dim · kv_bytes, L_max the
largest stage (an uneven split makes the bigger stage the binding one: a sequence needs cache on
every stage at once). kv_tokens_per_gpu = ⌊kv_cap / that⌋; max_concurrent_sequences =
⌊kv_tokens_per_gpu / avg_context⌋. For Llama-3-70B fp16 at TP4/PP2: 2·40·2·128·2 = 40,960 B,
20 GiB / 40,960 B = 524,288 tokens, / 2,048 = 256 sequences.

Decode time of one micro-batch of b sequences on stage s (a roofline, the collectives, and the
serving stack's fixed costs):

    read_s    = L_s·layer + [s = last] (lm_head shard + final norm)   what a decode step streams:
                the embedding table is not read (one row per token is gathered), the lm_head is
    t_mem     = (read_s + b·ctx·kv_bytes_per_token_s) / (hbm_bandwidth / κ)
    t_flops   = (2·b·matmul_params_s + 4·b·ctx·heads_r·hd·L_s) / (peak_flops / κ)
    t_comm    = 2·L_s · all_reduce(b·hidden·act_bytes)      two row-parallel outputs per layer
              + [s = 0]    all_reduce(b·hidden·act_bytes)   vocab-parallel embedding
              + [s = last] all_gather(b·⌈vocab/t⌉·t·act_bytes)   logits before sampling
              + [s = last, p > 1] 2·send(result)            sampled tokens back to the driver
                                                            (a size, then the payload)
    t_sw      = κ · L_s · layer_overhead
              + [s = 0] (κ · step_overhead + [world > 1] 2·control_latency)   the driver schedules,
                                                            broadcasts the step (size + payload)
    t_s(b)    = max(t_mem, t_flops) + t_comm + t_sw
    send(b)   = α + b·hidden·act_bytes / B                  hidden state to the next stage

κ = topology.contention(tp · m) is 1 on GPUs; on a CPU host the tp · m ranks busy at once share
its memory bandwidth and cores (see topology.py). The overheads are 0 in the GPU presets and
measured by `shardline plan calibrate` on a host.

With c concurrent sequences the scheduler keeps m = min(c, pp) micro-batches of b = ⌈c/m⌉ in
flight. One decode iteration runs them through the pipeline GPipe-style, so

    TPOT(c)   = Σ_s (t_s(b) + send_s(b)) + (m − 1) · max_s (t_s(b) + send_s(b))
    bubble    = (p − 1) / (m + p − 1)

TPOT(1) is single-user latency (every stage in turn); at m = p = 2 a third of the stage-time is
idle. tokens/s per replica = c / TPOT(c) (or c · seq_tokens_per_s when that is given).

Money: a replica of g GPUs packs ⌊gpus_per_node / g⌋ to a node and is billed for its share of the
node (GPUs left idle by packing are paid for); a multi-node replica is billed for whole nodes.

    gpu_hours_per_million = billed_gpus · 10⁶ / (tokens_per_s_per_replica · 3600)
    usd_per_million       = gpu_hours_per_million · usd_per_gpu_hour

Blast radius: one failed GPU hangs its TP group's collectives and stalls the pipeline, and the
whole group is evicted and replaced, so it is every GPU of the replica (tp · pp).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.dtypes import canonical_dtype
from services.common.errors import InvalidArgument
from services.planner.comm import (
    Link,
    pp_boundary_links,
    result_return_link,
    ring_all_gather_s,
    ring_all_reduce_s,
    send_recv_s,
    tp_links,
)
from services.planner.specs import DType, ModelSpec, SpecError, ceil_div, get_dtype
from services.planner.topology import GIB, Topology

# A sampled token on its way back to the driver: a pickled StepResult entry (seq id, token id,
# logprob) is a few dozen bytes per sequence; only the link's latency matters at this size.
RESULT_BYTES_PER_SEQUENCE = 64


class LayoutError(InvalidArgument):
    """A (tp, pp) layout cannot shard this model at all (not a memory question)."""


class WorkloadError(InvalidArgument):
    """A workload figure (KV cap, context, concurrency, decode rate) is out of range."""


@dataclass(frozen=True)
class Candidate:
    """One shard layout: TP degree, PP degree and serving dtype."""

    tp: int
    pp: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, error=SpecError))

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def label(self) -> str:
        return f"TP{self.tp}/PP{self.pp} {self.dtype}"


@dataclass(frozen=True)
class Workload:
    """What the replica must hold and serve: KV cap per GPU, average context, concurrency."""

    kv_cap_bytes: int = 20 * GIB
    avg_context: int = 2048
    concurrency: int | None = None  # None → as many sequences as the KV cap holds
    seq_tokens_per_s: float | None = None  # overrides the predicted per-sequence decode rate

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cap_bytes, int) or self.kv_cap_bytes <= 0:
            raise WorkloadError(f"kv_cap_bytes must be a positive integer, got {self.kv_cap_bytes!r}")
        if not isinstance(self.avg_context, int) or self.avg_context <= 0:
            raise WorkloadError(f"avg_context must be a positive integer, got {self.avg_context!r}")
        if self.concurrency is not None and (not isinstance(self.concurrency, int) or self.concurrency < 1):
            raise WorkloadError(f"concurrency must be a positive integer, got {self.concurrency!r}")
        if self.seq_tokens_per_s is not None and not self.seq_tokens_per_s > 0:
            raise WorkloadError(f"seq_tokens_per_s must be > 0, got {self.seq_tokens_per_s!r}")


def stage_layer_counts(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, contiguous. An uneven remainder goes to the stages just before the
    last (vLLM's rule): the last stage already carries lm_head and stage 0 the embedding."""
    if pp > num_layers:
        raise LayoutError(f"pp {pp} exceeds the model's {num_layers} layers: every stage needs a layer")
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return tuple(counts)


def check_layout(model: ModelSpec, candidate: Candidate) -> None:
    """Raise :class:`LayoutError` when TP cannot split the model's heads or MLP evenly."""
    t = candidate.tp
    if model.num_attention_heads % t:
        raise LayoutError(f"tp {t} does not divide the {model.num_attention_heads} attention heads")
    kv = model.num_key_value_heads
    if kv % t and t % kv:
        raise LayoutError(
            f"tp {t} and the {kv} KV heads: one must divide the other (KV heads are split or replicated whole)"
        )
    if model.intermediate_size % t:
        raise LayoutError(f"tp {t} does not divide intermediate_size {model.intermediate_size}")
    stage_layer_counts(model.num_layers, candidate.pp)


@dataclass(frozen=True)
class StageShape:
    """What one GPU of one pipeline stage holds."""

    stage: int
    layers: int
    weight_bytes: int
    kv_bytes_per_token: int
    matmul_params: int  # parameters multiplied per token (linears + lm_head)
    read_bytes: int  # weight bytes one decode step streams (all but the embedding table)


@dataclass(frozen=True)
class CostEstimate:
    """Every figure the planner reports for one candidate. Times in seconds, memory in bytes."""

    candidate: Candidate
    stages: tuple[StageShape, ...]
    weight_bytes_per_gpu: int  # on the fullest stage
    kv_heads_per_rank: int
    kv_replication: int  # copies of each KV head across the TP group (1 = no replication)
    kv_bytes_per_token_per_gpu: int
    memory_needed_bytes: int  # weights + reserve + KV cap
    memory_left_bytes: int  # gpu_memory − memory_needed (negative: the shortfall)
    kv_budget_bytes: int
    kv_tokens_per_gpu: int
    max_concurrent_sequences: int
    tp_link: str
    all_reduce_decode_s: float  # one all-reduce of one token's hidden vector
    send_recv_decode_s: float  # one stage handoff of one token (0 when pp = 1)
    weight_read_s: float  # the stage that streams most: its decode read bytes / HBM bandwidth
    tpot_batch1_s: float
    concurrency: int
    micro_batches: int
    tpot_at_concurrency_s: float
    bubble_fraction: float
    seq_tokens_per_s: float
    tokens_per_s_per_replica: float
    replicas_per_node: int
    nodes_per_replica: int
    billed_gpus_per_replica: float
    gpu_hours_per_million_tokens: float | None
    usd_per_million_tokens: float | None
    blast_radius_gpus: int

    @property
    def fits(self) -> bool:
        return self.memory_left_bytes >= 0

    @property
    def shortfall_bytes(self) -> int:
        return max(0, -self.memory_left_bytes)


class CostModel:
    """Evaluates candidates of one model on one topology under one workload."""

    def __init__(self, model: ModelSpec, topology: Topology, workload: Workload | None = None) -> None:
        self.model = model
        self.topology = topology
        self.workload = workload or Workload()

    # ---- memory --------------------------------------------------------------------------

    def stage_shapes(self, candidate: Candidate) -> tuple[StageShape, ...]:
        check_layout(self.model, candidate)
        m, t, d = self.model, candidate.tp, get_dtype(candidate.dtype)
        hd, hidden = m.head_dim, m.hidden_size
        assert hd is not None
        heads_r = m.num_attention_heads // t
        kv_r = max(1, m.num_key_value_heads // t)
        q_r, kvw_r, inter_r = heads_r * hd, kv_r * hd, m.intermediate_size // t
        vocab_r = ceil_div(m.vocab_size, t)

        linear = hidden * q_r + 2 * hidden * kvw_r + q_r * hidden + 3 * hidden * inter_r
        out_channels = q_r + 2 * kvw_r + hidden + 2 * inter_r + hidden
        small = 2 * hidden  # input and post-attention norms
        if m.attention_bias:
            small += q_r + 2 * kvw_r
        if m.mlp_bias:
            small += 2 * inter_r + hidden
        layer_bytes = linear * d.weight_bytes + out_channels * d.scale_bytes + small * d.activation_bytes
        vocab_shard = vocab_r * hidden
        # the lm_head table: quantized with the linears (one scale per vocab row) or dense
        lm_table = vocab_shard * d.weight_bytes + vocab_r * d.scale_bytes
        embed_table = lm_table if m.tie_word_embeddings else vocab_shard * d.activation_bytes

        shapes: list[StageShape] = []
        counts = stage_layer_counts(m.num_layers, candidate.pp)
        for s, layers in enumerate(counts):
            weight = read = layers * layer_bytes
            matmul = layers * linear
            if s == 0:
                weight += embed_table
            if s == candidate.pp - 1:
                lm_head = lm_table
                weight += hidden * d.activation_bytes
                read += hidden * d.activation_bytes + lm_head
                shares_embedding = m.tie_word_embeddings and candidate.pp == 1
                if not shares_embedding:
                    weight += lm_head
                matmul += vocab_shard
            kv_per_token = 2 * layers * kvw_r * d.activation_bytes
            shapes.append(StageShape(s, layers, weight, kv_per_token, matmul, read))
        return tuple(shapes)

    # ---- time ----------------------------------------------------------------------------

    def _stage_times(self, candidate: Candidate, shapes: tuple[StageShape, ...], batch: int, *,
                     micro_batches: int = 1) -> list[float]:
        """t_s(b) + send_s(b) for every stage (the send is to the next stage; none after the last)."""
        m, topo, d = self.model, self.topology, get_dtype(candidate.dtype)
        t, p = candidate.tp, candidate.pp
        heads_r = m.num_attention_heads // t
        ctx = self.workload.avg_context
        # One TP group per micro-batch in flight works at a time; on a shared host they contend.
        kappa = topo.contention(t * micro_batches)
        bandwidth = topo.hbm_bandwidth_bytes_per_s / kappa
        peak = topo.peak_flops(d.compute) / kappa
        hidden_msg = batch * m.hidden_size * d.activation_bytes
        logits_msg = batch * ceil_div(m.vocab_size, t) * t * d.activation_bytes
        tps = tp_links(topo, t, p)
        boundaries = pp_boundary_links(topo, t, p)
        result_link = result_return_link(topo, t, p)
        times: list[float] = []
        for shape in shapes:
            link = tps[shape.stage]
            mem = (shape.read_bytes + batch * ctx * shape.kv_bytes_per_token) / bandwidth
            flops = 2 * batch * shape.matmul_params + 4 * batch * ctx * heads_r * m.head_dim * shape.layers  # type: ignore[operator]
            comm = 2 * shape.layers * ring_all_reduce_s(hidden_msg, t, link)
            software = kappa * shape.layers * topo.layer_overhead_s
            if shape.stage == 0:
                comm += ring_all_reduce_s(hidden_msg, t, link)
                software += kappa * topo.step_overhead_s
                if candidate.gpus > 1:
                    software += 2 * topo.control_latency_s
            if shape.stage == p - 1:
                comm += ring_all_gather_s(logits_msg, t, link)
                if result_link is not None:
                    comm += 2 * send_recv_s(batch * RESULT_BYTES_PER_SEQUENCE, result_link)
            else:
                comm += send_recv_s(hidden_msg, boundaries[shape.stage])
            times.append(max(mem, flops / peak) + comm + software)
        return times

    def tpot_s(self, candidate: Candidate, concurrency: int, shapes: tuple[StageShape, ...] | None = None) -> float:
        """Predicted time per output token with ``concurrency`` sequences decoding together."""
        if concurrency < 1:
            raise WorkloadError(f"concurrency must be ≥ 1, got {concurrency}")
        shapes = shapes or self.stage_shapes(candidate)
        micro = min(concurrency, candidate.pp)
        times = self._stage_times(candidate, shapes, ceil_div(concurrency, micro), micro_batches=micro)
        return sum(times) + (micro - 1) * max(times)

    # ---- everything ----------------------------------------------------------------------

    def estimate(self, candidate: Candidate) -> CostEstimate:
        """All figures for ``candidate``; raises :class:`LayoutError` if it cannot shard the model."""
        m, topo, w = self.model, self.topology, self.workload
        d: DType = get_dtype(candidate.dtype)
        shapes = self.stage_shapes(candidate)
        t, p = candidate.tp, candidate.pp
        kv_r = max(1, m.num_key_value_heads // t)

        weight = max(s.weight_bytes for s in shapes)
        kv_per_token = max(s.kv_bytes_per_token for s in shapes)
        needed = weight + topo.reserve_bytes + w.kv_cap_bytes
        left = topo.gpu_memory_bytes - needed
        kv_budget = min(w.kv_cap_bytes, max(0, topo.gpu_memory_bytes - weight - topo.reserve_bytes))
        kv_tokens = kv_budget // kv_per_token
        max_seqs = kv_tokens // w.avg_context

        link = tp_links(topo, t, p)[0]
        hidden_msg = m.hidden_size * d.activation_bytes
        boundaries = pp_boundary_links(topo, t, p)
        handoff = max((send_recv_s(hidden_msg, b) for b in boundaries), default=0.0)

        concurrency = min(w.concurrency, max_seqs) if w.concurrency else max_seqs
        tpot1 = self.tpot_s(candidate, 1, shapes)
        if concurrency >= 1:
            micro = min(concurrency, p)
            tpot_c = self.tpot_s(candidate, concurrency, shapes)
            seq_rate = w.seq_tokens_per_s or 1.0 / tpot_c
            tokens_per_s = concurrency * seq_rate
        else:
            micro, tpot_c, seq_rate, tokens_per_s = 0, float("inf"), 0.0, 0.0
        bubble = bubble_fraction(p, max(micro, 1))

        gpn = topo.gpus_per_node
        replicas_per_node = gpn // candidate.gpus
        nodes_per_replica = ceil_div(candidate.gpus, gpn)
        billed = gpn / replicas_per_node if replicas_per_node else float(nodes_per_replica * gpn)
        if tokens_per_s > 0:
            gpu_hours = billed * 1e6 / (tokens_per_s * 3600.0)
            usd: float | None = gpu_hours * topo.usd_per_gpu_hour
        else:
            gpu_hours, usd = None, None

        return CostEstimate(
            candidate=candidate,
            stages=shapes,
            weight_bytes_per_gpu=weight,
            kv_heads_per_rank=kv_r,
            kv_replication=max(1, t // m.num_key_value_heads),
            kv_bytes_per_token_per_gpu=kv_per_token,
            memory_needed_bytes=needed,
            memory_left_bytes=left,
            kv_budget_bytes=kv_budget,
            kv_tokens_per_gpu=kv_tokens,
            max_concurrent_sequences=max_seqs,
            tp_link=link.name if t > 1 else "none",
            all_reduce_decode_s=ring_all_reduce_s(hidden_msg, t, link),
            send_recv_decode_s=handoff,
            weight_read_s=max(s.read_bytes for s in shapes) / topo.hbm_bandwidth_bytes_per_s,
            tpot_batch1_s=tpot1,
            concurrency=concurrency,
            micro_batches=micro,
            tpot_at_concurrency_s=tpot_c,
            bubble_fraction=bubble,
            seq_tokens_per_s=seq_rate,
            tokens_per_s_per_replica=tokens_per_s,
            replicas_per_node=replicas_per_node,
            nodes_per_replica=nodes_per_replica,
            billed_gpus_per_replica=billed,
            gpu_hours_per_million_tokens=gpu_hours,
            usd_per_million_tokens=usd,
            blast_radius_gpus=candidate.gpus,
        )


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """GPipe idle fraction (p − 1) / (m + p − 1) of p stages fed m micro-batches."""
    if pp < 1 or micro_batches < 1:
        raise LayoutError(f"pp and micro_batches must be ≥ 1, got pp={pp}, micro_batches={micro_batches}")
    return (pp - 1) / (micro_batches + pp - 1)


__all__ = [
    "Candidate",
    "CostEstimate",
    "CostModel",
    "Link",
    "LayoutError",
    "StageShape",
    "Workload",
    "WorkloadError",
    "bubble_fraction",
    "check_layout",
    "stage_layer_counts",
]
