"""The Server-Sent Event streams of /v1/completions and /v1/chat/completions: OpenAI's chunk
objects (``openai_format.py`` builds them) as ``data:`` lines, ending with ``data: [DONE]``.

Each choice streams from its own generation; several (``n``) stream at once, each choice's chunks
going out as its generation produces them, ``index`` naming the choice. The usage chunk (with
``include_usage``) counts the prompt once and every choice's tokens; with vLLM's
``continuous_usage_stats`` every chunk also carries its choice's usage so far. A stream that fails ends with
an error event and ``[DONE]``, never a silent cut; a choice that fails ends the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from services.common.errors import ShardlineError
from services.router import openai_format as oa
from services.router.service import Generation
from services.router.tools import ToolCallStream
from services.router.types import Finished

log = logging.getLogger(__name__)

# Characters that some clients take for line breaks (Python's str.splitlines, httpx's iter_lines)
# though SSE does not: escaped inside the JSON strings, so an event is always one line.
_LINE_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_event(payload: dict[str, Any]) -> str:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).translate(_LINE_SEPARATORS)
    return f"data: {data}\n\n"



def stream_error(generation: Generation, exc: Exception) -> str:
    if not isinstance(exc, ShardlineError):
        log.exception("request %s: the stream failed", generation.request_id, exc_info=exc)
    return sse_event(oa.error_body(exc)[1])



async def _choice_chunks(generation: Generation, head: oa.ResponseHeader, parsed: oa.ParsedRequest, index: int,
                         chat: bool, out: asyncio.Queue) -> Finished:
    """Put one choice's chunks (dicts) on ``out`` as its generation produces them; its Finished."""
    prompt_tokens, tokens = len(generation.prepared.prompt_ids), 0

    async def put(chunk: dict[str, Any]) -> None:
        if parsed.continuous_usage:  # vLLM's continuous_usage_stats: this choice's usage so far
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                              "total_tokens": prompt_tokens + tokens}
        await out.put(chunk)

    if chat:
        await put(oa.chat_chunk(head, {"role": "assistant", "content": ""}, index=index))
    calls = ToolCallStream(parsed.tools) if chat and parsed.tools is not None else None
    offset = 0
    async for event in generation:
        head.replica_group_id = generation.replica_group_id  # the group that produced this event
        if isinstance(event, Finished):
            reason = event.reason.openai
            tokens = event.completion_tokens
            if calls is not None:  # the calls (or held text) the whole output shows
                deltas, reason = calls.finish(reason)
                for delta in deltas:
                    await put(oa.chat_chunk(head, delta, index=index))
            stop = event.stop_sequence
            await put(oa.chat_chunk(head, {}, finish_reason=reason, index=index, stop_reason=stop) if chat else
                      oa.completion_chunk(head, "", finish_reason=reason, index=index, stop_reason=stop))
            return event
        tokens += 1
        if not event.text and not parsed.want_logprobs:
            continue  # inside a multi-byte character: its text comes with a later token
        if calls is not None:  # logprobs ride on the token's delta, or on an empty one while text is held
            deltas = calls.feed(event.text)
            logprobs = oa.chat_logprobs([event]) if parsed.want_logprobs else None
            for i, delta in enumerate(deltas or ([{}] if logprobs else [])):
                await put(oa.chat_chunk(head, delta, logprobs=logprobs if i == 0 else None, index=index))
        elif chat:
            logprobs = oa.chat_logprobs([event]) if parsed.want_logprobs else None
            await put(oa.chat_chunk(head, {"content": event.text}, logprobs=logprobs, index=index))
        else:
            logprobs = oa.completion_logprobs([event], offset) if parsed.want_logprobs else None
            offset += len(event.text)
            await put(oa.completion_chunk(head, event.text, logprobs=logprobs, index=index))
    raise AssertionError("a stream always ends with Finished or an error")


async def choices_stream(generations: list[Generation], heads: list[oa.ResponseHeader], parsed: oa.ParsedRequest,
                         *, chat: bool) -> AsyncIterator[str]:
    """The choices of one request (one, or ``n``), streamed together (see the module docstring)."""
    out: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_choice_chunks(g, h, parsed, i, chat, out))
             for i, (g, h) in enumerate(zip(generations, heads, strict=True))]
    pending = set(tasks)
    try:
        while pending:
            getter = asyncio.ensure_future(out.get())
            done, _ = await asyncio.wait({getter, *pending}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield sse_event(getter.result())
            else:
                getter.cancel()
            for task in done - {getter}:
                pending.discard(task)
                task.result()  # a failed choice fails the stream
        while not out.empty():
            yield sse_event(out.get_nowait())
        if parsed.include_usage:
            finished = [t.result() for t in tasks]
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield sse_event(oa.usage_chunk(heads[-1], obj, finished[0],
                                           completion_tokens=sum(f.completion_tokens for f in finished)))
    except Exception as exc:  # noqa: BLE001 - a stream ends with an error event and [DONE], never a silent cut
        yield stream_error(generations[0], exc)
    finally:
        for task in tasks:
            task.cancel()
        for generation in generations:
            generation.cancel()
            generation.close()
    yield "data: [DONE]\n\n"
