"""`shardline up`: the whole local stack as local processes, on the embedded defaults.

Starts telemetry, loader, planner, the worker(s) and the router, each as ``shardline serve
NAME`` (the same entry point docker-compose and the tests use), waits until every one answers
its gRPC health check, prints the endpoints, and serves until Ctrl-C or SIGTERM, which stops
everything (no orphan process).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from services.common.config import DEFAULT_PORTS
from services.common.supervisor import StackError, Supervisor

STACK_ORDER = ("telemetry", "loader", "planner", "worker", "router")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="run the whole local stack (all five services)")
    parser.add_argument("--port-base", type=int, default=None,
                        help="first port; services take consecutive ports (default: their standard ports)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds each service may take to become SERVING (default 300)")
    parser.add_argument("--demo-prompt", default=None, help="after startup, stream a completion of this prompt")
    parser.add_argument("--exit-after-demo", action="store_true", help="stop the stack after the demo")
    parser.set_defaults(func=run)


def ports_for(args: argparse.Namespace) -> dict[str, int]:
    if args.port_base is None:
        return {name: DEFAULT_PORTS[name] for name in STACK_ORDER}
    return {name: args.port_base + i for i, name in enumerate(STACK_ORDER)}


def _wait_all(supervisor: Supervisor, started: dict, timeout_s: float) -> None:
    for name, managed in started.items():
        took = supervisor.wait_healthy(managed, timeout_s)
        print(f"  {name:<10} {managed.address:<16} SERVING  (+{took:.1f} s)", flush=True)


def run(args: argparse.Namespace) -> int:
    supervisor = Supervisor()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ports = ports_for(args)
    try:
        # everything but the router starts at once; the router comes last, once its backends serve
        started = {}
        for name in STACK_ORDER:
            if name == "router":
                _wait_all(supervisor, started, args.startup_timeout)
                started = {}
            argv = [sys.executable, "-m", "services.cli", "serve", name, "--port", str(ports[name])]
            started[name] = supervisor.start(name, argv, ports[name])
        _wait_all(supervisor, started, args.startup_timeout)
        print(f"shardline is up: router gRPC 127.0.0.1:{ports['router']}", flush=True)
        if args.demo_prompt is not None:
            print("demo: the router does not serve completions yet (issue 7); the stack is healthy.",
                  flush=True)
        if args.exit_after_demo:
            return 0
        print("Ctrl-C stops the stack.", flush=True)
        while not stop.wait(0.5):
            dead = supervisor.dead()
            if dead:
                raise StackError(", ".join(f"{m.name} exited with code {m.proc.returncode}" for m in dead))
        return 0
    except StackError as exc:
        print(f"shardline up: {exc}", file=sys.stderr)
        return 1
    finally:
        supervisor.stop_all()
