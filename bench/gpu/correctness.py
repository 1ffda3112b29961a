"""The device check's correctness half: our model, engine and sampler on a device against
``transformers`` on the same device, the same weights and the same dtype.

Each (model, dtype) is checked five ways, each a :class:`Check` with its figure and its bound:

- ``prompt_logprobs``: teacher-forced log p(ids[i+1] | ids[..i]) of a prompt, our scoring
  prefill vs transformers' forward;
- ``decode_logprobs``: the log-probabilities our engine reported for the tokens it generated
  (through the paged KV cache, decode steps from CUDA graphs on a GPU) vs transformers'
  teacher-forced ones for the same tokens;
- ``greedy_tokens``: our greedy completion vs ``transformers.generate`` (required in float32;
  bfloat16 roundings may flip a near-tie, so there it is reported, not required);
- ``graphs_vs_eager``: the same requests with decode graphs and with every step eager
  (``--enforce-eager``): identical tokens (required in float32), log-probabilities within the bound;
- ``batch_invariance``: each prompt's greedy tokens alone and in one batch with the others
  (float32).

Quantized plans (int8, fp8) are checked against the bfloat16 plan of the same weights: the
largest logit difference over a prompt within 15 % of the largest logit.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.common.sampling import SamplingParams
from services.modeling.attention import AttentionMetadata
from services.modeling.tiny import TinyModelSpec, write_tiny_model
from services.worker.engine.bootstrap import collect
from services.worker.engine.engine import LLMEngine
from services.worker.engine.kv_cache import CacheConfig, KVCacheLayout
from services.worker.engine.runner import StageRunner
from services.worker.runtime import RankRuntime, RankSpec
from services.worker.scoring import score_tokens

# per-token log-probability bounds (the issue's): float32 vs float32, bfloat16 vs bfloat16
LOGPROB_BOUND = {"float32": 1e-3, "bfloat16": 5e-2}
QUANT_LOGIT_BOUND = 0.15  # of the largest |logit| of the bfloat16 plan
SMOLLM2_SHAPE = TinyModelSpec(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152,
                              rope_theta=100000.0, tie_embeddings=True, seed=1)


@dataclass
class Check:
    name: str
    model: str
    dtype: str
    passed: bool
    value: float
    bound: float | None
    required: bool = True
    detail: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def make_models(root: Path, *, quick: bool, smollm2_dir: Path | None) -> dict[str, Path]:
    """The models to check: the tiny random Llama, and SmolLM2 (its trained weights when a
    directory is given; else random weights of its shape: GQA 9/3, head_dim 64, tied embeddings)."""
    models = {"tiny": write_tiny_model(TinyModelSpec(), root / "tiny").out_dir}
    if smollm2_dir is not None:
        models["smollm2"] = smollm2_dir
    elif not quick:
        models["smollm2-shape"] = write_tiny_model(SMOLLM2_SHAPE, root / "smollm2-shape").out_dir
    return models


class Ours:
    """One rank of our own on ``device``: scoring and an engine over a paged KV cache."""

    def __init__(self, model_dir: Path, dtype: str, device: str, *, graphs: bool, max_batch: int = 8) -> None:
        spec = RankSpec(str(model_dir), dtype=dtype, device=device, max_num_seqs=max_batch,
                        cache=CacheConfig(kv_cache_bytes=64 << 20))
        self.rt = RankRuntime.start(spec, 0)
        layout = KVCacheLayout.for_plan(self.rt.plan, spec.cache)
        sched = spec.scheduler_config()
        self.runner = StageRunner(self.rt, layout, decode_graphs=graphs, max_batch=max_batch,
                                  max_model_len=sched.max_model_len)
        self.engine = LLMEngine(self.runner, layout, tokenizer=None, scheduler_config=sched)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        handles = [self.engine.submit(p, params) for p in prompts]
        self.engine.run_until_done()
        return [(c.token_ids, c.logprobs) for c in map(collect, handles)]

    def prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(score_tokens(self.rt, ids).logprobs)

    def logits(self, ids: list[int]) -> torch.Tensor:
        model, device = self.rt.model, self.rt.device
        hidden = model(torch.arange(len(ids), device=device), AttentionMetadata.prefill([len(ids)]),
                       input_ids=torch.tensor(ids, device=device))
        return model.compute_logits(hidden).cpu()


class Reference:
    """``transformers.LlamaForCausalLM`` on the same weights, device and dtype."""

    def __init__(self, model_dir: Path, dtype: str, device: str) -> None:
        import transformers  # deferred: a test and benchmark dependency, not a runtime one

        self.device = device
        torch_dtype = getattr(torch, dtype)  # given to the loader and asserted after, whatever its version
        self.model = transformers.LlamaForCausalLM.from_pretrained(
            str(model_dir), dtype=torch_dtype).to(device=device, dtype=torch_dtype).eval()

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([ids], device=self.device)).logits[0, :-1].float()
        targets = torch.tensor(ids[1:], device=self.device)[:, None]
        return torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1).cpu()

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        out = self.model.generate(torch.tensor([ids], device=self.device), max_new_tokens=n, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
                                  pad_token_id=0)
        return out[0, len(ids):].tolist()


def prompts_for(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens two completions share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_dense(name: str, model_dir: Path, dtype: str, device: str, *, quick: bool) -> list[Check]:
    prompts = prompts_for(_vocab(model_dir), (7, 33, 18, 64) if not quick else (7, 20))
    max_tokens = 12 if quick else 24
    bound, fp32 = LOGPROB_BOUND[dtype], dtype == "float32"
    ref = Reference(model_dir, dtype, device)
    graphs, eager = Ours(model_dir, dtype, device, graphs=True), Ours(model_dir, dtype, device, graphs=False)
    checks = []

    scored = max((graphs.prompt_logprobs(p) - ref.logprobs(p)).abs().max().item() for p in prompts)
    checks.append(Check("prompt_logprobs", name, dtype, scored <= bound, scored, bound))

    batched = graphs.generate(prompts, max_tokens)
    gap = max((torch.tensor(lps) - ref.logprobs(p + toks)[-len(toks):]).abs().max().item()
              for p, (toks, lps) in zip(prompts, batched))
    static = graphs.runner.graphs
    how = (f"{static.replays} of {static.steps} decode steps replayed from CUDA graphs {static.captured}"
           if static.capture else f"{static.steps} decode steps from the graphs' padded buffers, eagerly")
    checks.append(Check("decode_logprobs", name, dtype, gap <= bound, gap, bound,
                        detail=f"{len(prompts)} sequences x {max_tokens} tokens; {how}"))

    hf = [ref.greedy(p, max_tokens) for p in prompts]
    agree = min(_agreement(toks, h) / max_tokens for (toks, _), h in zip(batched, hf))
    checks.append(Check("greedy_tokens", name, dtype, agree == 1.0, agree, 1.0, required=fp32,
                        detail="fraction of tokens before the first difference, worst prompt"))

    plain = eager.generate(prompts, max_tokens)
    same = all(a[0] == b[0] for a, b in zip(batched, plain))
    lp_gap = max((torch.tensor(a[1]) - torch.tensor(b[1])).abs().max().item() for a, b in zip(batched, plain))
    checks.append(Check("graphs_vs_eager", name, dtype, (same or not fp32) and lp_gap <= bound, lp_gap, bound,
                        detail=f"tokens identical: {same}"))

    if fp32:
        alone = [graphs.generate([p], max_tokens)[0][0] for p in prompts]
        invariant = all(a == b[0] for a, b in zip(alone, batched))
        checks.append(Check("batch_invariance", name, dtype, invariant, float(invariant), 1.0,
                            detail="greedy tokens of each prompt alone == in the batch"))
    del ref, graphs, eager
    _free(device)
    return checks


def check_quantized(name: str, model_dir: Path, device: str) -> list[Check]:
    [ids] = prompts_for(_vocab(model_dir), (32,), seed=5)
    base = Ours(model_dir, "bfloat16", device, graphs=False).logits(ids)
    top = base.abs().max().item()
    checks = []
    for dtype in ("int8", "fp8"):
        diff = (Ours(model_dir, dtype, device, graphs=False).logits(ids) - base).abs().max().item() / top
        checks.append(Check("logits_vs_bfloat16", name, dtype, diff <= QUANT_LOGIT_BOUND, diff, QUANT_LOGIT_BOUND,
                            detail="max |logit - bfloat16 plan's| / max |logit|"))
        _free(device)
    return checks


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run(models: dict[str, Path], device: str, *, quick: bool) -> list[Check]:
    checks: list[Check] = []
    for name, path in models.items():
        for dtype in ("float32", "bfloat16"):
            checks += check_dense(name, path, dtype, device, quick=quick)
    checks += check_quantized("tiny", models["tiny"], device)
    return checks
