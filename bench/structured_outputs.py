"""Structured outputs and tool calls with the real ``openai`` client against ``shardline up``
serving SmolLM2-135M-Instruct, at TP1, TP3 and PP2 (its 9 attention heads and 3 KV heads divide
by 3, not 2): ``client.chat.completions.parse`` with a
nested pydantic model (enums, arrays of objects, bounded strings and integers) on 20 varied
prompts, sampled (temperature 0.7, a seed each), and a tool-call round trip (``tool_choice``
required, ``n=3``, streamed and not, then the tool's result and the final answer).

Each layout gets its own ``up``; a prompt counts as parsed when the client returned the pydantic
object (it validates the JSON against the model itself). The figures: parsed / asked, the
completion tokens and the wall time of the 20 requests sent 5 at a time.

Then the failover leg (``--no-failover`` skips it; ``--layouts`` with no names runs it alone): two
TP1 groups behind one ``up``, a guided seeded stream whose group's worker is SIGKILLed mid-way.
The router continues it on the other group, replaying the streamed tokens into the grammar: the
output must still validate, and equal the same request's answer without the failure.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import openai
import pydantic

from bench._fleet_stack import driver_pid
from bench._peers import SERVED_NAME, shardline_server
from bench.common import machine, smollm2_dir, write_results
from services.common.ports import free_port

LAYOUTS = {"TP1": (), "TP3": ("--tp", "3"), "PP2": ("--pp", "2")}
TASKS = ["clean the kitchen", "prepare a job interview", "train for a 10 km run", "file my taxes",
         "learn basic Spanish", "repair a bike puncture", "plan a birthday party", "write a short story",
         "set up a home aquarium", "organise the garage", "cook dinner for six", "study for a maths exam",
         "move to a new flat", "start a vegetable garden", "paint the bedroom", "back up my photos",
         "plan a weekend in Rome", "bake sourdough bread", "renew my passport", "teach a dog to sit"]


class Priority(enum.Enum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class Step(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # as the client's parse() sends it: no other keys

    title: str = pydantic.Field(max_length=60)
    minutes: int = pydantic.Field(ge=1, le=600)


class Task(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str = pydantic.Field(max_length=60)
    priority: Priority
    tags: list[Literal["home", "work", "health", "money", "study", "fun"]] = pydantic.Field(max_length=3)
    steps: list[Step] = pydantic.Field(min_length=1, max_length=4)
    done: bool


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


def parse_one(client: openai.OpenAI, i: int) -> dict:
    t0 = time.monotonic()
    try:
        answer = client.chat.completions.parse(
            model=SERVED_NAME, response_format=Task, max_tokens=400, temperature=0.7, seed=i,
            messages=[{"role": "system", "content": "You plan tasks. Answer in JSON."},
                      {"role": "user", "content": f"Make a plan to {TASKS[i]}."}])
        task = answer.choices[0].message.parsed
        return {"prompt": TASKS[i], "ok": isinstance(task, Task), "tokens": answer.usage.completion_tokens,
                "seconds": time.monotonic() - t0, "output": answer.choices[0].message.content}
    except Exception as exc:  # noqa: BLE001 - a failure is the figure being measured
        return {"prompt": TASKS[i], "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "seconds": time.monotonic() - t0}


def tool_round_trip(client: openai.OpenAI) -> dict:
    """required + n=3, not streamed and streamed (each choice must equal its twin), then the answer."""
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    history = [{"role": "user", "content": "What is the weather in Paris today?"}]
    asked = dict(model=SERVED_NAME, tools=[tool], tool_choice="required", parallel_tool_calls=False, n=3, seed=11,
                 max_tokens=120, temperature=0.7)
    answer = client.chat.completions.parse(messages=history, **asked)
    calls = [c.message.tool_calls[0] for c in answer.choices]
    parsed = [isinstance(c.function.parsed_arguments, GetWeather) for c in calls]
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(messages=history, stream=True, **asked):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                streamed[choice.index] = streamed.get(choice.index, "") + (call.function.arguments or "")
    history += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": calls[0].id, "type": "function",
                     "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].id, "content": "21 degrees, sunny"}]
    final = client.chat.completions.create(model=SERVED_NAME, messages=history, tools=[tool], max_tokens=60, seed=11)
    return {"parsed": sum(parsed), "choices": 3, "arguments": [c.function.arguments for c in calls],
            "streamed_equal": [streamed.get(i) == calls[i].function.arguments for i in range(3)],
            "finish_reasons": [c.finish_reason for c in answer.choices],
            "final_answer": final.choices[0].message.content, "final_finish": final.choices[0].finish_reason}


def _task_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "Task", "schema": Task.model_json_schema(), "strict": True}}


def guided_failover(client: openai.OpenAI, kill_after: int = 8) -> dict:
    """A guided, seeded, sampled stream whose group's worker is SIGKILLed after ``kill_after``
    content chunks: the router continues it on the other group. The output must still validate,
    and equal the same request's answer in a run without the failure (seeded sampling is
    reproducible across groups)."""
    asked = dict(model=SERVED_NAME, response_format=_task_format(), max_tokens=400, temperature=0.7, seed=5,
                 messages=[{"role": "system", "content": "You plan tasks. Answer in JSON."},
                           {"role": "user", "content": f"Make a plan to {TASKS[3]}."}])
    reference = client.chat.completions.create(**asked).choices[0].message.content
    text, groups, killed, chunks = "", [], None, 0
    for chunk in client.chat.completions.create(stream=True, **asked):
        group = (chunk.model_extra or {}).get("replica_group_id")
        if group and (not groups or groups[-1] != group):
            groups.append(group)
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                chunks += 1
        if killed is None and chunks >= kill_after and groups:
            killed = groups[-1]
            os.kill(driver_pid(killed), signal.SIGKILL)
    try:
        valid = isinstance(Task.model_validate_json(text), Task)
    except pydantic.ValidationError:
        valid = False
    return {"killed_group": killed, "groups": groups, "continued_elsewhere": len(groups) > 1, "validates": valid,
            "equals_fault_free": text == reference, "output": text}


def run_layout(name: str, flags: tuple[str, ...], workdir: Path) -> dict:
    server = shardline_server(smollm2_dir(), "bfloat16", free_port(), workdir / name, flags=flags)
    started = server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        parse_one(client, 0)  # warm-up
        t0 = time.monotonic()
        with ThreadPoolExecutor(5) as pool:
            rows = list(pool.map(lambda i: parse_one(client, i), range(len(TASKS))))
        wall = time.monotonic() - t0
        tools = tool_round_trip(client)
    finally:
        server.stop()
    result = {"layout": name, "startup_s": started, "parsed": sum(r["ok"] for r in rows), "asked": len(rows),
              "completion_tokens": sum(r.get("tokens", 0) for r in rows), "wall_s": wall, "rows": rows, "tools": tools}
    print(f"{name}: parsed {result['parsed']}/{result['asked']} in {wall:.1f} s; tools {tools['parsed']}/3, "
          f"streamed equal {tools['streamed_equal']}", flush=True)
    return result


def run_failover(workdir: Path) -> dict:
    """Two TP1 groups behind one router; a guided stream loses its group mid-way."""
    server = shardline_server(smollm2_dir(), "bfloat16", free_port(), workdir / "failover", flags=("--replicas", "2"))
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        result = guided_failover(client)
    finally:
        server.stop()
    print(f"failover: killed {result['killed_group']}, served by {result['groups']}, validates {result['validates']}, "
          f"equals the fault-free answer {result['equals_fault_free']}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--no-failover", dest="failover", action="store_false",
                        help="skip the guided stream whose group is killed (two TP1 groups)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="structured-") as tmp:
        results = [run_layout(name, LAYOUTS[name], Path(tmp)) for name in args.layouts]
        failover = run_failover(Path(tmp)) if args.failover else None
    info = machine()
    ok = all(r["parsed"] == r["asked"] and r["tools"]["parsed"] == 3 for r in results)
    if results:
        write_layouts(info, results)
    if failover is not None:
        write_failover(info, failover)
        ok = ok and failover["validates"] and failover["continued_elsewhere"]
    return 0 if ok else 1


def write_layouts(info: dict, results: list[dict]) -> None:
    lines = ["# Structured outputs and tool calls through the `openai` client, SmolLM2-135M-Instruct", "",
             f"`python -m bench.structured_outputs`; {info['cpu_model']}; `shardline up` bfloat16 per layout; "
             f"`chat.completions.parse(response_format=Task)` (nested: enum, list of enums, list of objects with "
             f"bounded strings and integers) on {len(TASKS)} prompts, temperature 0.7, 5 at a time; tools: "
             "`tool_choice=\"required\"`, `n=3`, streamed and not, then the tool result and the answer.", "",
             "| layout | parsed | completion tokens | wall s (20 requests) | tool calls parsed | streamed = "
             "not streamed | tool finish reasons |", "|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["tools"]
        lines.append(f"| {r['layout']} | {r['parsed']}/{r['asked']} | {r['completion_tokens']} | {r['wall_s']:.1f} | "
                     f"{t['parsed']}/{t['choices']} | {sum(t['streamed_equal'])}/3 | "
                     f"{', '.join(t['finish_reasons'])} |")
    sample = results[0]["rows"][0]
    lines += ["", f"A parsed answer ({results[0]['layout']}, \"{sample['prompt']}\"): `{sample.get('output')}`",
              "", f"A tool call's arguments: `{results[0]['tools']['arguments'][0]}`; the answer after the tool "
              f"result: {json.dumps(results[0]['tools']['final_answer'])}"]
    write_results("structured-outputs", {"machine": info, "results": results}, "\n".join(lines) + "\n")
    print("\n".join(lines))


def write_failover(info: dict, failover: dict) -> None:
    f = failover
    lines = ["# A guided stream whose replica group is SIGKILLed mid-way, SmolLM2-135M-Instruct", "",
             f"`python -m bench.structured_outputs --layouts` (the failover leg alone); {info['cpu_model']}; "
             "`shardline up --replicas 2` (two TP1 groups, bfloat16). One `response_format` JSON-schema request "
             "(the `Task` model: enum, arrays, nested objects), seed 5, temperature 0.7, streamed through the "
             "`openai` client; the serving group's worker is SIGKILLed after 8 content chunks.", "",
             "| killed group | continued on | output validates as `Task` | equals the answer without the failure |",
             "|---|---|---|---|",
             f"| `{f['killed_group']}` | `{f['groups'][-1] if f['groups'] else '-'}` | {f['validates']} | "
             f"{f['equals_fault_free']} |", "", f"The output: `{f['output']}`"]
    write_results("structured-failover", {"machine": info, "failover": f}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
