"""bench.serving's pure half: `vllm bench serve` result files into the summary, the ratios
against the best peer, the greedy agreement and the note. No server, no network."""

from __future__ import annotations

import json

from bench import _serving_report as report


def bench_file(tpot: float, tok_s: float, *, completed: int = 16, failed: int | None = 0,
               num_prompts: int = 16) -> dict:
    """The keys of a `vllm bench serve --save-result` file that the summary reads, and some it does not."""
    raw = {"date": "20261201-000000", "backend": "vllm", "num_prompts": num_prompts, "completed": completed,
           "output_throughput": tok_s, "total_token_throughput": 3 * tok_s, "median_tpot_ms": tpot,
           "p99_tpot_ms": tpot * 1.5, "mean_tpot_ms": tpot, "median_ttft_ms": 4 * tpot, "p99_itl_ms": tpot * 2,
           "itls": [[0.01] * 63] * completed}
    if failed is not None:
        raw["failed"] = failed
    return raw


def write_runs(tmp_path, files: dict[tuple[str, int, int], dict]) -> None:
    for (server, c, round_), raw in files.items():
        (tmp_path / report.result_name(server, c, round_)).write_text(json.dumps(raw))
    (tmp_path / "unrelated.json").write_text("{}")  # not a bench file: ignored


def test_medians_across_rounds_and_ratios_against_the_best_peer(tmp_path):
    write_runs(tmp_path, {
        ("shardline", 1, 0): bench_file(9.0, 100.0), ("shardline", 1, 1): bench_file(11.0, 90.0),
        ("shardline", 16, 0): bench_file(20.0, 700.0), ("shardline", 16, 1): bench_file(22.0, 800.0, failed=1),
        ("vllm", 1, 0): bench_file(15.0, 60.0), ("vllm", 16, 0): bench_file(30.0, 500.0),
        ("llama.cpp", 1, 0): bench_file(12.0, 80.0), ("llama.cpp", 16, 0): bench_file(40.0, 600.0),
    })
    summary = report.summarize(report.load_runs(tmp_path))
    assert set(summary) == {"shardline", "vllm", "llama.cpp"}
    ours = summary["shardline"]
    assert ours["c1"]["median_tpot_ms"] == 10.0 and ours["c1"]["rounds"] == 2
    assert ours["c16"]["output_tok_s"] == 750.0 and ours["c16"]["failed"] == 1
    assert ours["c1"]["p99_tpot_ms"] == 15.0 and ours["c1"]["median_ttft_ms"] == 40.0
    assert ours["c1"]["p99_itl_ms"] == 20.0
    ratios = report.ratios(summary)
    assert ratios["tpot_c1_best_peer"] == "llama.cpp" and ratios["tpot_c1_vs_best_peer"] == round(10.0 / 12.0, 3)
    assert ratios["tok_s_c16_best_peer"] == "llama.cpp" and ratios["tok_s_c16_vs_best_peer"] == round(750 / 600, 3)
    # TTFT 4x and p99 TPOT 1.5x each TPOT: ours 84 and 31.5 ms (medians of the rounds), vLLM's the lowest
    assert ratios["ttft_c16_best_peer"] == "vllm" and ratios["ttft_c16_vs_best_peer"] == round(84 / 120, 3)
    assert ratios["p99_tpot_c16_best_peer"] == "vllm" and ratios["p99_tpot_c16_vs_best_peer"] == round(31.5 / 45, 3)


def test_tokens_counted_is_the_share_of_the_generated_tokens_the_client_saw(tmp_path):
    short = {**bench_file(12.0, 80.0, completed=8), "total_output_tokens": 8 * 61}
    write_runs(tmp_path, {("llama.cpp", 1, 0): short,
                          ("vllm", 1, 0): {**bench_file(15.0, 60.0, completed=8), "total_output_tokens": 8 * 64}})
    summary = report.summarize(report.load_runs(tmp_path), output_len=64)
    assert summary["llama.cpp"]["c1"]["tokens_counted"] == round(61 / 64, 4)
    assert summary["vllm"]["c1"]["tokens_counted"] == 1.0
    assert "tokens_counted" not in report.summarize(report.load_runs(tmp_path))["vllm"]["c1"]


