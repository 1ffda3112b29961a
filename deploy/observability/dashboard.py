"""Writes ``shardline-dashboard.json``: the Grafana dashboard of a shardline fleet.

    python deploy/observability/dashboard.py > deploy/observability/shardline-dashboard.json

Every panel queries what a shardline router's ``/metrics`` serves (vLLM's series labelled
``replica_group``, the ``shardline_*`` series it re-exports from telemetry and the fleet
controller), so one scrape target per router fills it. The rows: the fleet (groups by status,
KV use, requests, rollouts), latency (TTFT and inter-token percentiles per group), collectives
(p99 by op and by rank, timeouts, alerts), quality (gate verdicts and figures, drift, shadow
traffic). ``tests/telemetry/test_up_metrics.py`` checks that the committed JSON is this
script's output and that every metric a panel names is in a live stack's scrape.
"""

from __future__ import annotations

import json
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
MODEL = 'model_name=~"$model"'


def _panel(title: str, exprs: list[tuple[str, str]], *, unit: str = "short", kind: str = "timeseries",
           width: int = 8, description: str = "") -> dict[str, Any]:
    return {"type": kind, "title": title, "description": description, "datasource": DATASOURCE,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else {},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(exprs)],
            "gridPos": {"w": width, "h": 8}}


def _quantiles(metric: str, by: str = "replica_group") -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{MODEL}}}[$__rate_interval])))",
             f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.99)]


ROWS: list[tuple[str, list[dict[str, Any]]]] = [
    ("Fleet", [
        _panel("Replica groups by status", [("sum by (status) (shardline_fleet_replicas)", "{{status}}"),
                                            ("sum(shardline_fleet_desired_replicas)", "desired")],
               description="What the fleet controller counts, and how many groups it wants in rotation"),
        _panel("KV cache usage per group", [(f"max by (replica_group) (vllm:kv_cache_usage_perc{{{MODEL}}})",
                                             "{{replica_group}}")], unit="percentunit"),
        _panel("Requests running and waiting", [
            (f"max by (replica_group) (vllm:num_requests_running{{{MODEL}}})", "running {{replica_group}}"),
            (f"max by (replica_group) (vllm:num_requests_waiting{{{MODEL}}})", "waiting {{replica_group}}"),
            ("sum(shardline_router_queue_depth)", "queued at the routers")]),
        _panel("Rollout and heal events", [
            ("sum by (event) (increase(shardline_fleet_events_total[$__rate_interval]))", "{{event}}")]),
        _panel("Controller leadership", [("max by (fleet) (shardline_fleet_lease_term)", "term {{fleet}}"),
                                         ("sum by (fleet) (shardline_fleet_leader)", "leaders {{fleet}}")]),
        _panel("Tokens per second", [
            (f"sum by (replica_group) (rate(vllm:generation_tokens_total{{{MODEL}}}[$__rate_interval]))",
             "generated {{replica_group}}"),
            (f"sum by (replica_group) (rate(vllm:prompt_tokens_total{{{MODEL}}}[$__rate_interval]))",
             "prompt {{replica_group}}")]),
    ]),
    ("Latency", [
        _panel("Time to first token", _quantiles("vllm:time_to_first_token_seconds"), unit="s"),
        _panel("Inter-token latency (TPOT)", _quantiles("vllm:inter_token_latency_seconds"), unit="s"),
        _panel("End-to-end request latency", _quantiles("vllm:e2e_request_latency_seconds"), unit="s"),
        _panel("Queue time", _quantiles("vllm:request_queue_time_seconds"), unit="s"),
        _panel("Requests by finish reason", [
            (f"sum by (finished_reason) (rate(vllm:request_success_total{{{MODEL}}}[$__rate_interval]))",
             "{{finished_reason}}")], unit="reqps"),
        _panel("Prefix cache hit rate", [
            (f"sum by (replica_group) (rate(vllm:prefix_cache_hits_total{{{MODEL}}}[$__rate_interval])) / "
             f"sum by (replica_group) (rate(vllm:prefix_cache_queries_total{{{MODEL}}}[$__rate_interval]))",
             "{{replica_group}}")], unit="percentunit"),
    ]),
    ("Collectives", [
        _panel("Collective p99 by op", [
            ("histogram_quantile(0.99, sum by (le, op_type) "
             "(rate(shardline_collective_duration_seconds_bucket[$__rate_interval])))", "{{op_type}}")], unit="s"),
        _panel("Collective p99 by rank", [
            ("histogram_quantile(0.99, sum by (le, gpu_id) "
             "(rate(shardline_collective_duration_seconds_bucket[$__rate_interval])))", "{{gpu_id}}")],
            unit="s", description="A slow or hung rank stands out from its group's"),
        _panel("Collective timeouts and alerts", [
            ("sum by (replica_group_id, op_type) (increase(shardline_collective_timeouts_total[$__rate_interval]))",
             "timeouts {{replica_group_id}} {{op_type}}"),
            ("sum(increase(shardline_telemetry_alerts_total[$__rate_interval]))", "alerts")]),
    ]),
    ("Quality", [
        _panel("Gate verdicts", [
            ('sum by (event) (increase(shardline_fleet_events_total{event=~"gate-passed|gate-failed"}'
             '[$__rate_interval]))', "{{event}}")]),
        _panel("Last gate: perplexity delta and top-1 agreement", [
            ("max by (fleet) (shardline_fleet_gate_perplexity_delta_pct)", "delta % {{fleet}}"),
            ("min by (fleet) (shardline_fleet_gate_top1_agreement)", "top-1 {{fleet}}")]),
        _panel("Drift and other quality alerts", [
            ('sum by (kind) (increase(shardline_telemetry_alerts_total{kind=~"quality_drift|shadow_divergence"}'
             '[$__rate_interval]))', "{{kind}}")]),
        _panel("Shadow traffic: perplexity delta", [
            ("max by (incumbent, candidate) (shardline_shadow_perplexity_delta_pct)",
             "{{incumbent}} vs {{candidate}}")], unit="percent"),
        _panel("Shadow traffic: mean |logprob delta|", [
            ("max by (incumbent, candidate) (shardline_shadow_mean_abs_logprob_delta)",
             "{{incumbent}} vs {{candidate}}")]),
    ]),
]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for row_title, row in ROWS:
        panels.append({"type": "row", "title": row_title, "collapsed": False, "id": next_id, "panels": [],
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}})
        next_id, y = next_id + 1, y + 1
        for i, panel in enumerate(row):
            panel = {**panel, "id": next_id, "gridPos": {**panel["gridPos"], "x": (i % 3) * 8, "y": y + (i // 3) * 8}}
            panels.append(panel)
            next_id += 1
        y += -(-len(row) // 3) * 8
    return {
        "title": "shardline fleet", "uid": "shardline-fleet", "tags": ["shardline", "vllm"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "model", "type": "query", "datasource": DATASOURCE, "label": "Model",
             "query": {"query": "label_values(vllm:num_requests_running, model_name)", "refId": "models"},
             "definition": "label_values(vllm:num_requests_running, model_name)", "includeAll": True,
             "multi": True, "allValue": ".*", "refresh": 2, "current": {"text": "All", "value": "$__all"}},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


if __name__ == "__main__":
    print(json.dumps(dashboard(), indent=2))
