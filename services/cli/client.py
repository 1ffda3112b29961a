"""``shardline client generate --router HOST:PORT --prompt T``: stream a completion through a router.

Tokens are printed as they arrive (the router's text deltas never split a character); a summary
line (finish reason, token counts, replica group, time to first token) goes to stderr, or one
JSON object to stdout with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import grpc

from services.common.config import DEFAULT_PORTS, resolve
from services.common.errors import InvalidArgument
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from services.common.transport_security import TransportSecurity, add_security_arguments, open_channel


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("client", help="talk to a running router")
    actions = parser.add_subparsers(dest="client_action", metavar="ACTION", required=True)
    gen = actions.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("--router", default=f"127.0.0.1:{DEFAULT_PORTS['router']}",
                     help=f"router gRPC address (default 127.0.0.1:{DEFAULT_PORTS['router']})")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (tokenized by the router)")
    source.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    gen.add_argument("--model", default="", help="model name (default: the router's only model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--api-key", default=None, help="router API key (env SHARDLINE_API_KEY)")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole stream (default 300)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_security_arguments(gen)
    gen.set_defaults(func=run_generate)


@dataclass
class StreamResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    replica_group_id: str = ""
    request_id: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def build_request(args: argparse.Namespace) -> router_pb2.RouterGenerateRequest:
    sampling = common_pb2.SamplingParameters(temperature=args.temperature, max_tokens=args.max_tokens,
                                             top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    request = router_pb2.RouterGenerateRequest(model=args.model, sampling=sampling)
    if args.prompt_ids:
        request.token_ids.ids.extend(int(t) for t in args.prompt_ids.split(",") if t.strip())
    else:
        request.text = args.prompt
    return request


def stream_generate(address: str, request: router_pb2.RouterGenerateRequest, *, out: TextIO | None = None,
                    api_key: str | None = None, timeout_s: float = 300.0,
                    security: TransportSecurity | None = None) -> StreamResult:
    """Run one Generate on the router, writing each text delta to ``out`` as it arrives."""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    result = StreamResult()
    t0 = time.monotonic()
    with open_channel(address, security) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for response in stub.Generate(request, metadata=metadata, timeout=timeout_s):
            result.replica_group_id, result.request_id = response.replica_group_id, response.request_id
            if response.HasField("token"):
                if not result.token_ids:
                    result.ttft_s = time.monotonic() - t0
                result.token_ids.append(response.token.token_id)
                result.text += response.token.text
                if out is not None and response.token.text:
                    out.write(response.token.text)
                    out.flush()
            else:
                finished = response.finished
                result.finish_reason = common_pb2.FinishReason.Name(finished.finish_reason) \
                    .removeprefix("FINISH_REASON_").lower()
                result.prompt_tokens = finished.usage.prompt_tokens
                result.completion_tokens = finished.usage.completion_tokens
    result.total_s = time.monotonic() - t0
    return result


def summary(result: StreamResult) -> str:
    return (f"[{result.finish_reason}: {result.prompt_tokens} prompt + {result.completion_tokens} completion "
            f"tokens on {result.replica_group_id}, first token {result.ttft_s * 1e3:.0f} ms, "
            f"total {result.total_s:.2f} s]")


def run_generate(args: argparse.Namespace) -> int:
    api_key = resolve("api_key", args.api_key, "") or None
    try:
        security = TransportSecurity.from_args(args)
    except InvalidArgument as exc:
        print(f"shardline client: {exc}", file=sys.stderr)
        return 2
    try:
        result = stream_generate(args.router, build_request(args), out=None if args.json else sys.stdout,
                                 api_key=api_key, timeout_s=args.timeout, security=security)
    except grpc.RpcError as exc:
        if not args.json:
            print(file=sys.stdout)
        print(f"shardline client: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nshardline client: interrupted (the router cancels the request)", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print()
        print(summary(result), file=sys.stderr)
    return 0
