"""Consumer auth: which token may connect, which streams it may read, whom it acts for.

Tokens are `auth.consumer_tokens` (empty: auth off), sent as `Authorization: Bearer
<token>` or `?token=`, compared in constant time. `auth.consumer_streams` may restrict a
token to some stream patterns (403 otherwise). The gateway's own buckets (cursors,
webhooks, leases: `internal_buckets`, under whatever names they are configured) are never
served (403), whatever `internal_streams` says; that list (by default also the stream
pattern's buffer) only adds to them. What a token makes
(cursors, webhooks) is owned by its identity (cursors.owner_of), not by the client ids it
chooses. Pure: no I/O.
"""

from __future__ import annotations

import fnmatch
import hmac
from collections.abc import Iterable, Mapping, Sequence

from aiohttp import web

from actors.access.cursors import BUCKET as CURSOR_BUCKET
from actors.access.cursors import owner_of
from actors.access.messages import KV_PREFIX
from actors.access.protocol import Problem, StreamRef
from actors.access.webhooks import BUCKET as WEBHOOK_BUCKET
from runtime.config import GatewayOptions
from runtime.nats.lease import LEASE_BUCKET
from runtime.nats.roles import STATUS_BUCKET

__all__ = ["Access", "internal_buckets", "request_token"]


def internal_buckets(options: GatewayOptions) -> frozenset[str]:
    """The JetStream names of the buckets that hold cursors, webhook secrets and leases:
    under their configured names and their default ones (a bucket left behind by a
    rename still holds what it held)."""
    buckets = {
        options.cursor_bucket,
        CURSOR_BUCKET,
        options.webhooks.bucket,
        WEBHOOK_BUCKET,
        LEASE_BUCKET,
        STATUS_BUCKET,  # the console's view: served filtered at /v1/console, never raw
    }
    return frozenset(KV_PREFIX + b for b in buckets if b)


class Access:
    """Consumer auth (pure): 401 without a valid token, 403 for a stream it may not read."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_streams: Mapping[str, Sequence[str]] | None = None,
        internal: Iterable[str] = (),
    ) -> None:
        self.tokens = [t for t in tokens if t]
        self.token_streams = {k: list(v) for k, v in (token_streams or {}).items()}
        self.internal = frozenset(internal)

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def authenticate(self, token: str | None) -> None:
        if not self.tokens:
            return
        if not token:
            raise Problem(
                401, "missing token: send 'Authorization: Bearer <token>' or '?token=<token>'"
            )
        if not any(hmac.compare_digest(token.encode(), t.encode()) for t in self.tokens):
            raise Problem(401, "invalid token")

    def owner(self, token: str | None) -> str:
        """Who owns what this token makes (cursors, webhooks): one identity per token, or
        "anon" for everyone when auth is off."""
        return owner_of(token if self.enabled else None)

    def may_read(self, token: str | None, ref: StreamRef) -> bool:
        try:
            self.authorize(token, ref)
        except Problem:
            return False
        return True

    def authorize(self, token: str | None, ref: StreamRef) -> None:
        if ref.js in self.internal:
            raise Problem(403, f"stream {ref.public!r} is internal to tierflow")
        allowed = self.token_streams.get(token or "")
        if allowed is not None and not any(
            fnmatch.fnmatchcase(ref.public, p) or fnmatch.fnmatchcase(ref.js, p) for p in allowed
        ):
            raise Problem(403, f"this token may not read stream {ref.public!r}")


def request_token(request: web.Request) -> str | None:
    """The token a request carries: `Authorization: Bearer <token>`, else `?token=`."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.query.get("token") or None