def test_failed_requests_counted_from_prompts_when_the_file_has_no_count():
    figures = report.run_figures(bench_file(10.0, 50.0, completed=14, failed=None, num_prompts=16))
    assert figures["failed"] == 2 and figures["completed"] == 14


def test_ratios_are_none_without_a_peer_or_without_ours(tmp_path):
    write_runs(tmp_path, {("shardline", 1, 0): bench_file(9.0, 100.0), ("shardline", 16, 0): bench_file(20.0, 700.0)})
    alone = report.ratios(report.summarize(report.load_runs(tmp_path)))
    assert alone["tpot_c1_vs_best_peer"] is None and alone["tok_s_c16_vs_best_peer"] is None
    peer_only = report.ratios({"vllm": {"c1": {"median_tpot_ms": 5.0}, "c16": {"output_tok_s": 9.0}}})
    assert peer_only["tpot_c1_vs_best_peer"] is None


def test_agreement_is_the_matching_prefix_per_prompt():
    def encode(text: str) -> list[str]:
        return text.split()

    texts = {"shardline": ["a b c d", "x y"], "vllm": ["a b c d", "x z"], "llama.cpp": ["a q", "x y"]}
    out = report.agreement(texts, encode)
    assert out["vllm"]["prompts"][0] == {"prompt": 0, "prefix_tokens": 4, "tokens": 4, "prefix_chars": 7,
                                         "equal": True}
    assert out["vllm"]["prompts"][1]["prefix_tokens"] == 1 and not out["vllm"]["all_equal"]
    assert [r["prefix_tokens"] for r in out["llama.cpp"]["prompts"]] == [1, 2]
    assert report.agreement({"vllm": ["a"]}, encode) == {}  # no reference: nothing to compare


def test_markdown_has_the_table_the_ratios_and_the_commands(tmp_path):
    write_runs(tmp_path, {("shardline", 1, 0): bench_file(9.0, 100.0), ("shardline", 16, 0): bench_file(20.0, 700.0),
                          ("vllm", 1, 0): bench_file(15.0, 60.0), ("vllm", 16, 0): bench_file(30.0, 500.0)})
    summary = report.summarize(report.load_runs(tmp_path))
    result = {"name": "serving-test", "machine": {"line": "Some CPU, 2 cores, load average 0.10"},
              "config": {"dtype": "bfloat16", "input_len": 128, "output_len": 64, "rounds": 1,
                         "prompts": {"c1": 16, "c16": 64}},
              "servers": ["shardline", "vllm", "llama.cpp"], "summary": summary, "ratios": report.ratios(summary),
              "startup_s": {"shardline": [12.0], "vllm": [60.0]},
              "agreement": {"max_tokens": 24, "peers": report.agreement({"shardline": ["a b"], "vllm": ["a c"]},
                                                                        str.split), "errors": []},
              "commands": ["python -m bench.serving --rounds 1"]}
    md = report.markdown(result)
    assert "| shardline | 1 | 16 | 100.0 | 9.00 |" in md and "| vllm | 16 | 64 | 500.0 | 30.00 |" in md
    assert "llama.cpp |" not in md  # no figures for it: no row
    assert "`tpot_c1_vs_best_peer` = **0.600**" in md and "`tok_s_c16_vs_best_peer` = **1.400**" in md
    assert "Some CPU, 2 cores" in md and "python -m bench.serving --rounds 1" in md
    assert "- vllm: 1/2 tokens" in md
    assert "the client counted" not in md
    summary["vllm"]["c16"]["tokens_counted"] = 0.95
    assert "- vllm at c16: the client counted 95.0% of the 64 tokens" in report.markdown(result)
