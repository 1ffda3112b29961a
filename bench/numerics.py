"""The price of layout-invariant numerics (the default): the same engine in it and per-layout.

    python -m bench.numerics [--rounds 3] [--tps 1,3] [--dtype bfloat16|int8|fp8] [--model smollm2|1b-class]

SmolLM2-135M (3 k-chunks per row-parallel layer) or the 1B-class shape (TP 1/2/4/8, so 8 k-chunks),
bfloat16 (or int8/fp8 weights); results named ``numerics[-<dtype>][-1b-class]``. For each TP
degree, each round runs both modes (in alternating order), each as one replica group
(``layout_rank``: rank 0 drives the engine, the others follow): TPOT at batch 1 (64 tokens) and
output tok/s with 16 requests at once (64 tokens each), and the prefill of one 512-token prompt. The
figures are medians over rounds of the per-round ratios invariant / per-layout, so a burst of other
work on the host lands on both. Writes ``bench/results/<that name>.{json,md}``.

Where the cost is: each row-parallel layer (o_proj, down_proj) sums its fixed k-chunks' products
in one pass over its weight (on a packed weight the kernel rounds each chunk's sums to bfloat16 as
the chunk ends and adds them in float32 in registers; elsewhere a task takes each chunk of its
channels in turn and sums them while in cache), so a chunk's sums are reduced and rounded once
more than a whole row's, and the chains are shorter; at TP1 that and the sum are the whole
price (the fused C++ decoder-layer call runs in this mode too; a quantized weight's chunks are one
quantized-kernel call each there). At TP > 1 the all-reduce becomes an all-gather of the
chunks' bfloat16 products and a fixed-order sum.
"""

from __future__ import annotations

import argparse
import statistics

from tokenizers import Tokenizer

from bench.common import machine, one_b_class_dir, publish_results, smollm2_dir
from bench.engine import layout_rank, make_prompts
from services.worker.engine.kv_cache import CacheConfig
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec

MODES = ("per-layout", "layout-invariant")
MODELS = {"smollm2": "SmolLM2-135M", "1b-class": "1B-class (random weights)"}


def one(model_dir, tp: int, dtype: str, numerics: str, prompts, max_tokens: int) -> dict:
    # no prefix caching: the warm-up run would leave the measured prompts' KV cached
    spec = RankSpec(str(model_dir), tp_degree=tp, dtype=dtype, numerics=numerics,
                    cache=CacheConfig(kv_cache_bytes=256 << 20), prefix_caching=False)
    return run_replica_group(tp, layout_rank, spec, prompts, max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.numerics", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tps", default="1,3", help="TP degrees (SmolLM2 allows 1 and 3)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "int8", "fp8"))
    parser.add_argument("--model", default="smollm2", choices=tuple(MODELS))
    parser.add_argument("--name", default=None, help="results name (default numerics[-<dtype>][-1b-class]), so that "
                                                     "another machine's run need not overwrite the one README cites")
    args = parser.parse_args(argv)
    model_dir = smollm2_dir() if args.model == "smollm2" else one_b_class_dir(smollm2_dir())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    batch = make_prompts(tokenizer, 16)
    long_prompt = [tokenizer.encode("The river runs through the old town. ").ids * 64][0][:512]
    rows = []
    for tp in (int(t) for t in args.tps.split(",")):
        per_round = []
        for i in range(args.rounds):
            got: dict[str, dict] = {}
            for numerics in (MODES if i % 2 == 0 else MODES[::-1]):
                bs1 = one(model_dir, tp, args.dtype, numerics, batch[:1], 64)
                bs16 = one(model_dir, tp, args.dtype, numerics, batch, 64)
                prefill = one(model_dir, tp, args.dtype, numerics, [long_prompt], 1)
                got[numerics] = {"tpot_s": bs1["tpot_s"], "tok_s": bs16["tok_per_s"],
                                 "prefill_s": prefill["elapsed_s"]}
            per_round.append(got)
            print(f"TP{tp} round {i}: {got}", flush=True)
        ratio = {key: statistics.median(r["layout-invariant"][key] / r["per-layout"][key] for r in per_round)
                 for key in ("tpot_s", "tok_s", "prefill_s")}
        median = {mode: {key: statistics.median(r[mode][key] for r in per_round)
                         for key in ("tpot_s", "tok_s", "prefill_s")} for mode in MODES}
        rows.append({"tp": tp, "rounds": per_round, "ratio": ratio, "median": median})
    payload = {"machine": machine(), "model": MODELS[args.model], "dtype": args.dtype, "rows": rows}
    lines = ["# Layout-invariant numerics: the price", "",
             f"{MODELS[args.model]} {args.dtype}, {args.rounds} rounds per TP degree, modes alternating; "
             f"{payload['machine']['cpu_model']}, {payload['machine']['cpu_count']} cores (TP > 1 runs every rank on "
             f"them: its TPOT and tok/s say little; its prefill shows the all-gather of the chunks' products).", "",
             "| TP | TPOT bs1 per-layout / invariant (ms) | ratio | tok/s at 16 per-layout / invariant | ratio "
             "| prefill 512 tokens per-layout / invariant (ms) | ratio |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        d, v, r = row["median"]["per-layout"], row["median"]["layout-invariant"], row["ratio"]
        lines.append(f"| {row['tp']} | {d['tpot_s'] * 1e3:.1f} / {v['tpot_s'] * 1e3:.1f} | {r['tpot_s']:.3f} "
                     f"| {d['tok_s']:.0f} / {v['tok_s']:.0f} | {r['tok_s']:.3f} "
                     f"| {d['prefill_s'] * 1e3:.0f} / {v['prefill_s'] * 1e3:.0f} | {r['prefill_s']:.3f} |")
    dtype_flag = "" if args.dtype == "bfloat16" else f" --dtype {args.dtype}"
    model_flag = "" if args.model == "smollm2" else f" --model {args.model}"
    lines += ["", f"(`python -m bench.numerics --rounds {args.rounds} --tps {args.tps}{dtype_flag}{model_flag}`)", ""]
    markdown = "\n".join(lines)
    name = args.name or "numerics" + ("" if args.dtype == "bfloat16" else f"-{args.dtype}") + \
        model_flag.replace(" --model ", "-")
    name_flag = f" --name {args.name}" if args.name else ""
    markdown = markdown.replace(f"{model_flag}`)", f"{model_flag}{name_flag}`)")
    return publish_results(name, payload, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
