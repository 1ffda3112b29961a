"""Build Hugging Face `tokenizer.json` files with the `tokenizers` library (no transformers).

Two builders:

- `byte_level_tokenizer` for the tiny random model: every byte is one token, so any UTF-8 text
  round-trips, plus `<unk>`, `<s>`, `</s>`, `<pad>` and reserved special tokens that fill the
  vocabulary up to the model's `vocab_size` (every id the model can emit then decodes).
- `gpt2_bpe_tokenizer` for GGUF files whose `tokenizer.ggml.model` is `gpt2`: the byte-level BPE
  vocabulary and merges llama.cpp stored, with control tokens kept whole.

`write_tokenizer_files` writes `tokenizer.json` and `tokenizer_config.json` side by side, the pair
`transformers.AutoTokenizer` and our own runtime both read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
BYTE_LEVEL_SPECIALS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
N_BYTES = 256
MIN_BYTE_LEVEL_VOCAB = len(BYTE_LEVEL_SPECIALS) + N_BYTES

# ChatML-like, spelled with the tiny tokenizer's own <s>/</s> so every marker is one token.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\n' + message['content'] + '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}"
)

# llama.cpp's `tokenizer.ggml.pre` names whose pre-tokenizer isolates every digit before the GPT-2
# split (llama-vocab.cpp groups smollm with starcoder/refact). SmolLM2's own tokenizer.json does
# the same (`Digits(individual_digits=True)` then `ByteLevel`), so numbers tokenize as trained.
INDIVIDUAL_DIGIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell"})

# GGUF token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


class TokenizerBuildError(ValueError):
    """The vocabulary description cannot make a consistent tokenizer."""


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table used by byte-level BPE.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to code points from 256 up,
    so no token contains whitespace or control characters.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(N_BYTES):
        if b not in table:
            table[b] = chr(N_BYTES + extra)
            extra += 1
    return dict(sorted(table.items()))


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens a model's config and tokenizer_config name (None where absent)."""

    bos: str | None
    eos: str | None
    unk: str | None = None
    pad: str | None = None
    add_bos: bool = False
    add_eos: bool = False

    def __post_init__(self) -> None:
        if self.add_bos and self.bos is None:
            raise TokenizerBuildError("add_bos=True needs a bos token, got bos=None")
        if self.add_eos and self.eos is None:
            raise TokenizerBuildError("add_eos=True needs an eos token, got eos=None")


def _post_processor(tokenizer: Tokenizer, special: SpecialTokens) -> processors.PostProcessor:
    """Prepend BOS / append EOS when the model wants them, else leave the ids as encoded."""
    if not (special.add_bos or special.add_eos):
        return processors.ByteLevel(trim_offsets=False)
    pieces: list[tuple[str, int]] = []
    first = ["$A:0"]
    second = ["$B:1"]
    if special.add_bos:
        assert special.bos is not None  # checked in SpecialTokens.__post_init__
        first.insert(0, f"{special.bos}:0")
        second.insert(0, f"{special.bos}:1")
        pieces.append((special.bos, _token_id(tokenizer, special.bos)))
    if special.add_eos:
        assert special.eos is not None
        first.append(f"{special.eos}:0")
        second.append(f"{special.eos}:1")
        pieces.append((special.eos, _token_id(tokenizer, special.eos)))
    return processors.TemplateProcessing(
        single=" ".join(first), pair=" ".join(first + second), special_tokens=pieces
    )


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise TokenizerBuildError(f"special token {token!r} is not in the vocabulary")
    return token_id


