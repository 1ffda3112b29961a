"""A real stream whose tokens decode to U+2028 and U+0085: each SSE event stays one line for a
client that splits lines like ``str.splitlines`` (httpx's ``iter_lines``), and the ``openai``
client still reads the characters back.

The model is the tiny one with its weights rewritten so that greedy decoding cycles through the
byte tokens of "\\u2028\\x85": every layer's output projections are zero, so the residual stream
is the current token's embedding, a unit vector, and the LM head maps each byte token of the
cycle to the next one (and every other token, such as the chat template's last, to the first).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from services.modeling.tiny import TinyModelSpec, write_tiny_model
from tests.router.processes import running_up
from tests.router.test_up import up_command

pytestmark = pytest.mark.slow

TEXT = "\u2028\x85"


def separator_model(directory: Path) -> Path:
    model = directory / "tiny-separators"
    write_tiny_model(TinyModelSpec(), model)
    cycle = Tokenizer.from_file(str(model / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    assert len(cycle) == len(set(cycle)) == 5, cycle  # five distinct byte tokens
    weights = load_file(model / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed.zero_()
    head.zero_()
    embed[:, len(cycle)] = 1.0  # any other token (the chat template's last one) leads into the cycle
    head[cycle[0], len(cycle)] = 10.0
    for i, token in enumerate(cycle):
        embed[token, len(cycle)] = 0.0
        embed[token, i] = 1.0
        head[cycle[(i + 1) % len(cycle)], i] = 10.0
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("separators")
    argv, env, ports = up_command(tmp)
    argv += ["--model", str(separator_model(tmp))]
    with running_up(argv, env, tmp / "up.out"):
        yield f"http://127.0.0.1:{ports['http']}/v1"


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_each_event_is_one_line_however_the_client_splits(stack: str, route: str) -> None:
    body = {"model": "tiny-separators", "max_tokens": 20, "temperature": 0, "stream": True}
    body |= {"prompt": TEXT} if route == "completions" else {"messages": [{"role": "user", "content": TEXT}]}
    text = ""
    with httpx.stream("POST", f"{stack}/{route}", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: "), line
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    assert "\u2028" in text and "\x85" in text, repr(text)


def test_openai_client_reads_the_separators(stack: str) -> None:
    client = openai.OpenAI(base_url=stack, api_key="none", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny-separators", prompt=TEXT, max_tokens=20, temperature=0,
                                       stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text.count("\u2028") >= 3 and text.count("\x85") >= 3, repr(text)
