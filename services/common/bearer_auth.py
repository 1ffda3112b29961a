"""``authorization: Bearer <secret>``: the one check behind the router's API key and the
internal services' ``/metrics`` under ``--metrics-auth``."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from services.common.errors import Unauthenticated

AUTH_HEADER = "authorization"


class BearerCheck:
    """``check(value)`` raises Unauthenticated unless the header value is ``Bearer <secret>``;
    with no secret configured every caller passes. ``what`` names the secret in the errors."""

    def __init__(self, secret: str | None, *, what: str = "API key") -> None:
        self.secret = secret or None
        self.what = what

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def check(self, header_value: str | None) -> None:
        if self.secret is None:
            return
        if not header_value:
            raise Unauthenticated(f"missing {self.what}: send the header 'authorization: Bearer <key>'")
        scheme, _, token = header_value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("malformed authorization header: expected 'Bearer <key>'")
        if not hmac.compare_digest(token.strip().encode(), self.secret.encode()):
            raise Unauthenticated(f"incorrect {self.what} provided")

    def check_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """The same check on gRPC invocation metadata."""
        if self.secret is None:
            return
        value = next((v for k, v in metadata or () if k.lower() == AUTH_HEADER), None)
        self.check(value.decode() if isinstance(value, bytes) else value)
