"""How the OpenAI front door serves a request once it is parsed (``http_api.py`` reads, checks
and parses it): one choice, streamed or whole (``serve``); ``n`` choices of one prompt streamed
together (``serve_choices``); several prompts or ``best_of`` candidates at once, answered whole
(``serve_several``); a prompt scored and echoed (``serve_echo``).

Every generation is admitted before the first byte goes out, so a refusal is a plain HTTP error.
A client that disconnects, while queued or while its answer is made, cancels its generations:
the worker calls stop and the reservations are released.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from services.common.sampling import FinishReason
from services.router import openai_format as oa
from services.router.admission import RequestCancelled
from services.router.service import Generation, RouterCore
from services.router.sse import choices_stream
from services.router.types import Finished, TokenOut, trace_context_of


class CancellingStreamingResponse(StreamingResponse):
    """A streaming response that cancels and closes its generations (one per choice) however it
    ends (done, error, disconnect): the worker calls stop and the reservations are released."""

    def __init__(self, content: AsyncIterator[str], generations: list[Generation], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self._generations:
                generation.cancel()
                generation.close()


async def serve_echo(core: RouterCore, request: Request, parsed: oa.ParsedRequest) -> Response:
    """``echo``: the prompt scored on a group (its logprobs and alternatives), then, unless
    ``max_tokens`` is 0, a generation from the same ids, as one non-streamed answer."""
    answer, groups = await _echo_answer(core, request, parsed, trace_context_of(request.headers.items()))
    headers = {"x-shardline-replica-group-id": answer["replica_group_id"],
               "x-shardline-replica-group-ids": ",".join(groups)}
    return JSONResponse(answer, headers=headers)


async def _echo_answer(core: RouterCore, request: Request | None, parsed: oa.ParsedRequest,
                       trace: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The echo answer's body and the groups that served it; ``request`` None: the caller
    watches for the client's disconnect (several prompts)."""
    top = parsed.request.sampling.logprobs
    scored = await core.score(dataclasses.replace(parsed.request, trace_context=trace), top)
    model = core.catalog.get(parsed.request.model)
    prompt_text = parsed.request.prompt_text if parsed.request.prompt_text is not None else \
        model.decode(scored.token_ids)
    tokens: list[TokenOut] = []
    groups = [scored.replica_group_id] if scored.replica_group_id else []
    finished = Finished(FinishReason.LENGTH, len(scored.token_ids), 0)
    if parsed.generate:
        generation = await core.generate(dataclasses.replace(
            parsed.request, prompt_text=None, prompt_ids=tuple(scored.token_ids), request_id=scored.request_id),
            token_texts=parsed.want_logprobs)
        try:
            if request is None:
                await generation.start()
            else:
                await _unless_disconnected(request, generation.start(), generation)
            async for event in generation:
                if isinstance(event, Finished):
                    finished = event
                else:
                    tokens.append(event)
        except BaseException:
            generation.cancel()
            raise
        finally:
            generation.close()
        groups += generation.replica_group_ids
    head = oa.ResponseHeader(f"cmpl-{scored.request_id}", model.name, groups[-1] if groups else "")
    return oa.echo_completion_response(head, scored, prompt_text, tokens, finished, parsed.want_logprobs), groups


async def _plain_answer(core: RouterCore, parsed: oa.ParsedRequest, trace: dict[str, str], *,
                        chat: bool = False) -> tuple[dict[str, Any], list[str], float]:
    """One non-streamed choice of several: its body, groups and the sum of its tokens' logprobs."""
    generation = await core.generate(dataclasses.replace(parsed.request, trace_context=trace),
                                     token_texts=parsed.want_logprobs)
    tokens: list[TokenOut] = []
    try:
        await generation.start()
        async for event in generation:
            if isinstance(event, Finished):
                finished = event
                break
            tokens.append(event)
        else:
            raise AssertionError("a stream always ends with Finished or an error")
    except BaseException:
        generation.cancel()
        raise
    finally:
        generation.close()
    groups = generation.replica_group_ids or [generation.replica_group_id]
    head = oa.ResponseHeader(f"{'chatcmpl' if chat else 'cmpl'}-{generation.request_id}",
                             generation.prepared.model.name, groups[-1])
    return oa.answer(head, tokens, finished, parsed, chat=chat), groups, sum(t.logprob for t in tokens)


async def _with_score(answer: Any) -> tuple[dict[str, Any], list[str], float]:
    body, groups = await answer
    return body, groups, 0.0


