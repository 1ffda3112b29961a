"""deploy/k8s/rendered/ is what `shardline fleet render` makes of deploy/k8s/fleet.yaml (rendered
again here and compared, so the committed manifests never drift from the renderer), and every
object in it is valid: the built-in kinds against the Kubernetes schemas, each LeaderWorkerSet's
fields against the leaderworkerset.x-k8s.io/v1 API, its pod templates as PodTemplates."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.cli import main as shardline
from tests.fleet.test_kubernetes import K8S_VERSION

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
RENDER = ["fleet", "render", "-f", str(K8S / "fleet.yaml"), "--image", "shardline:latest",
          "--model-claim", "shardline-models"]

# the fields of leaderworkerset.x-k8s.io/v1 LeaderWorkerSet this project writes may use, and the
# values its enums take (the API's types: LeaderWorkerSetSpec, LeaderWorkerTemplate)
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy", "volumeClaimTemplates"}
STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}
RESTART_POLICIES = {"RecreateGroupOnPodRestart", "None"}


def _objects(directory: Path) -> dict[str, list[dict]]:
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted(directory.glob("*.yaml"))}


def test_the_committed_manifests_are_what_the_renderer_writes(tmp_path: Path) -> None:
    assert shardline([*RENDER, "--out", str(tmp_path)]) == 0
    fresh = {p.name: p.read_text() for p in sorted(tmp_path.glob("*.yaml"))}
    committed = {p.name: p.read_text() for p in sorted((K8S / "rendered").glob("*.yaml"))}
    assert fresh == committed, "deploy/k8s/rendered/ is stale: run the command in deploy/k8s/fleet.yaml"


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return [o for objs in _objects(K8S / "rendered").values() for o in objs]


def test_every_built_in_object_validates(objects: list[dict]) -> None:
    built_in = [o for o in objects if o["kind"] != "LeaderWorkerSet"]
    kinds = {o["kind"] for o in built_in}
    assert {"Deployment", "Service", "ConfigMap", "Role", "RoleBinding", "ServiceAccount"} <= kinds
    for obj in built_in:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_each_leaderworkerset_has_the_v1_shape_and_valid_pod_templates(objects: list[dict]) -> None:
    groups = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    assert len(groups) == 2  # replicas: 2
    for lws in groups:
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert set(lws) == {"apiVersion", "kind", "metadata", "spec"}
        spec = lws["spec"]
        assert set(spec) <= LWS_SPEC and spec["startupPolicy"] in STARTUP_POLICIES
        assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
        template = spec["leaderWorkerTemplate"]
        assert set(template) <= LWS_TEMPLATE and template["restartPolicy"] in RESTART_POLICIES
        assert template["size"] == 4  # TP2 x PP2, a pod per rank
        for which in ("leaderTemplate", "workerTemplate"):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": f"{lws['metadata']['name']}-{which}"},
                                          "template": template[which]}, K8S_VERSION, strict=True)
