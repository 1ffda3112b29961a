"""Optional API key: both front doors require ``authorization: Bearer <key>`` when one is set."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from services.common.errors import Unauthenticated

AUTH_HEADER = "authorization"


class ApiKeyCheck:
    """``check(value)`` raises Unauthenticated unless the header value is ``Bearer <key>``;
    with no key configured every caller passes."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key or None

    @property
    def enabled(self) -> bool:
        return self.api_key is not None

    def check(self, header_value: str | None) -> None:
        if self.api_key is None:
            return
        if not header_value:
            raise Unauthenticated("missing API key: send the header 'authorization: Bearer <key>'")
        scheme, _, token = header_value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("malformed authorization header: expected 'Bearer <key>'")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise Unauthenticated("incorrect API key provided")

    def check_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """The same check on gRPC invocation metadata."""
        if self.api_key is None:
            return
        value = next((v for k, v in metadata or () if k.lower() == AUTH_HEADER), None)
        self.check(value.decode() if isinstance(value, bytes) else value)