async def serve_several(core: RouterCore, request: Request, batch: list[oa.ParsedRequest], *, per_prompt: int = 1,
                        keep: int = 1, chat: bool = False) -> Response:
    """Several choices in one request (several prompts, ``per_prompt`` candidates each): each
    admitted and served as its own request, all at once; of each prompt's candidates the
    ``keep`` with the highest logprob sum are answered (``best_of``). One that fails fails the
    request (the others are cancelled), and so does the client leaving."""
    trace = trace_context_of(request.headers.items())
    tasks = [asyncio.ensure_future(_with_score(_echo_answer(core, None, p, trace)) if p.echo else
                                   _plain_answer(core, p, trace, chat=chat)) for p in batch]

    async def all_answers() -> list[tuple[dict[str, Any], list[str], float]]:
        return list(await asyncio.gather(*tasks))

    work = asyncio.ensure_future(all_answers())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        for task in tasks:
            task.cancel()  # no-op for those done
        await asyncio.gather(*tasks, return_exceptions=True)
    if not work.done() or work.cancelled():
        raise RequestCancelled("a request of several prompts: the client disconnected")
    answers = work.result()  # the first prompt's error, if one failed
    groups = [g for _answer, answer_groups, _score in answers for g in answer_groups]
    if keep < per_prompt:  # best_of: each prompt's best candidates, best first
        answers = [a for start in range(0, len(answers), per_prompt)
                   for a in sorted(answers[start:start + per_prompt], key=lambda a: -a[2])[:keep]]
    body = oa.several_completions_response([answer for answer, _groups, _score in answers], per_prompt=keep)
    return JSONResponse(body, headers={"x-shardline-replica-group-id": body["replica_group_id"],
                                       "x-shardline-replica-group-ids": ",".join(dict.fromkeys(groups))})


async def serve_choices(core: RouterCore, request: Request, parsed: oa.ParsedRequest, prefix: str, *,
                        chat: bool) -> Response:
    """``n`` choices of one prompt, streamed together (``sse.choices_stream``): every one admitted
    before the first byte, so a refusal is still a plain HTTP error."""
    trace = trace_context_of(request.headers.items())
    generations: list[Generation] = []
    try:
        for choice in oa.choice_requests(parsed):
            generation = await core.generate(dataclasses.replace(choice.request, trace_context=trace),
                                             token_texts=parsed.want_logprobs)
            generations.append(generation)
            await _unless_disconnected(request, generation.start(), generation)
    except BaseException:
        for generation in generations:
            generation.cancel()
            generation.close()
        raise
    name = generations[0].prepared.model.name
    heads = [oa.ResponseHeader(f"{prefix}-{generations[0].request_id}", name, g.replica_group_id)
             for g in generations]
    headers = {"x-shardline-replica-group-id": generations[0].replica_group_id, "cache-control": "no-cache"}
    return CancellingStreamingResponse(choices_stream(generations, heads, parsed, chat=chat), generations,
                                       media_type="text/event-stream", headers=headers)


async def serve(core: RouterCore, request: Request, parsed: oa.ParsedRequest, prefix: str, *, chat: bool) -> Response:
    generation_request = dataclasses.replace(parsed.request,
                                             trace_context=trace_context_of(request.headers.items()))
    generation = await core.generate(generation_request, token_texts=parsed.want_logprobs)
    # admission errors become plain HTTP errors; a client gone while queued is let go
    await _unless_disconnected(request, generation.start(), generation)
    head = oa.ResponseHeader(f"{prefix}-{generation.request_id}", generation.prepared.model.name,
                             generation.replica_group_id)
    # a header goes out before the first byte: on a stream it names the group the stream
    # started on, and each chunk names the group that produced it (the last ones the final group)
    headers = {"x-shardline-replica-group-id": generation.replica_group_id}
    if parsed.stream:
        return CancellingStreamingResponse(choices_stream([generation], [head], parsed, chat=chat), [generation],
                                           media_type="text/event-stream",
                                           headers={**headers, "cache-control": "no-cache"})
    tokens: list[TokenOut] = []

    async def collect() -> Finished:
        async for event in generation:
            if isinstance(event, Finished):
                return event
            tokens.append(event)
        raise AssertionError("a stream always ends with Finished or an error")

    try:
        finished = await _unless_disconnected(request, collect(), generation)
    finally:
        generation.close()
    # the whole answer is known: name the group of its last token, and every group that produced some
    head.replica_group_id = generation.replica_group_id
    headers = {"x-shardline-replica-group-id": generation.replica_group_id,
               "x-shardline-replica-group-ids": ",".join(generation.replica_group_ids or [head.replica_group_id])}
    return JSONResponse(oa.answer(head, tokens, finished, parsed, chat=chat), headers=headers)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Any, generation: Generation) -> Any:
    """Await ``work``; if the client disconnects first, cancel the generation (the worker call
    and the reservation go with it) and raise RequestCancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        generation.cancel()
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        generation.cancel()
        task.cancel()
        raise RequestCancelled(f"request {generation.request_id}: the client disconnected")
    exc = task.exception()
    if exc is not None:
        generation.cancel()
        raise exc
    return task.result()
