"""The HTTP API's wire shapes as pydantic models: each request body's fields with their types and
ranges, each response object, OpenAI's error body.

One definition serves three readers: ``validate`` checks a request body against its model before
``openai_format.py`` reads it (a wrong type or an out-of-range value is a 400 naming the field),
``openapi.py`` builds ``/openapi.json``'s schemas from the models, and the fuzz test drives the
server with that document. Validation is strict (no ``"3"`` for 3, no ``true`` for 1; an integer
is a number), and null means "the default", as OpenAI reads it. Unknown fields are kept and
ignored, as OpenAI's servers do; the fields the router knows but does not honour (hints, the
unsupported ones) come from ``request_fields.py``'s table, which alone decides what they accept.

What one field cannot say about another (``best_of`` at least ``n``, ``echo`` not streamed, a
tool choice naming a tool that exists) stays with the parser.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, create_model

from services.common.sampling import (
    MAX_CACHE_SALT_CHARS,
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_UINT32,
)
from services.router.request_fields import BY_ENDPOINT, BadRequest, Endpoint

MAX_CHOICES = 16  # most choices one request may ask for (n, or best_of candidates)
MAX_PROMPTS = 128  # most prompts one /v1/completions request may carry, each its own choice


class Body(BaseModel):
    """A request body: strict types, unknown fields kept (and ignored)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class Shape(BaseModel):
    """A response object, or a nested part of either."""

    model_config = ConfigDict(strict=True, extra="allow")


B = TypeVar("B", bound=Body)
NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=MAX_UINT32)]
Ids = Annotated[list[int], Field(min_length=1, description="token ids")]


# ---- request parts ------------------------------------------------------------------------


