"""lm-eval against `shardline up`: the same loglikelihood task through our router and through
lm-eval's own Hugging Face model must give the same accuracy and per-item loglikelihoods.

``python -m bench.compat.lm_eval_check [--model tiny|smollm2|DIR] [--batch-size 1] [--tol 1e-3]``

lm-eval (PyPI ``lm-eval``, 0.4.x) is not a runtime dependency of shardline, nor installed by
``make setup`` / ``make test`` (it pulls ``datasets``, ``evaluate``, ``sacrebleu`` ...). It is the
optional extra ``compat``: ``.venv/bin/pip install -c constraints.txt -e '.[compat]'``.

What it does, offline (no model hub, no dataset download):

1. writes a small multiple-choice task (``ITEMS``: one-line questions, four choices) as a
   jsonl file and an lm-eval task YAML (``dataset_path: json`` + ``data_files``) into a
   temporary directory, loaded with ``TaskManager(include_path=...)``;
2. starts ``shardline up --model DIR --dtype float32`` on free ports (its own state and logs),
   waits for ``/health``, and runs the task with lm-eval's ``local-completions`` model on
   ``/v1/completions`` (``tokenized_requests=True``, the model directory as the tokenizer: lm-eval
   sends token ids with ``echo: true, logprobs: 1, max_tokens: 1`` and reads the prompt's
   logprobs back), then stops the stack;
3. runs the same task with lm-eval's ``hf`` model on the same directory (float32, CPU);
4. compares accuracy and every (item, choice) loglikelihood; prints a table; writes
   ``bench/results/lm-eval.json`` and ``.md``. Exit 0 only when the accuracies are equal and
   every |Δ loglikelihood| ≤ ``--tol``.

Both runs send the items without a BOS token (``add_bos_token=False``), so that the token ids
agree: ``hf`` with ``add_bos_token=True`` hands it to the tokenizer (which then prepends BOS, e.g.
SmolLM2's), while ``local-completions`` only asks for the tokenizer's special tokens (none there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.common import RESULTS
from bench.soak import Stack
from services.cli.up import resolve_model
from services.common.ports import free_port_run

TASK = "shardline_mc"
RESULT_NAME = "lm-eval"

# (question, choices, index of the answer): general knowledge a small model has a chance at
ITEMS: list[tuple[str, list[str], int]] = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("The capital of Japan is", ["Beijing", "Seoul", "Tokyo", "Bangkok"], 2),
    ("The capital of Italy is", ["Milan", "Rome", "Naples", "Venice"], 1),
    ("The capital of Germany is", ["Munich", "Hamburg", "Vienna", "Berlin"], 3),
    ("The capital of Spain is", ["Madrid", "Lisbon", "Barcelona", "Seville"], 0),
    ("The largest ocean on Earth is the", ["Atlantic Ocean", "Indian Ocean", "Pacific Ocean", "Arctic Ocean"], 2),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius", "100 degrees Celsius",
                                           "200 degrees Celsius"], 0),
    ("The planet closest to the Sun is", ["Venus", "Mercury", "Mars", "Jupiter"], 1),
    ("The largest planet in the solar system is", ["Earth", "Saturn", "Neptune", "Jupiter"], 3),
    ("The chemical symbol for gold is", ["Au", "Ag", "Fe", "Pb"], 0),
    ("The chemical formula of water is", ["CO2", "NaCl", "H2O", "O2"], 2),
    ("A week has", ["five days", "seven days", "ten days", "twelve days"], 1),
    ("A year has", ["ten months", "eleven months", "thirteen months", "twelve months"], 3),
    ("Two plus two equals", ["four", "five", "three", "six"], 0),
    ("Ten minus three equals", ["six", "eight", "seven", "nine"], 2),
    ("The color of a clear daytime sky is", ["green", "blue", "red", "purple"], 1),
    ("Bees make", ["milk", "silk", "wool", "honey"], 3),
    ("The opposite of hot is", ["cold", "warm", "loud", "tall"], 0),
    ("The opposite of up is", ["left", "right", "down", "over"], 2),
    ("Cows drink", ["oil", "water", "sand", "ink"], 1),
    ("The Earth orbits the", ["Moon", "Mars", "comet", "Sun"], 3),
    ("The author of Romeo and Juliet is", ["William Shakespeare", "Charles Dickens", "Jane Austen",
                                           "Mark Twain"], 0),
    ("The first month of the year is", ["March", "June", "January", "October"], 2),
    ("The animal known as the king of the jungle is the", ["mouse", "lion", "rabbit", "sheep"], 1),
    ("People read books with their", ["ears", "hands", "feet", "eyes"], 3),
    ("Ice is frozen", ["water", "milk", "oil", "air"], 0),
    ("The tallest animal in the world is the", ["horse", "elephant", "giraffe", "camel"], 2),
    ("The currency of the United States is the", ["euro", "dollar", "pound", "yen"], 1),
    ("A triangle has", ["five sides", "two sides", "six sides", "three sides"], 3),
    ("Fish live in", ["water", "trees", "deserts", "clouds"], 0),
    ("The sun rises in the", ["west", "north", "east", "south"], 2),
    ("The language spoken in Brazil is", ["Spanish", "Portuguese", "French", "Italian"], 1),
]

TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(directory: Path) -> Path:
    data = directory / "items.jsonl"
    with data.open("w") as out:
        for question, choices, answer in ITEMS:
            out.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    (directory / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return data


def offline_env(cache: Path) -> None:
    """No hub: lm-eval, datasets and transformers read only local files (set before importing them)."""
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "HF_DATASETS_CACHE": str(cache / "datasets"), "HF_HOME": str(cache / "hf"),
                       "TOKENIZERS_PARALLELISM": "false"})


def evaluate(model: str, model_args: dict[str, Any], task_dir: Path, batch_size: int) -> dict[str, Any]:
    """One lm-eval run of the task: accuracy and, per item, each choice's loglikelihood."""
    # deferred: lm-eval is the optional extra `compat`, checked for in main()
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.monotonic()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=batch_size,
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                  bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    seconds = time.monotonic() - t0
    metrics = out["results"][TASK]
    items = []
    for sample in sorted(out["samples"][TASK], key=lambda s: s["doc_id"]):
        items.append({"doc_id": sample["doc_id"], "acc": float(sample["acc"]),
                      "loglikelihoods": [float(r[0]) for r in sample["filtered_resps"]]})
    return {"model": model, "acc": float(metrics["acc,none"]), "acc_norm": float(metrics["acc_norm,none"]),
            "items": items, "seconds": round(seconds, 1)}


