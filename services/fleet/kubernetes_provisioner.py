"""The Kubernetes provisioner: a replica group is one LeaderWorkerSet, handed to a sink that applies it.

The provisioner renders (:func:`services.fleet.kubernetes.render_group`) and a sink makes it so:
:class:`YamlDirectory` writes ``<dir>/<group>.yaml`` and deletes it on stop (for ``kubectl apply
-f DIR`` or a GitOps tool to pick up), :class:`KubernetesApi` applies the objects to the API
server itself (server-side apply, the official client) and deletes them by name. Whether the
pods run is not the provisioner's to say: a group that loaded registers itself, and the
controller reads the registry and the health store, as for every group.

A controller restarted in the cluster finds its fleet's groups again through the sink (the
LeaderWorkerSets labelled with the fleet), so it adopts them instead of replacing them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import yaml

from services.fleet.kubernetes import (
    LABEL_FLEET,
    LWS_API_VERSION,
    LWS_KIND,
    KubernetesSettings,
    leader_endpoint,
    render_group,
)
from services.fleet.provisioner import GroupLaunch, GroupProcess


def to_yaml(objects: Sequence[dict]) -> str:
    """A multi-document YAML stream, keys in the order rendered (kind and metadata first)."""
    return yaml.safe_dump_all(list(objects), sort_keys=False, default_flow_style=False)


class Sink(Protocol):
    def apply(self, name: str, objects: list[dict]) -> None:
        """Create or update ``objects``, the whole of what ``name`` is."""

    def delete(self, name: str, objects: list[dict]) -> None:
        """Remove what :meth:`apply` made for ``name``; a name it never applied is no error."""

    def existing(self, fleet: str) -> list[str]:
        """The groups of ``fleet`` that are applied now, whoever applied them."""


class YamlDirectory:
    """``<dir>/<name>.yaml`` per applied name; stop removes the file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.yaml"

    def apply(self, name: str, objects: list[dict]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(name)
        tmp = path.with_suffix(".yaml.tmp")  # a reader of the directory never sees half a file
        tmp.write_text(to_yaml(objects))
        tmp.replace(path)

    def delete(self, name: str, objects: list[dict]) -> None:
        self.path(name).unlink(missing_ok=True)

    def existing(self, fleet: str) -> list[str]:
        names = []
        for path in sorted(self.directory.glob("*.yaml")):
            for obj in yaml.safe_load_all(path.read_text()):
                if obj and obj.get("kind") == LWS_KIND and obj["metadata"].get("labels", {}).get(LABEL_FLEET) == fleet:
                    names.append(obj["metadata"]["name"])
        return names


FIELD_MANAGER = "shardline-fleet"  # who owns the fields this controller applies (server-side apply)
REQUEST_TIMEOUT_S = 10.0


class KubernetesApi:
    """The API server through the official client: server-side apply of each object (this
    controller owns the fields it writes, and takes them back from anyone who changed them),
    delete by kind and name, and the fleet's LeaderWorkerSets by label.

    Credentials: the pod's service account in the cluster (its token and CA, mounted by the
    Deployment ``shardline fleet render`` writes), else the kubeconfig (``KUBECONFIG`` or
    ``~/.kube/config``). Nothing is contacted before the first call: an unreachable API server
    fails that call (the controller retries it next reconcile), never the controller's start.
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._client = None  # a DynamicClient, made on first use

    def _api(self):
        if self._client is None:
            # deferred: the client and its discovery only where a fleet runs on Kubernetes
            from kubernetes import client, config, dynamic

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            configuration = client.Configuration.get_default_copy()
            configuration.retries = 0  # the controller's next reconcile is the retry
            self._client = dynamic.DynamicClient(client.ApiClient(configuration))
        return self._client

    def _resource(self, obj: dict):
        return self._api().resources.get(api_version=obj.get("apiVersion", LWS_API_VERSION), kind=obj["kind"])

    def apply(self, name: str, objects: list[dict]) -> None:
        for obj in objects:
            self._api().server_side_apply(self._resource(obj), body=obj, namespace=self.namespace,
                                          field_manager=FIELD_MANAGER, force_conflicts=True,
                                          _request_timeout=REQUEST_TIMEOUT_S)

    def delete(self, name: str, objects: list[dict]) -> None:
        # deferred: as in _api
        from kubernetes.dynamic.exceptions import NotFoundError

        for obj in objects:
            try:  # background: the LeaderWorkerSet's controller tears the pods down; stop does not wait
                self._resource(obj).delete(name=obj["metadata"]["name"], namespace=self.namespace,
                                           propagation_policy="Background", _request_timeout=REQUEST_TIMEOUT_S)
            except NotFoundError:
                pass

    def existing(self, fleet: str) -> list[str]:
        found = self._resource({"apiVersion": LWS_API_VERSION, "kind": LWS_KIND}).get(
            namespace=self.namespace, label_selector=f"{LABEL_FLEET}={fleet}", _request_timeout=REQUEST_TIMEOUT_S)
        return sorted(item.metadata.name for item in found.items)


@dataclass(frozen=True)
class _Applied:
    launch: GroupLaunch
    objects: list[dict]


class KubernetesProvisioner:
    """The :class:`services.fleet.provisioner.Provisioner` that makes each group a LeaderWorkerSet."""

    def __init__(self, settings: KubernetesSettings, sink: Sink, *, fleet: str | None = None,
                 delete_on_close: bool = True) -> None:
        self.settings = settings
        self.sink = sink
        self.fleet = fleet  # given: groups() also lists the fleet's groups this process did not apply
        # True as the provisioner interface says (close stops everything). A controller running
        # in the cluster passes False: its groups must outlive a restart of its own pod.
        self.delete_on_close = delete_on_close
        self._applied: dict[str, _Applied] = {}
        self._lock = threading.Lock()

    def start(self, launch: GroupLaunch) -> None:
        objects = [render_group(launch, self.settings)]
        self.sink.apply(launch.name, objects)
        with self._lock:
            self._applied[launch.name] = _Applied(launch, objects)

    def stop(self, name: str) -> None:
        with self._lock:
            applied = self._applied.pop(name, None)
        # deleted even when this process never applied it (a restart forgot it): stop is idempotent
        objects = applied.objects if applied is not None else [
            {"apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "metadata": {"name": name,
                                                                           "namespace": self.settings.namespace}}]
        self.sink.delete(name, objects)

    def groups(self) -> list[GroupProcess]:
        """What is applied and not stopped (by this provisioner, or found for its fleet), with the
        address each driver advertises; ``alive`` only says it is applied (the registry says
        whether it serves)."""
        found = self.sink.existing(self.fleet) if self.fleet is not None else []
        with self._lock:
            names = sorted({*self._applied, *found})
        return [GroupProcess(name, True, "", leader_endpoint(name, self.settings)) for name in names]

    def close(self) -> None:
        if not self.delete_on_close:
            return
        with self._lock:
            names = list(self._applied)
        for name in names:
            self.stop(name)