def byte_level_tokenizer(vocab_size: int) -> tuple[Tokenizer, SpecialTokens]:
    """A merge-free byte-level BPE: ids 0-3 are `<unk> <s> </s> <pad>`, 4-259 the 256 bytes.

    Ids from 260 to `vocab_size - 1` are special `<|reserved_N|>` tokens, so the tokenizer covers
    exactly the model's vocabulary. Encoding adds `<s>` in front, as Llama's tokenizer does.
    """
    if vocab_size < MIN_BYTE_LEVEL_VOCAB:
        raise TokenizerBuildError(
            f"a byte-level vocabulary needs at least {MIN_BYTE_LEVEL_VOCAB} tokens "
            f"({len(BYTE_LEVEL_SPECIALS)} special + {N_BYTES} bytes), got vocab_size={vocab_size}"
        )
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - MIN_BYTE_LEVEL_VOCAB)]
    tokens = [*BYTE_LEVEL_SPECIALS, *bytes_to_unicode().values(), *reserved]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (*BYTE_LEVEL_SPECIALS, *reserved)]
    )
    special = SpecialTokens(bos=BOS_TOKEN, eos=EOS_TOKEN, unk=UNK_TOKEN, pad=PAD_TOKEN, add_bos=True)
    tokenizer.post_processor = _post_processor(tokenizer, special)
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise TokenizerBuildError(
            f"built {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, expected {vocab_size}"
        )
    return tokenizer, special


def gpt2_bpe_tokenizer(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int] | None,
    *,
    special: SpecialTokens,
    pre_tokenizer_type: str | None = None,
) -> Tokenizer:
    """Byte-level BPE from llama.cpp's `tokenizer.ggml.*` metadata (`model == "gpt2"`).

    Tokens are already spelled in GPT-2's byte alphabet; merges are "left right" strings ranked
    best first. Control tokens become special added tokens and user-defined ones plain added
    tokens, so `<|im_start|>` in a prompt stays one token instead of being split into bytes.
    """
    if token_types is not None and len(token_types) != len(tokens):
        raise TokenizerBuildError(f"{len(token_types)} token types for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        # A duplicate spelling would silently shift ids; llama.cpp vocabularies never have one.
        if vocab.setdefault(token, index) != index:
            raise TokenizerBuildError(f"token {token!r} appears twice (ids {vocab[token]} and {index})")
    pairs: list[tuple[str, str]] = []
    for rank, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise TokenizerBuildError(f"merge #{rank} {merge!r} is not 'left right'")
        pairs.append((left, right))
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_tokenizer_type in INDIVIDUAL_DIGIT_PRE_TOKENIZERS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    if token_types is not None:
        alphabet = set(bytes_to_unicode().values())
        control = [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == TOKEN_TYPE_CONTROL
        ]
        # A user-defined token spelled outside the byte alphabet is raw text, matched as-is.
        user_defined = [
            AddedToken(token, special=False, normalized=not set(token) <= alphabet)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == TOKEN_TYPE_USER_DEFINED
        ]
        tokenizer.add_special_tokens(control)
        tokenizer.add_tokens(user_defined)
    for name in ("bos", "eos", "unk", "pad"):
        token = getattr(special, name)
        if token is not None:
            _token_id(tokenizer, token)
    tokenizer.post_processor = _post_processor(tokenizer, special)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise TokenizerBuildError(
            f"tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, "
            f"the file lists {len(tokens)}"
        )
    return tokenizer


def write_tokenizer_files(
    out_dir: Path,
    tokenizer: Tokenizer,
    special: SpecialTokens,
    *,
    chat_template: str | None,
    model_max_length: int,
) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json; return the paths written."""
    tokenizer_path = out_dir / "tokenizer.json"
    # Tokenizer.save sorts the vocabulary by id, so equal inputs give byte-identical files.
    tokenizer.save(str(tokenizer_path), pretty=True)
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special.bos,
        "eos_token": special.eos,
        "unk_token": special.unk,
        "pad_token": special.pad,
        "add_bos_token": special.add_bos,
        "add_eos_token": special.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    config_path = out_dir / "tokenizer_config.json"
    write_json(config_path, config)
    return [tokenizer_path, config_path]


def write_json(path: Path, payload: dict[str, object]) -> None:
    """Stable JSON (sorted keys, trailing newline) so identical inputs give identical bytes."""
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
