"""How the fleet controller pages: a provisioning failure becomes a telemetry alert
(``ALERT_KIND_PROVISIONING_FAILED``), published to every ``Alerts`` subscriber like telemetry's
own. The controller keeps working if telemetry is down: the failure is in the log and in the
registry (the group ``dead`` with its reason) either way."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from services.common.group_status import GroupStatus
from services.telemetry.client import raise_alert
from services.telemetry.rules import Alert, AlertKind

log = logging.getLogger(__name__)

Page = Callable[[str, str], None]  # (group, what went wrong)


def telemetry_pager(address: str) -> Page:
    def page(group: str, message: str) -> None:
        alert = Alert(AlertKind.PROVISIONING_FAILED, group, "", "", GroupStatus.UNHEALTHY, message,
                      int(time.time() * 1000))
        try:
            raise_alert(address, alert, timeout_s=2.0)
        except grpc.RpcError as exc:
            log.warning("page for %s not delivered to telemetry at %s: %s", group, address, exc.code())

    return page
