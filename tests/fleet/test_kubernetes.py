"""The Kubernetes rendering of a fleet: built-in kinds against the API schemas, the LeaderWorkerSet
(a CRD the schemas do not have) field by field, and the provisioner's sinks."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.cli import main as shardline
from services.common.config import DEFAULT_PORTS
from services.fleet.kubernetes import (
    LABEL_FLEET,
    LABEL_GROUP,
    LABEL_REVISION,
    KubernetesRenderError,
    KubernetesSettings,
    Resources,
    group_name,
    render_group,
)
from services.fleet.kubernetes_provisioner import KubernetesProvisioner, YamlDirectory, to_yaml
from services.fleet.kubernetes_services import render_services
from services.fleet.provisioner import GroupLaunch
from services.fleet.spec import FleetSpec, GroupPlan

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate (constraints.txt) ships
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)]
SETTINGS = KubernetesSettings(image="registry.example/shardline:1.0", namespace="serving", model_claim="models")


def _spec(tp: int = 2, pp: int = 2, **group: object) -> FleetSpec:
    data = {"replica_group": {"name": "llama-primary", "tp_degree": tp, "pp_degree": pp, "dtype": "bf16",
                              "kv_cache_cap_gb": 20, "checkpoint": {"model_dir": "/models/llama"},
                              "env": {"NCCL_DEBUG": "WARN"}, **group},
            "replicas": 3, "served_model_name": "llama"}
    return FleetSpec.from_dict(data)


def _launch(tp: int = 2, pp: int = 2, revision: int = 7) -> GroupLaunch:
    spec = _spec(tp, pp)
    return GroupLaunch(group_name(spec.name, revision, 0), spec.name, revision, spec.group, spec.served_model_name)


def _validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_every_built_in_kind_validates_against_the_schemas() -> None:
    objects = render_services(_spec(), SETTINGS)
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding", "Service",
                     "ServiceAccount"]
    for obj in objects:
        _validate(obj)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for component in ("router", "planner", "loader", "telemetry", "fleet"):
        assert {("Deployment", f"shardline-{component}"), ("Service", f"shardline-{component}")} <= names


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_the_group_pod_templates_validate_as_pod_templates(tp: int, pp: int) -> None:
    """The LWS's two templates are core/v1 PodTemplateSpecs: checked as a PodTemplate's."""
    template = render_group(_launch(tp, pp), SETTINGS)["spec"]["leaderWorkerTemplate"]
    for which in ("leaderTemplate", "workerTemplate"):
        _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": which.lower()},
                   "template": template[which]})


def test_the_validator_rejects_a_wrong_field() -> None:
    """The schema check has teeth: a misspelt field in a rendered object fails it."""
    deployment = next(o for o in render_services(_spec(), SETTINGS) if o["kind"] == "Deployment")
    deployment["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment)


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_one_leaderworkerset_per_group_with_a_pod_per_rank(tp: int, pp: int) -> None:
    launch = _launch(tp, pp)
    lws = render_group(launch, SETTINGS)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    labels = {"app.kubernetes.io/name": "shardline", "app.kubernetes.io/component": "worker",
              LABEL_FLEET: "llama-primary", LABEL_GROUP: launch.name, LABEL_REVISION: "7"}
    assert lws["metadata"] == {"name": launch.name, "namespace": "serving", "labels": labels}
    spec = lws["spec"]
    assert spec["replicas"] == 1 and spec["startupPolicy"] == "LeaderCreated"
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == tp * pp
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    for which, role in (("leaderTemplate", "driver"), ("workerTemplate", "follower")):
        labels = template[which]["metadata"]["labels"]
        assert (labels[LABEL_FLEET], labels[LABEL_GROUP], labels[LABEL_REVISION]) == (
            "llama-primary", launch.name, "7")
        assert labels["shardline.dev/rank-role"] == role


def test_the_leader_is_the_driver_and_serves_where_it_advertises() -> None:
    launch = _launch(2, 2)
    leader = render_group(launch, SETTINGS)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    (container,) = leader["containers"]
    assert container["image"] == "registry.example/shardline:1.0"
    assert container["command"] == ["shardline"]
    port = DEFAULT_PORTS["worker"]
    assert container["args"] == ["serve", "worker", "--port", str(port), "--metrics-port", "9400",
                                 *launch.worker_flags(), "--allow-cross-node-tp", "--advertise-address",
                                 f"$(LWS_LEADER_ADDRESS):{port}"]
    grpc = next(p for p in container["ports"] if p["name"] == "grpc")
    assert container["readinessProbe"]["grpc"]["port"] == grpc["containerPort"] == port
    assert "livenessProbe" not in container  # a liveness kill would recreate the group mid-load
    env = _env(container)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)" and env["MASTER_PORT"] == "29500"
    assert env["SHARDLINE_REGISTRY_URL"] == SETTINGS.registry_url
    assert env["SHARDLINE_REDIS_URL"] == SETTINGS.redis_url
    assert env["SHARDLINE_TELEMETRY_ADDR"] == "shardline-telemetry:50055"
    assert env["SHARDLINE_HOST"] == "0.0.0.0"
    assert env["NCCL_DEBUG"] == "WARN"  # the plan's env
    assert container["envFrom"] == [{"secretRef": {"name": "shardline"}}]
    assert container["resources"]["limits"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"/dev/shm", "/models"}


def test_a_follower_joins_the_leaders_rendezvous_at_its_worker_index() -> None:
    launch = _launch(2, 2)
    template = render_group(launch, SETTINGS)["spec"]["leaderWorkerTemplate"]
    (follower,) = template["workerTemplate"]["spec"]["containers"]
    env = _env(follower)
    assert env["RANK"] == "$(LWS_WORKER_INDEX)" and env["WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)" and env["MASTER_PORT"] == "29500"
    # torchrun's variables for a node of one rank: the worker runs as a torchrun-launched rank
    assert env["LOCAL_WORLD_SIZE"] == "1" and env["GROUP_RANK"] == "$(LWS_WORKER_INDEX)"
    # a TP group's pods may land on different machines: the placement check is told so
    assert follower["args"] == ["serve", "worker", "--port", str(DEFAULT_PORTS["worker"]), "--metrics-port", "9400",
                                *launch.worker_flags(), "--allow-cross-node-tp"]
    assert "readinessProbe" not in follower  # only the driver serves gRPC


def test_the_rendered_yaml_round_trips() -> None:
    objects = [*render_services(_spec(), SETTINGS), render_group(_launch(2, 2), SETTINGS)]
    assert list(yaml.safe_load_all(to_yaml(objects))) == objects


def test_group_names_are_dns_labels_distinct_per_revision_and_index() -> None:
    names = {group_name("llama-primary", rev, i) for rev in (1, 2) for i in range(3)}
    assert len(names) == 6
    assert all(n.startswith("llama-primary-") and len(n) == len("llama-primary-") + 6 for n in names)
    assert group_name("llama-primary", 1, 0) == group_name("llama-primary", 1, 0)


def test_a_manifest_fleet_needs_a_router_model_dir() -> None:
    spec = FleetSpec("llama-primary", GroupPlan(manifest_uri="s3://models/llama/manifest.json"))
    with pytest.raises(KubernetesRenderError, match="router_model_dir"):
        render_services(spec, SETTINGS)
    settings = KubernetesSettings(router_model_dir="/models/llama")
    router = next(o for o in render_services(spec, settings) if o["metadata"]["name"] == "shardline-router"
                  and o["kind"] == "Deployment")
    assert router["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--model", "/models/llama"]


def test_the_controller_may_create_and_delete_leaderworkersets_and_runs_with_a_standby() -> None:
    objects = render_services(_spec(), SETTINGS)
    role = next(o for o in objects if o["kind"] == "Role")
    lws_rule = next(r for r in role["rules"] if r["resources"] == ["leaderworkersets"])
    assert lws_rule["apiGroups"] == ["leaderworkerset.x-k8s.io"]
    assert {"create", "delete", "get", "patch"} <= set(lws_rule["verbs"])
    controller = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "shardline-fleet")
    assert controller["spec"]["replicas"] == 2 and "strategy" not in controller["spec"]  # the lease picks one
    pod = controller["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "shardline-fleet"
    assert pod["containers"][0]["args"][:2] == ["serve", "fleet"]
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    assert FleetSpec.from_dict(yaml.safe_load(config["data"]["fleet.yaml"])) == _spec()


def test_routers_and_controllers_run_several_replicas_behind_a_disruption_budget() -> None:
    objects = render_services(_spec(), SETTINGS)
    replicas = {o["metadata"]["name"]: o["spec"]["replicas"] for o in objects if o["kind"] == "Deployment"}
    assert (replicas["shardline-router"], replicas["shardline-fleet"]) == (2, 2)
    budgets = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"shardline-router", "shardline-fleet"}
    for name, budget in budgets.items():
        deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name)
        assert budget["maxUnavailable"] == 1
        assert budget["selector"] == deployment["spec"]["selector"]
    single = render_services(_spec(), replace(SETTINGS, router_replicas=1))
    assert [o["metadata"]["name"] for o in single if o["kind"] == "PodDisruptionBudget"] == ["shardline-fleet"]
    with pytest.raises(KubernetesRenderError, match="router_replicas"):
        replace(SETTINGS, router_replicas=0)


def test_the_services_run_the_compose_entry_points_on_the_default_ports() -> None:
    for obj in render_services(_spec(), SETTINGS):
        if obj["kind"] != "Deployment" or obj["metadata"]["name"] == "shardline-fleet":
            continue
        name = obj["metadata"]["name"].removeprefix("shardline-")
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        assert container["args"][:4] == ["serve", name, "--port", str(DEFAULT_PORTS[name])]
        assert container["readinessProbe"]["grpc"]["port"] == DEFAULT_PORTS[name]
        assert obj["spec"]["selector"]["matchLabels"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()


def test_the_yaml_directory_provisioner_writes_and_removes_a_file_per_group(tmp_path: Path) -> None:
    provisioner = KubernetesProvisioner(SETTINGS, YamlDirectory(tmp_path))
    first, second = _launch(2, 2, revision=1), _launch(1, 1, revision=2)
    provisioner.start(first)
    provisioner.start(second)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{first.name}.yaml", f"{second.name}.yaml"])
    (lws,) = yaml.safe_load_all((tmp_path / f"{first.name}.yaml").read_text())
    assert lws == render_group(first, SETTINGS)
    assert [(g.name, g.alive, g.endpoint) for g in provisioner.groups()] == sorted(
        (n, True, f"{n}-0.{n}.serving:50052") for n in (first.name, second.name))
    provisioner.stop(first.name)
    provisioner.stop(first.name)  # idempotent
    assert [p.name for p in tmp_path.iterdir()] == [f"{second.name}.yaml"]
    provisioner.close()
    assert list(tmp_path.iterdir()) == [] and provisioner.groups() == []


def test_a_restarted_controller_finds_its_fleets_groups_through_the_sink(tmp_path: Path) -> None:
    first = KubernetesProvisioner(SETTINGS, YamlDirectory(tmp_path), delete_on_close=False)
    mine, other = _launch(1, 1, revision=1), replace(_launch(1, 1, revision=1), name="other-abc123", fleet="other")
    first.start(mine)
    first.start(other)
    first.close()  # the controller's pod restarts: the groups stay
    restarted = KubernetesProvisioner(SETTINGS, YamlDirectory(tmp_path), fleet=mine.fleet)
    assert [(g.name, g.alive) for g in restarted.groups()] == [(mine.name, True)]
    restarted.stop(mine.name)  # one it did not apply itself
    assert restarted.groups() == [] and [p.name for p in tmp_path.iterdir()] == ["other-abc123.yaml"]


def test_resources_without_gpus_request_none() -> None:
    assert Resources(cpu="2", memory="4Gi").to_k8s() == {"requests": {"cpu": "2", "memory": "4Gi"},
                                                         "limits": {"cpu": "2", "memory": "4Gi"}}


def test_fleet_render_writes_the_services_and_one_leaderworkerset_per_replica(tmp_path: Path, capsys) -> None:
    spec_file = tmp_path / "fleet.yaml"
    spec_file.write_text(yaml.safe_dump(_spec().to_dict()))
    out = tmp_path / "out"
    assert shardline(["fleet", "render", "-f", str(spec_file), "--out", str(out), "--image", "img:2",
                      "--namespace", "ns1", "--revision", "3", "--gpus-per-rank", "0"]) == 0
    groups = [group_name("llama-primary", 3, i) for i in range(3)]  # in index order
    assert sorted(p.stem for p in out.iterdir()) == sorted(["shardline", *groups])
    assert capsys.readouterr().out.split() == [str(out / f"{stem}.yaml") for stem in ["shardline", *groups]]
    for name in groups:
        (lws,) = yaml.safe_load_all((out / f"{name}.yaml").read_text())
        assert lws["metadata"]["namespace"] == "ns1" and lws["metadata"]["labels"][LABEL_REVISION] == "3"
        container = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
        assert container["image"] == "img:2" and "nvidia.com/gpu" not in container["resources"]["limits"]
    for obj in yaml.safe_load_all((out / "shardline.yaml").read_text()):
        _validate(obj)


def test_the_monitors_and_the_keda_example_select_what_the_renderer_writes() -> None:
    observability = Path(__file__).resolve().parents[2] / "deploy" / "observability"
    monitors = {m["kind"]: m for m in yaml.safe_load_all((observability / "monitors.yaml").read_text())}
    objects = render_services(_spec(), SETTINGS)
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "shardline-router")
    selector = monitors["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitors["ServiceMonitor"]["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    leader = render_group(_launch(2, 2), SETTINGS)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    pod_monitor = monitors["PodMonitor"]["spec"]
    assert pod_monitor["selector"]["matchLabels"].items() <= leader["metadata"]["labels"].items()
    (container,) = leader["spec"]["containers"]
    (endpoint,) = pod_monitor["podMetricsEndpoints"]
    port = next(p for p in container["ports"] if p["name"] == endpoint["port"])
    assert container["args"][container["args"].index("--metrics-port") + 1] == str(port["containerPort"])
    # Prometheus's name of the pod label that names the group
    group_label = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9]", "_", LABEL_GROUP)
    assert endpoint["relabelings"][0]["sourceLabels"] == [group_label]
    (scaled,) = yaml.safe_load_all((observability / "keda-scaledobject.yaml").read_text())
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "shardline-router")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                "name": deployment["metadata"]["name"]}
    assert scaled["spec"]["minReplicaCount"] == deployment["spec"]["replicas"]
