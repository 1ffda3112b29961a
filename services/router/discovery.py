"""Find replica groups in the shard registry (``replica_groups.endpoint``), besides --worker flags.

Every ``interval_s`` (and once before the router serves) the newest registry row of each
endpoint is read: a new endpoint gets a view and a poller (through ``on_endpoint``), and the
row's status (``provisioning`` before a fleet controller puts it in rotation, ``draining``,
``dead``) feeds the view's status. A row that is already dead when first seen gets no view.
Rows whose group id differs from what the worker at that address reports
(an older group that once lived there) are ignored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from services.router.replicas import ReplicaSet

log = logging.getLogger(__name__)

DEFAULT_DISCOVERY_INTERVAL_S = 2.0
WILDCARD_HOSTS = ("0.0.0.0", "[::]", "::")


def dialable(endpoint: str) -> str:
    """A worker that bound every interface registers ``0.0.0.0:P``; dial it on loopback."""
    host, _, port = endpoint.rpartition(":")
    return f"127.0.0.1:{port}" if host in WILDCARD_HOSTS else endpoint


class RegistryDiscovery:
    def __init__(self, registry_url: str, replicas: ReplicaSet, on_endpoint: Callable[[str], None], *,
                 interval_s: float = DEFAULT_DISCOVERY_INTERVAL_S) -> None:
        # deferred: a router without a registry does not load SQLAlchemy (about 1 s of its start)
        from services.common.registry.repository import ShardRegistry

        self.registry = ShardRegistry(registry_url)
        self.replicas = replicas
        self.on_endpoint = on_endpoint
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-discovery", daemon=True)

    def start(self) -> RegistryDiscovery:
        try:  # the groups already registered are known before the router reports SERVING
            self.discover_once()
        except Exception as exc:  # noqa: BLE001 - an outage: the thread keeps trying
            log.warning("registry discovery failed: %s", exc)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.registry.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.discover_once()
            except Exception as exc:  # noqa: BLE001 - a registry outage must not stop routing
                log.warning("registry discovery failed: %s", exc)
            self._stop.wait(self.interval_s)

    def discover_once(self) -> None:
        newest: dict[str, tuple[str, str]] = {}  # address -> (group name, status); oldest rows first
        for group in self.registry.list_groups():
            if group.endpoint:
                newest[dialable(group.endpoint)] = (group.name or str(group.replica_group_id), group.status)
        for address, (name, status) in newest.items():
            if status == "dead" and not self.replicas.known(address):
                continue  # a group that died before we saw it: nothing to route to or poll
            view, created = self.replicas.add(address)
            if created:
                log.info("discovered replica group %s at %s in the registry", name, address)
                with self.replicas.lock:  # before its first poll: a provisioning group is never routable
                    view.registry_status = status
                self.on_endpoint(address)
            with self.replicas.lock:
                if view.replica_group_id in ("", name):
                    view.registry_status = status
                    view.refresh_status(time.monotonic())
                    self.replicas.changed.notify_all()
