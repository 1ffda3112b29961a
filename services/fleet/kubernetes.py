"""A replica group as Kubernetes objects: one LeaderWorkerSet per group, rendered, never applied here.

A LeaderWorkerSet (LWS) makes a *group* of pods the unit: ``size`` pods share one lifetime, the
first (the leader, worker index 0) is created before the others, and with
``RecreateGroupOnPodRestart`` a restart of any pod recreates them all. That is a replica group's
own rule: a group that lost a rank is never reused, it is torn down and replaced.

Layout: one pod per rank, ``size = tp * pp``. The leader pod is global rank 0, the driver: it runs
``shardline serve worker`` (the scheduler and the WorkerService), registers itself with the
registry under ``--advertise-address`` and is the only pod the router dials. Worker pod ``i`` is
global rank ``i = pp_stage * tp + tp_rank``, the index LWS gives it in ``LWS_WORKER_INDEX``. Every
pod joins one env:// rendezvous, torchrun's variables: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR = LWS_LEADER_ADDRESS`` (the leader pod's stable DNS name) and ``MASTER_PORT``,
where rank 0's TCP store listens.

``LOCAL_WORLD_SIZE = 1`` and ``GROUP_RANK = RANK`` complete torchrun's variables, so
``shardline serve worker`` runs each pod as torchrun would run one rank of a multi-node group
(services/worker/multinode.py): it checks the placement, the leader serves as a driver whose
followers join by themselves, and a worker pod runs the follower loop.

Everything here is pure: dicts in the shape ``kubectl apply`` takes, no cluster access.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from services.common.config import DEFAULT_PORTS
from services.fleet.provisioner import GroupLaunch

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LABEL_FLEET = "shardline.dev/fleet"
LABEL_GROUP = "shardline.dev/replica-group"
LABEL_REVISION = "shardline.dev/revision"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
APP = "shardline"
RENDEZVOUS_PORT = 29500  # torchrun's default MASTER_PORT: rank 0's TCP store
SHM_PATH = "/dev/shm"  # a container's default /dev/shm is 64 MiB; NCCL and the spawned ranks need more


class KubernetesRenderError(ValueError):
    """A fleet that cannot be rendered with these settings; the message names what is missing."""


@dataclass(frozen=True)
class Resources:
    """Requests (= limits) of one container: one rank of a group, or one shared service."""

    cpu: str = "4"
    memory: str = "16Gi"
    gpus: int = 0  # nvidia.com/gpu; an extended resource is whole devices, requested = limit

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise KubernetesRenderError(f"gpus must be >= 0, got {self.gpus}")

    def to_k8s(self) -> dict[str, dict[str, str]]:
        amounts = {"cpu": self.cpu, "memory": self.memory}
        if self.gpus:
            amounts["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": dict(amounts), "limits": dict(amounts)}


def _service_address(name: str) -> str:
    return f"{APP}-{name}:{DEFAULT_PORTS[name]}"


@dataclass(frozen=True)
class KubernetesSettings:
    """Where and how a fleet runs in one namespace. The shared services' addresses default to the
    Services :func:`services.fleet.kubernetes_services.render_services` makes (``shardline-<name>``)."""

    image: str = "shardline:latest"
    namespace: str = "shardline"
    registry_url: str | None = "postgresql+psycopg://shardline@postgres:5432/shardline"
    redis_url: str | None = "redis://redis:6379/0"
    telemetry_address: str = _service_address("telemetry")
    # A Secret every pod takes its environment from: SHARDLINE_INTERNAL_TOKEN and the database
    # password (PGPASSWORD, which psycopg reads), so neither sits in a rendered object.
    secret_name: str | None = "shardline"
    rank_resources: Resources = Resources(cpu="8", memory="32Gi", gpus=1)
    service_resources: Resources = Resources(cpu="1", memory="2Gi")
    shm_size: str = "8Gi"
    # A PersistentVolumeClaim holding model directories, mounted read-only at model_mount in the
    # workers and the router: a plan's model_dir must be a path as those pods see it.
    model_claim: str | None = None
    model_mount: str = "/models"
    router_model_dir: str | None = None  # the router's tokenizer and chat template (default: the plan's model_dir)
    worker_port: int = DEFAULT_PORTS["worker"]
    rendezvous_port: int = RENDEZVOUS_PORT
    fleet_port: int = DEFAULT_PORTS["fleet"]  # the fleet controller's gRPC health
    # every pod's Prometheus /metrics (the drivers' carry vLLM's series; a PodMonitor scrapes the
    # containers' "metrics" port: deploy/observability/)
    metrics_port: int = 9400
    router_http_port: int = 8000
    # routers behind the one Service: each admits into the groups' KV budgets, which the workers
    # enforce themselves, so any number share a fleet; a PodDisruptionBudget keeps one up
    router_replicas: int = 2
    log_level: str = "INFO"
    termination_grace_s: int = 60  # a draining driver finishes or hands off its streams first
    image_pull_policy: str = "IfNotPresent"
    extra_env: tuple[tuple[str, str], ...] = field(default=())  # e.g. SHARDLINE_S3_ENDPOINT_URL for every pod

    def __post_init__(self) -> None:
        if not self.image:
            raise KubernetesRenderError("image must be set")
        for port_name in ("worker_port", "rendezvous_port", "fleet_port", "router_http_port", "metrics_port"):
            port = getattr(self, port_name)
            if not 0 < port < 65536:
                raise KubernetesRenderError(f"{port_name} must be in 1..65535, got {port}")
        if self.router_replicas < 1:
            raise KubernetesRenderError(f"router_replicas must be >= 1, got {self.router_replicas}")


def group_name(fleet: str, revision: int, index: int) -> str:
    """``<fleet>-<6 hex>``: a DNS label, distinct per (revision, index), the same every time."""
    digest = hashlib.sha256(f"{fleet}/{revision}/{index}".encode()).hexdigest()[:6]
    return f"{fleet}-{digest}"


def group_labels(launch: GroupLaunch) -> dict[str, str]:
    return {LABEL_NAME: APP, LABEL_COMPONENT: "worker", LABEL_FLEET: launch.fleet, LABEL_GROUP: launch.name,
            LABEL_REVISION: str(launch.revision)}


def env_var(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value}


def shared_env(settings: KubernetesSettings) -> list[dict]:
    """What every shardline container is told: bind all interfaces (a pod's loopback hides it
    from the others), the registry, the health store, the log level, then ``extra_env``."""
    env = [env_var("SHARDLINE_HOST", "0.0.0.0"), env_var("SHARDLINE_LOG_LEVEL", settings.log_level)]
    if settings.registry_url:
        env.append(env_var("SHARDLINE_REGISTRY_URL", settings.registry_url))
    if settings.redis_url:
        env.append(env_var("SHARDLINE_REDIS_URL", settings.redis_url))
    env += [env_var(k, v) for k, v in settings.extra_env]
    return env


def env_from(settings: KubernetesSettings) -> list[dict]:
    return [{"secretRef": {"name": settings.secret_name}}] if settings.secret_name else []


def grpc_probe(port: int, *, period_s: int = 5, failure_threshold: int = 3) -> dict:
    """The standard gRPC health service on ``port`` (every shardline server has it, open without
    the internal token). A probe cannot speak TLS: with SHARDLINE_TLS_* on, probe by exec with
    ``python -m services.common.healthcheck`` instead."""
    return {"grpc": {"port": port}, "periodSeconds": period_s, "failureThreshold": failure_threshold}


def model_volume(settings: KubernetesSettings) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of the model claim; none without one."""
    if not settings.model_claim:
        return [], []
    return ([{"name": "models", "persistentVolumeClaim": {"claimName": settings.model_claim, "readOnly": True}}],
            [{"name": "models", "mountPath": settings.model_mount, "readOnly": True}])


