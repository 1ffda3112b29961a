"""The fleet's shared services as Kubernetes objects: a Deployment and a Service for each of the
router, planner, loader and telemetry, and for the fleet controller, which also gets the
ServiceAccount and Role that let it create and delete the groups' LeaderWorkerSets. The router
and the controller run several replicas (routers side by side, the workers' own KV admission
keeping them exact; controllers as a leader and standbys) with a PodDisruptionBudget each, so a
node drain never takes the last one.

Each container runs the entry point docker-compose.yml runs (``shardline serve <name> --port P``,
the same ports) with the same environment (bind all interfaces, registry, health store, the
internal token from a Secret). PostgreSQL and Redis are not rendered: the settings name them.
"""

from __future__ import annotations

import yaml

from services.common.config import DEFAULT_PORTS
from services.fleet.kubernetes import (
    APP,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_NAME,
    LWS_API_VERSION,
    KubernetesRenderError,
    KubernetesSettings,
    env_from,
    env_var,
    grpc_probe,
    model_volume,
    shared_env,
)
from services.fleet.spec import FleetSpec

FLEET_SPEC_DIR = "/etc/shardline/fleet"
FLEET_SPEC_FILE = "fleet.yaml"
CONTROLLER = "fleet"


def object_name(component: str) -> str:
    return f"{APP}-{component}"


def _labels(component: str, spec: FleetSpec) -> dict[str, str]:
    return {LABEL_NAME: APP, LABEL_COMPONENT: component, LABEL_FLEET: spec.name}


def _selector(component: str) -> dict[str, str]:
    return {LABEL_NAME: APP, LABEL_COMPONENT: component}


def _meta(component: str, spec: FleetSpec, settings: KubernetesSettings) -> dict:
    return {"name": object_name(component), "namespace": settings.namespace, "labels": _labels(component, spec)}


def _deployment(component: str, spec: FleetSpec, settings: KubernetesSettings, *, args: list[str],
                ports: dict[str, int], env: list[dict] | None = None, pod_extra: dict | None = None,
                volumes: tuple[list[dict], list[dict]] = ([], []), replicas: int = 1) -> dict:
    grpc_port = ports["grpc"]
    container = {
        "name": component,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["shardline"],
        "args": args,
        "env": [*shared_env(settings), *(env or [])],
        "envFrom": env_from(settings),
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports.items()],
        "readinessProbe": grpc_probe(grpc_port),
        "resources": settings.service_resources.to_k8s(),
    }
    if volumes[1]:
        container["volumeMounts"] = volumes[1]
    pod_spec: dict = {"containers": [container], **(pod_extra or {})}
    if volumes[0]:
        pod_spec["volumes"] = volumes[0]
    deployment_spec: dict = {
        "replicas": replicas,
        "selector": {"matchLabels": _selector(component)},
        "template": {"metadata": {"labels": _labels(component, spec)}, "spec": pod_spec},
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(component, spec, settings),
            "spec": deployment_spec}


def _service(component: str, spec: FleetSpec, settings: KubernetesSettings, ports: dict[str, int]) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(component, spec, settings),
            "spec": {"selector": _selector(component),
                     "ports": [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                               for name, port in ports.items()]}}


def _disruption_budget(component: str, spec: FleetSpec, settings: KubernetesSettings) -> dict:
    """At most one of the component's pods evicted at a time (a voluntary disruption such as a node
    drain waits for the replacement to be ready)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(component, spec, settings),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(component)}}}


def _serve_args(name: str, port: int, *extra: str) -> list[str]:
    return ["serve", name, "--port", str(port), *extra]


def _router_args(spec: FleetSpec, settings: KubernetesSettings) -> list[str]:
    model_dir = settings.router_model_dir or spec.group.model_dir
    if not model_dir:
        raise KubernetesRenderError(f"fleet {spec.name!r} loads from a manifest ({spec.group.manifest_uri}); the "
                                    f"router still needs a model directory for the tokenizer: set router_model_dir")
    extra = ["--http-port", str(settings.router_http_port), "--model", model_dir]
    if spec.served_model_name:
        extra += ["--served-model-name", spec.served_model_name]
    return _serve_args("router", DEFAULT_PORTS["router"], *extra)


def _controller_objects(spec: FleetSpec, settings: KubernetesSettings) -> list[dict]:
    """The controller's spec (a ConfigMap it reads), its identity and what that identity may do."""
    name = object_name(CONTROLLER)
    meta = _meta(CONTROLLER, spec, settings)
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{name}-spec"},
              "data": {FLEET_SPEC_FILE: yaml.safe_dump(spec.to_dict(), sort_keys=False)}}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [
        # server-side apply creates and patches; stop deletes; groups() lists; the API client reads
        # the groups' pods and services (what a LeaderWorkerSet makes) the same way
        {"apiGroups": [LWS_API_VERSION.split("/")[0]], "resources": ["leaderworkersets"],
         "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["pods", "services"], "verbs": ["get", "list", "watch", "patch", "delete"]},
    ]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": settings.namespace}]}
    ports = {"grpc": settings.fleet_port}
    volumes = ([{"name": "fleet-spec", "configMap": {"name": f"{name}-spec"}}],
               [{"name": "fleet-spec", "mountPath": FLEET_SPEC_DIR, "readOnly": True}])
    deployment = _deployment(
        CONTROLLER, spec, settings,
        args=_serve_args(CONTROLLER, settings.fleet_port, "--spec", f"{FLEET_SPEC_DIR}/{FLEET_SPEC_FILE}",
                         "--provisioner", "kubernetes", "--namespace", settings.namespace, "--image", settings.image),
        ports=ports, volumes=volumes,
        pod_extra={"serviceAccountName": name, "automountServiceAccountToken": True},
        replicas=2)  # one acts (it holds the fleet's lease in the registry), the other stands by to take over
    return [config, account, role, binding, deployment, _service(CONTROLLER, spec, settings, ports),
            _disruption_budget(CONTROLLER, spec, settings)]


def render_services(spec: FleetSpec, settings: KubernetesSettings) -> list[dict]:
    """Every object of the fleet but its replica groups, in the order ``kubectl apply`` should
    create them (the controller's account before the Deployment that uses it)."""
    telemetry_env = [env_var("SHARDLINE_TELEMETRY_ADDR", settings.telemetry_address)]
    objects: list[dict] = []
    for name in ("planner", "loader", "telemetry"):
        ports = {"grpc": DEFAULT_PORTS[name]}
        objects += [_deployment(name, spec, settings, args=_serve_args(name, ports["grpc"]), ports=ports),
                    _service(name, spec, settings, ports)]
    router_ports = {"grpc": DEFAULT_PORTS["router"], "http": settings.router_http_port}
    objects += [_deployment("router", spec, settings, args=_router_args(spec, settings), ports=router_ports,
                            env=telemetry_env, volumes=model_volume(settings), replicas=settings.router_replicas),
                _service("router", spec, settings, router_ports)]
    if settings.router_replicas > 1:
        objects.append(_disruption_budget("router", spec, settings))
    return objects + _controller_objects(spec, settings)
