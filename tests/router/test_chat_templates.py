"""Where the router finds a model's chat template (as transformers does), and /tokenize and
/detokenize answering with the ids a request with the same body would send."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.router import openai_format as oa
from services.router import tokenize_api
from services.router.catalog import ModelDirError, load_served_model
from services.router.chat import parse_messages

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
PLAIN = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture
def bare(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model without a template in tokenizer_config.json."""
    root = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_chat_template_jinja_is_read_as_transformers_reads_it(bare: Path) -> None:
    from transformers import AutoTokenizer

    assert load_served_model(bare).chat_template is None
    (bare / "chat_template.jinja").write_text(PLAIN)
    model = load_served_model(bare)
    text = model.render_chat(parse_messages(MESSAGES))
    assert text == "[system] Be brief.\n[user] What is 2+2?\n[assistant] "
    assert text == AutoTokenizer.from_pretrained(str(bare)).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False)


def test_named_templates_use_default_and_a_file_overrides_the_model(bare: Path, tmp_path: Path) -> None:
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": PLAIN}]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_served_model(bare).chat_template == PLAIN
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}")
    assert load_served_model(bare, chat_template=override).render_chat(parse_messages(MESSAGES)) == \
        "Be brief.|What is 2+2?|"
    with pytest.raises(ModelDirError, match="no such file"):
        load_served_model(bare, chat_template=tmp_path / "missing.jinja")


def test_tokenize_gives_the_ids_a_request_sends(tiny_model_dir: Path) -> None:
    model = load_served_model(tiny_model_dir)
    answer = tokenize_api.tokenize({"prompt": "hello there"}, model)
    assert answer["tokens"] == model.encode("hello there")  # what the worker makes of a completion's text
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == model.max_model_len
    assert answer["token_strs"] is None
    chat = tokenize_api.tokenize({"messages": MESSAGES, "return_token_strs": True}, model)
    assert chat["tokens"] == list(oa.parse_chat({"messages": MESSAGES}, model, token_limit=512).request.prompt_ids)
    assert chat["token_strs"] == [model.token_text(t) for t in chat["tokens"]]
    assert tokenize_api.detokenize({"tokens": answer["tokens"]}, model)["prompt"] == "hello there"
    for bad in ({}, {"prompt": "a", "messages": MESSAGES}, {"prompt": 3}, {"prompt": "a", "add_special_tokens": 1}):
        with pytest.raises(oa.BadRequest):
            tokenize_api.tokenize(bad, model)
    for bad in ({}, {"tokens": "abc"}, {"tokens": [True]}, {"tokens": [-1]}, {"tokens": [model.vocab_size]}):
        with pytest.raises(oa.BadRequest, match="tokens"):
            tokenize_api.detokenize(bad, model)