def _rank_env(launch: GroupLaunch, settings: KubernetesSettings, rank: str) -> list[dict]:
    """torchrun's env:// rendezvous, one rank per pod. LWS puts LWS_LEADER_ADDRESS and
    LWS_WORKER_INDEX first in every container's env, so ``$(...)`` here can refer to them."""
    return [env_var("RANK", rank), env_var("WORLD_SIZE", str(launch.plan.world_size)),
            env_var("LOCAL_RANK", "0"),  # the pod's only rank: its first visible GPU
            env_var("LOCAL_WORLD_SIZE", "1"), env_var("GROUP_RANK", rank),  # a pod is a node of one rank
            env_var("MASTER_ADDR", "$(LWS_LEADER_ADDRESS)"), env_var("MASTER_PORT", str(settings.rendezvous_port)),
            env_var("SHARDLINE_TELEMETRY_ADDR", settings.telemetry_address)]


def _rank_pod(launch: GroupLaunch, settings: KubernetesSettings, *, leader: bool) -> dict:
    role = "driver" if leader else "follower"
    args = ["serve", "worker", "--port", str(settings.worker_port), "--metrics-port", str(settings.metrics_port),
            *launch.worker_flags()]
    if launch.plan.tp_degree > 1:
        # one rank per pod, and the scheduler may put a TP group's pods on different machines
        args.append("--allow-cross-node-tp")
    ports = [{"name": "rendezvous", "containerPort": settings.rendezvous_port, "protocol": "TCP"},
             {"name": "metrics", "containerPort": settings.metrics_port, "protocol": "TCP"}]
    container: dict = {
        "name": "worker",
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["shardline"],
        "args": args,  # the driver's get --advertise-address below (the same list)
        "ports": ports,
        "env": [*shared_env(settings), *_rank_env(launch, settings, "0" if leader else "$(LWS_WORKER_INDEX)"),
                *(env_var(k, v) for k, v in launch.plan.env)],  # the plan's env last: it wins
        "envFrom": env_from(settings),
        "resources": settings.rank_resources.to_k8s(),
    }
    if leader:
        # The address the registry records and the router dials: the leader pod's DNS name under
        # the group's headless Service, stable while the pod lives.
        args += ["--advertise-address", f"$(LWS_LEADER_ADDRESS):{settings.worker_port}"]
        ports.insert(0, {"name": "grpc", "containerPort": settings.worker_port, "protocol": "TCP"})
        # A driver reports NOT_SERVING until every rank has loaded its shards: readiness, not
        # liveness (a liveness kill would recreate the whole group mid-load).
        container["readinessProbe"] = grpc_probe(settings.worker_port)
    # A follower gets the driver's flags: it builds the same RankSpec (layout, dtype, weights, KV
    # cache), takes its rank from RANK and runs the follower loop.
    volumes, mounts = model_volume(settings)
    volumes = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}, *volumes]
    container["volumeMounts"] = [{"name": "shm", "mountPath": SHM_PATH}, *mounts]
    labels = {**group_labels(launch), "shardline.dev/rank-role": role}
    return {
        "metadata": {"labels": labels},
        "spec": {"containers": [container], "volumes": volumes,
                 "terminationGracePeriodSeconds": settings.termination_grace_s},
    }


def render_group(launch: GroupLaunch, settings: KubernetesSettings) -> dict:
    """The LeaderWorkerSet of one replica group: one group of ``tp * pp`` pods, leader = driver."""
    size = launch.plan.world_size
    template = {
        "size": size,
        "restartPolicy": "RecreateGroupOnPodRestart",
        "leaderTemplate": _rank_pod(launch, settings, leader=True),
        # LWS requires a worker template; with size 1 (TP x PP = 1) it makes no pod
        "workerTemplate": _rank_pod(launch, settings, leader=False),
    }
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {"name": launch.name, "namespace": settings.namespace, "labels": group_labels(launch)},
        "spec": {
            "replicas": 1,  # the controller counts groups; each LWS is exactly one of them
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": template,
        },
    }


def leader_endpoint(name: str, settings: KubernetesSettings) -> str:
    """Where a group's driver serves: LWS_LEADER_ADDRESS (``<lws>-<group index>.<lws>.<namespace>``,
    group index 0 with one replica) and the worker port: what the driver advertises."""
    return f"{name}-0.{name}.{settings.namespace}:{settings.worker_port}"
