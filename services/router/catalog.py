"""The models the router serves: tokenizer, context length, vocabulary, chat template.

The router tokenizes every prompt itself (admission needs the token count before any worker
sees the request) and detokenizes the streamed ids, so it reads the same ``tokenizer.json``,
``tokenizer_config.json`` and ``config.json`` as the workers. No torch, no transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from services.common.detokenizer import Detokenizer, TokenTexts
from services.common.errors import InvalidArgument, NotFound
from services.router.chat import ChatMessage, render_chat
from services.router.tools import DEFAULT_PARSER, PARSERS


class ModelDirError(ValueError):
    """A model directory the router cannot serve (missing or malformed files)."""


@dataclass(frozen=True)
class ServedModel:
    """One model: the name clients pass, its tokenizer and its limits."""

    name: str
    model_dir: Path
    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    tool_call_parser: str = DEFAULT_PARSER  # how calls are read from text under tool_choice auto (tools.PARSERS)

    def encode(self, text: str, *, add_special_tokens: bool = True, release_gil: bool = False) -> list[int]:
        """Token ids of ``text``; the post-processor adds BOS when the model wants it.

        ``release_gil``: through ``encode_batch``, which lets go of the GIL while it tokenizes
        (``encode`` holds it throughout), for a caller on a thread off the event loop."""
        if self.tokenizer is None:
            raise InvalidArgument(f"model {self.name!r} has no tokenizer.json: send token ids instead of text")
        self.check_prompt_chars(text)
        if release_gil:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def longest_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, where that bounds a text's token
        count from below (a byte-level BPE without a normalizer: every input byte lands in exactly
        one token, and no token spans more bytes than its vocabulary entry); else None."""
        if self.tokenizer is None:
            return None
        spec = json.loads(self.tokenizer.to_str())
        pre = spec.get("pre_tokenizer") or {}
        kinds = [p.get("type") for p in pre.get("pretokenizers", [])] if pre.get("type") == "Sequence" else \
            [pre.get("type")]
        if spec.get("normalizer") is not None or "ByteLevel" not in kinds:
            return None
        return max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True))

    def check_prompt_chars(self, text: str) -> None:
        """Reject, without tokenizing, a text that cannot fit the context even if every token
        were the tokenizer's longest (a many-megabyte prompt would otherwise be tokenized first)."""
        per_token = self.longest_token_chars
        if per_token is None or len(text) <= self.max_model_len * per_token:
            return
        raise InvalidArgument(
            f"prompt is {len(text)} characters: with at most {per_token} characters per token (this "
            f"tokenizer's longest), that is more than {len(text) // per_token} tokens, beyond this model's "
            f"maximum context length of {self.max_model_len} tokens (at most "
            f"{self.max_model_len * per_token} characters)")

    @cached_property
    def _token_texts(self) -> TokenTexts | None:
        # shared by every request of the model (the event loop is the only user)
        return TokenTexts(self.tokenizer) if self.tokenizer is not None else None

    def detokenizer(self, stop: tuple[str, ...] = ()) -> Detokenizer | None:
        """A fresh incremental detokenizer for one stream (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return Detokenizer(self.tokenizer, stop, texts=self._token_texts)

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (a partial UTF-8 sequence shows as U+FFFD)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text without the special tokens, as a completion's text is (an echoed
        prompt given as ids)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def render_chat(self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise InvalidArgument(f"model {self.name!r} has no chat template (chat_template.jinja or "
                                  f"tokenizer_config.json's chat_template; the router's --chat-template FILE "
                                  f"gives one): use /v1/completions")
        return render_chat(self.chat_template, messages, bos_token=self.bos_token or "",
                           eos_token=self.eos_token or "", add_generation_prompt=add_generation_prompt, tools=tools)


def _special(value: object) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template_of(root: Path, tok_config: dict, override: str | Path | None = None) -> str | None:
    """The model's chat template, where transformers looks for it: ``override`` (a file: the
    router's --chat-template), else ``chat_template.jinja`` (what current transformers saves),
    else tokenizer_config.json's ``chat_template``: a string, or a list of named templates of
    which ``default`` is the one used."""
    if override is not None:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ModelDirError(f"--chat-template {path}: no such file")
        return path.read_text()
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_served_model(model_dir: str | Path, *, name: str | None = None,
                      max_model_len: int | None = None, chat_template: str | Path | None = None,
                      tool_call_parser: str = DEFAULT_PARSER) -> ServedModel:
    """Read a Hugging Face model directory. ``name`` defaults to the directory's name (what a
    worker reports when started without --served-model-name); ``chat_template``: a template file
    to use instead of the model's own; ``tool_call_parser``: one of ``tools.PARSERS``."""
    if tool_call_parser not in PARSERS:
        raise InvalidArgument(f"tool call parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
    root = Path(model_dir).expanduser().resolve()
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"{config_path} not found: --model must be a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
        tok_config = json.loads((root / "tokenizer_config.json").read_text()) \
            if (root / "tokenizer_config.json").is_file() else {}
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"bad JSON in {root}: {exc}") from exc
    context = int(config.get("max_position_embeddings", 2048))
    if max_model_len is not None:
        if max_model_len < 1:
            raise ModelDirError(f"max_model_len must be >= 1, got {max_model_len}")
        context = min(context, max_model_len)
    eos = config.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
    tokenizer_path = root / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path.is_file() else None
    return ServedModel(
        name=name or root.name, model_dir=root, tokenizer=tokenizer, max_model_len=context,
        vocab_size=int(config.get("vocab_size", 0)), eos_token_ids=eos_ids,
        chat_template=chat_template_of(root, tok_config, chat_template),
        bos_token=_special(tok_config.get("bos_token")), eos_token=_special(tok_config.get("eos_token")),
        tool_call_parser=tool_call_parser)


class ModelCatalog:
    """Served models by name. An empty name means the only model (an error when there are several)."""

    def __init__(self, models: list[ServedModel] | None = None) -> None:
        self._models: dict[str, ServedModel] = {}
        for model in models or []:
            if model.name in self._models:
                raise ModelDirError(f"two models are served as {model.name!r}: give each --served-model-name")
            self._models[model.name] = model

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    def get(self, name: str) -> ServedModel:
        if not name:
            if len(self._models) == 1:
                return next(iter(self._models.values()))
            if not self._models:
                raise NotFound("the router serves no model: start it with --model DIR")
            raise InvalidArgument(f"model is required: this router serves {', '.join(self.names)}")
        model = self._models.get(name)
        if model is None:
            served = ", ".join(self.names) or "none"
            raise NotFound(f"The model `{name}` does not exist (served: {served})")
        return model

    def __contains__(self, name: str) -> bool:
        return name in self._models

    def __iter__(self):
        return iter(self._models[n] for n in self.names)