def serve_and_evaluate(model_dir: Path, name: str, task_dir: Path, workdir: Path, batch_size: int,
                       startup_timeout_s: float) -> tuple[dict[str, Any], list[str]]:
    start = free_port_run(6)  # router, http, then telemetry, loader, planner, worker-0 from base
    ports = {"router": start, "http": start + 1, "base": start + 2}
    workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(str(model_dir), 1, ports, workdir,
                  ["--served-model-name", name, "--dtype", "float32", "--kv-cache-gb", "0.05"])
    try:
        startup = stack.start(startup_timeout_s)
        print(f"shardline up: healthy after {startup:.1f} s on {stack.base_url}", flush=True)
        result = evaluate("local-completions", {
            "model": name, "base_url": f"{stack.base_url}/completions", "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "add_bos_token": False,
            "num_concurrent": 1, "max_retries": 1, "timeout": 120}, task_dir, batch_size)
    except BaseException:
        print(stack.tail(), file=sys.stderr)
        raise
    finally:
        code = stack.stop()
        print(f"shardline up: stopped (exit {code})", flush=True)
    return result, stack.argv


def model_directory(spec: str) -> Path:
    return resolve_model(spec)


def compare(served: dict[str, Any], reference: dict[str, Any], tol: float) -> dict[str, Any]:
    deltas = []
    rows = []
    for a, b in zip(served["items"], reference["items"], strict=True):
        assert a["doc_id"] == b["doc_id"]
        item_deltas = [abs(x - y) for x, y in zip(a["loglikelihoods"], b["loglikelihoods"], strict=True)]
        deltas += item_deltas
        rows.append({"doc_id": a["doc_id"], "question": ITEMS[a["doc_id"]][0], "served": a["loglikelihoods"],
                     "hf": b["loglikelihoods"], "max_abs_delta": max(item_deltas),
                     "served_acc": a["acc"], "hf_acc": b["acc"]})
    max_delta = max(deltas)
    agree = served["acc"] == reference["acc"] and served["acc_norm"] == reference["acc_norm"] and max_delta <= tol \
        and all(r["served_acc"] == r["hf_acc"] for r in rows)
    return {"max_abs_delta_loglikelihood": max_delta, "mean_abs_delta_loglikelihood": sum(deltas) / len(deltas),
            "loglikelihoods_compared": len(deltas), "tolerance": tol, "agree": agree, "rows": rows}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("lm_eval", "torch", "transformers", "datasets", "shardline"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def markdown(payload: dict[str, Any]) -> str:
    s, r, c = payload["served"], payload["hf"], payload["comparison"]
    lines = [
        "# lm-eval against `shardline up`", "",
        f"Command: `{payload['command']}`  ",
        f"Model: `{payload['model']}` (float32, CPU); task `{TASK}`: {len(ITEMS)} four-way multiple-choice items "
        f"({c['loglikelihoods_compared']} loglikelihoods), defined in a local YAML with local jsonl data.  ",
        f"lm-eval {payload['versions']['lm_eval']}, torch {payload['versions']['torch']}, "
        f"transformers {payload['versions']['transformers']}, datasets {payload['versions']['datasets']}.", "",
        "| lm-eval model | acc | acc_norm | seconds |", "|---|---:|---:|---:|",
        f"| `local-completions` → shardline router (`/v1/completions`, token ids, echo + logprobs, "
        f"batch size {payload['batch_size']}) | {s['acc']:.4f} | {s['acc_norm']:.4f} | {s['seconds']} |",
        f"| `hf` (same directory, float32, CPU) | {r['acc']:.4f} | {r['acc_norm']:.4f} | {r['seconds']} |", "",
        f"max |Δ loglikelihood| = {c['max_abs_delta_loglikelihood']:.3g} "
        f"(mean {c['mean_abs_delta_loglikelihood']:.3g}; tolerance {c['tolerance']:g}) — "
        f"**{'agree' if c['agree'] else 'DISAGREE'}**", "",
        "| item | question | answer | shardline loglikelihoods | hf loglikelihoods | max |Δ| |",
        "|---:|---|---|---|---|---:|",
    ]
    for row in c["rows"]:
        answer = ITEMS[row["doc_id"]][1][ITEMS[row["doc_id"]][2]]
        lines.append(f"| {row['doc_id']} | {row['question']} | {answer} | "
                     f"{', '.join(f'{x:.4f}' for x in row['served'])} | {', '.join(f'{x:.4f}' for x in row['hf'])} "
                     f"| {row['max_abs_delta']:.2g} |")
    return "\n".join(lines) + "\n"


def print_table(payload: dict[str, Any]) -> None:
    s, r, c = payload["served"], payload["hf"], payload["comparison"]
    print(f"\n{'item':>4}  {'max|Δ ll|':>10}  {'shardline ll (choices)':<40}  question")
    for row in c["rows"]:
        print(f"{row['doc_id']:>4}  {row['max_abs_delta']:>10.2e}  "
              f"{' '.join(f'{x:9.4f}' for x in row['served']):<40}  {row['question']}")
    print(f"\n{'lm-eval model':<20} {'acc':>7} {'acc_norm':>9} {'seconds':>8}")
    print(f"{'local-completions':<20} {s['acc']:>7.4f} {s['acc_norm']:>9.4f} {s['seconds']:>8}")
    print(f"{'hf':<20} {r['acc']:>7.4f} {r['acc_norm']:>9.4f} {r['seconds']:>8}")
    print(f"max |Δ loglikelihood| {c['max_abs_delta_loglikelihood']:.3g} over {c['loglikelihoods_compared']} "
          f"(tolerance {c['tolerance']:g}): {'agree' if c['agree'] else 'DISAGREE'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compat.lm_eval_check", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny | smollm2 | a model directory (default tiny)")
    parser.add_argument("--batch-size", type=int, default=1, help="lm-eval batch size of both runs (default 1)")
    parser.add_argument("--tol", type=float, default=1e-3, help="largest |Δ loglikelihood| allowed (default 1e-3)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the stack to be healthy")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = parser.parse_args(argv)
    try:
        # deferred: the optional extra `compat`; without it the check says how to install it
        import lm_eval  # noqa: F401
    except ImportError:
        print("lm-eval is not installed: it is the optional extra `compat`:\n"
              "  .venv/bin/pip install -c constraints.txt -e '.[compat]'", file=sys.stderr)
        return 2

    command = "python -m bench.compat.lm_eval_check " + shlex.join(argv if argv is not None else sys.argv[1:])
    model_dir = model_directory(args.model)
    with tempfile.TemporaryDirectory(prefix="lm-eval-check-") as tmp:
        tmpdir = Path(tmp)
        task_dir = tmpdir / "tasks"
        task_dir.mkdir()
        write_task(task_dir)
        offline_env(tmpdir / "cache")
        served, up_argv = serve_and_evaluate(model_dir, model_dir.name, task_dir, tmpdir / "stack",
                                             args.batch_size, args.startup_timeout)
        reference = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu",
                                    "add_bos_token": False}, task_dir, args.batch_size)
    comparison = compare(served, reference, args.tol)
    payload = {"command": command.strip(), "model": str(model_dir), "batch_size": args.batch_size,
               "shardline_up": shlex.join(up_argv[2:]).replace(str(tmpdir), "$TMP"), "versions": versions(),
               "items": len(ITEMS), "served": {k: v for k, v in served.items() if k != "items"},
               "hf": {k: v for k, v in reference.items() if k != "items"}, "comparison": comparison}
    print_table(payload)
    out_dir = args.out or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{RESULT_NAME}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"{RESULT_NAME}.md").write_text(markdown(payload))
    print(f"wrote {out_dir / RESULT_NAME}.json and .md")
    return 0 if comparison["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
