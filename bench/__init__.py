"""Benchmarks: each writes JSON + a markdown table under bench/results/."""
