"""The Kubernetes provisioner: a replica group is one LeaderWorkerSet, handed to a sink that applies it.

The provisioner renders (:func:`services.fleet.kubernetes.render_group`) and a sink makes it so:
:class:`YamlDirectory` writes ``<dir>/<group>.yaml`` and deletes it on stop (for ``kubectl apply
-f DIR`` or a GitOps tool to pick up), :class:`Kubectl` pipes the objects to ``kubectl apply -f -``
and deletes by name. Whether the pods run is not the provisioner's to say: a group that loaded
registers itself, and the controller reads the registry and the health store, as for every group.

A controller restarted in the cluster finds its fleet's groups again through the sink (the
LeaderWorkerSets labelled with the fleet), so it adopts them instead of replacing them.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import yaml

from services.fleet.kubernetes import LABEL_FLEET, LWS_KIND, KubernetesSettings, leader_endpoint, render_group
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


class KubectlFailed(RuntimeError):
    """``kubectl`` exited non-zero; the message carries the command and its stderr."""


Runner = Callable[..., subprocess.CompletedProcess]


class Kubectl:
    """``kubectl apply -f -`` with the objects on stdin; ``kubectl delete KIND NAME`` per object."""

    def __init__(self, namespace: str, *, kubectl: str | None = None, context: str | None = None,
                 run: Runner = subprocess.run, timeout_s: float = 60.0) -> None:
        found = kubectl or shutil.which("kubectl")
        if found is None:
            raise FileNotFoundError("kubectl is not on PATH; use YamlDirectory to write the objects instead")
        self.base = [found, *(["--context", context] if context else []), "--namespace", namespace]
        self.run = run
        self.timeout_s = timeout_s

    def apply_command(self) -> list[str]:
        return [*self.base, "apply", "-f", "-"]

    def delete_command(self, objects: list[dict]) -> list[str]:
        # --wait=false: the LWS controller tears the pods down; stop must not block on it
        targets = [f"{o['kind'].lower()}/{o['metadata']['name']}" for o in objects]
        return [*self.base, "delete", "--ignore-not-found", "--wait=false", *targets]

    def list_command(self, fleet: str) -> list[str]:
        return [*self.base, "get", LWS_KIND.lower(), "-l", f"{LABEL_FLEET}={fleet}", "-o",
                "jsonpath={.items[*].metadata.name}"]

    def _call(self, argv: list[str], stdin: str | None) -> str:
        done = self.run(argv, input=stdin, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        if done.returncode != 0:
            raise KubectlFailed(f"{' '.join(argv)} exited with {done.returncode}: {(done.stderr or '').strip()}")
        return done.stdout or ""

    def apply(self, name: str, objects: list[dict]) -> None:
        self._call(self.apply_command(), to_yaml(objects))

    def delete(self, name: str, objects: list[dict]) -> None:
        self._call(self.delete_command(objects), None)

    def existing(self, fleet: str) -> list[str]:
        return self._call(self.list_command(fleet), None).split()


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
            {"kind": LWS_KIND, "metadata": {"name": name, "namespace": self.settings.namespace}}]
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