class StreamOptions(Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: usage in every chunk; needs include_usage")


class JsonSchemaFormat(Body):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class FunctionCall(Body):
    name: str
    arguments: str = Field(description="JSON text")


class ToolCall(Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class InputMessage(Body):
    role: Literal["system", "developer", "user"]
    content: Content
    name: str | None = None


class ToolMessage(Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None


Message = Annotated[InputMessage | ToolMessage | AssistantMessage, Field(discriminator="role")]
Messages = Annotated[list[Message], Field(min_length=1)]
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
LogitBias = Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS_TOKENS, description=(
    "token id (as a string) -> bias added to its logit"))]


class FunctionDefinition(Body):
    name: ToolName
    description: str | None = None
    strict: bool | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: ToolName


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


# ---- request bodies -----------------------------------------------------------------------


class SamplingFields(Body):
    """The fields both generation endpoints take (vLLM's sampling extensions included), with the
    ranges ``services.common.sampling`` enforces on every request however it arrives."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_UINT32, description="0 or -1: off")] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT32)] | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=(
        "share cached prompt prefixes only with requests of this salt"))] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, description="vLLM's; 0: off")] | None = None
    logit_bias: LogitBias | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT32, description="vLLM's; at most max_tokens")] | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100, description="vLLM's; 1: off")] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM's: the whole output matches it")
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES, description=(
        "choices; with seed s, choice i samples with seed s + i (mod 2**64)"))] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class CompletionFields(SamplingFields):
    prompt: (NonEmpty | Ids | Annotated[list[NonEmpty | Ids], Field(
        min_length=1, max_length=MAX_PROMPTS,
        description="several prompts: one choice each, index its position; not with stream")])
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=0, le=MAX_INT32, description="0 only with echo: score the prompt")] | None \
        = None
    echo: bool | None = Field(None, description="the prompt and its logprobs first; not with stream")
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES, description=(
        "candidates (at least n): the n of highest logprob sum are answered; not with stream"))] | None = None


class ChatFields(SamplingFields):
    messages: Messages
    tools: list[Tool] | None = Field(None, description="function tools, unique names; they reach the chat template")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "required and a named function need tools; they guide the output with the parameters' JSON schema"))
    parallel_tool_calls: bool | None = Field(None, description="false: required makes one call")
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT32)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


def _with_table(name: str, base: type[Body], endpoint: Endpoint) -> type[Body]:
    """``base`` plus the table's hints and unsupported fields, described as the table has them
    (``request_fields.check_fields`` is what accepts or refuses their values)."""
    fields: dict[str, Any] = {}
    for field in BY_ENDPOINT[endpoint].values():
        if field.status == "hint":
            schema = {"description": f"accepted, no effect: {field.note}"}
        elif field.status == "unsupported":
            what = "not supported" + (f": {field.note}" if field.note else "")
            schema = ({"anyOf": [{"enum": list(field.off)}, {"type": "null"}], "description": what} if field.off
                      else {"type": "null", "description": what})
        else:
            continue
        fields[field.name] = (Annotated[Any, WithJsonSchema(schema)], None)
    return create_model(name, __base__=base, **fields)


CompletionRequest = _with_table("CompletionRequest", CompletionFields, "completions")
ChatCompletionRequest = _with_table("ChatCompletionRequest", ChatFields, "chat")


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = Field(None, description="either prompt or messages")
    messages: Messages | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: bool | None = Field(None, description="messages: default true")
    return_token_strs: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


def validate(kind: type[B], body: Any) -> B:
    """``body`` as ``kind``, or a 400 naming the first field that does not fit (``param``) and
    saying where in it (``messages[0].content: ...``)."""
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if not first["loc"]:
            raise BadRequest(f"the body must be a JSON object, got {_show(body)}") from None
        param = str(first["loc"][0])
        mine = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
        if len(mine) == 1:  # one rule broken: say which, where
            raise BadRequest(f"{_path(first['loc'])}: {_lower(first['msg'])}, got {_show(first['input'])}",
                             param) from None
        # a value of several forms (a string or a list of ids; a message of one role or another):
        # none fits, and each says why (and at which item, for a list)
        common = len(first["loc"])
        for e in mine:
            common = next((i for i, (x, y) in enumerate(zip(first["loc"], e["loc"], strict=False)) if x != y),
                          min(common, len(e["loc"])))
        whys: dict[str, str] = {}  # each reason once, at the first item it was found at
        for e in mine:
            items = "".join(f"[{part}]" for part in e["loc"][common:] if isinstance(part, int))
            whys.setdefault(e["msg"], f"{items}: {_lower(e['msg'])}" if items else _lower(e["msg"]))
        given = next((e["input"] for e in mine if len(e["loc"]) == common + 1), body.get(param))
        why = "; ".join(list(whys.values())[:4]) + ("; ..." if len(whys) > 4 else "")
        raise BadRequest(f"{_path(first['loc'][:common])}: none of its forms fits ({why}), got {_show(given)}",
                         param) from None


def _path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "user", "content", "str")`` as ``messages[0].content``: list items and
    field names, without the tags pydantic adds for the member of a union it tried (a type's name,
    or a message's role after its index)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part, loc[i - 1] if i else None):
            out += f".{part}" if out else part
    return out


# Message's discriminator values, as its members declare them
ROLES = frozenset(role for member in get_args(get_args(Message)[0])
                  for role in get_args(member.model_fields["role"].annotation))
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_tag(part: str, before: int | str | None) -> bool:
    return (not part.isidentifier() or part in _TYPE_TAGS or part[:1].isupper()
            or (isinstance(before, int) and part in ROLES))


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- responses ----------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null: an echoed first token")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TokenLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(Shape):
    content: list[ChatTokenLogprob]


class Answer(Shape):
    """What every generation response object carries."""

    id: str
    created: int
    model: str
    replica_group_id: str


class CompletionChoice(Shape):
    index: int
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | None = Field(None, description="the stop string that ended the text (vLLM's field); null "
                                                     "when it ended for another reason")
    logprobs: CompletionLogprobs | None


class Completion(Answer):
    object: Literal["text_completion"]
    choices: Annotated[list[CompletionChoice], Field(min_length=1)]
    usage: Usage


class CompletionChunk(Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AnswerMessage(Shape):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Shape):
    index: int
    message: AnswerMessage
    finish_reason: FinishReason | None
    stop_reason: str | None = Field(None, description="the stop string that ended the text (vLLM's field); null "
                                                     "when it ended for another reason")
    logprobs: ChatLogprobs | None


class ChatCompletion(Answer):
    object: Literal["chat.completion"]
    choices: Annotated[list[ChatChoice], Field(min_length=1)]
    usage: Usage


class ToolCallDelta(Shape):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = Field(None, description="name and arguments, each sent once or in parts")


class Delta(Shape):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Shape):
    index: int
    delta: Delta
    finish_reason: FinishReason | None
    stop_reason: str | None = Field(None, description="the stop string that ended the text (vLLM's field); null "
                                                     "when it ended for another reason")
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(Answer):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorDetail(Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(Shape):
    error: ErrorDetail


class Health(Shape):
    status: Literal["ok", "unavailable"]
    replica_groups: int
    healthy_replica_groups: int


class ModelCard(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(Shape):
    prompt: str


class Version(Shape):
    version: str


# every object /openapi.json names, under its class name
DOCUMENTED: tuple[type[BaseModel], ...] = (
    Error, Health, ModelList, CompletionRequest, ChatCompletionRequest, TokenizeRequest, TokenizeResponse,
    DetokenizeRequest, DetokenizeResponse, Version, Completion, ChatCompletion, CompletionChunk, ChatCompletionChunk)

