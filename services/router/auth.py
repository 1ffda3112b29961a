"""Optional API key: both front doors require ``authorization: Bearer <key>`` when one is set."""

from __future__ import annotations

from services.common.bearer_auth import AUTH_HEADER, BearerCheck

__all__ = ["AUTH_HEADER", "ApiKeyCheck"]


class ApiKeyCheck(BearerCheck):
    """The router's API key (``--api-key``); with none configured every caller passes."""

    def __init__(self, api_key: str | None) -> None:
        super().__init__(api_key, what="API key")

    @property
    def api_key(self) -> str | None:
        return self.secret
