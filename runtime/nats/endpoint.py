"""Reaching NATS as a client: `connect` and `NatsEndpoint`, with nothing heavier than nats-py.

Split from runtime/nats/server.py (which re-exports both) so a process that only connects, such as
a Spark Python worker or the streaming source's runner, which Spark starts fresh for every
query, does not import the server side, the config schema and its query parser, or the
certificate tooling. `NatsEndpoint.from_config` imports those when it is called.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import nats
import nats.errors
from nats.aio.client import Client

if TYPE_CHECKING:
    from runtime.config import Config

_log = logging.getLogger("runtime.nats.server")


def _server_list(servers: str | list[str]) -> list[str]:
    if isinstance(servers, str):
        servers = servers.split(",")
    out = [s.strip() for s in servers if s and s.strip()]
    if not out:
        raise ValueError("no NATS server URL given")
    return out


async def connect(
    servers: str | list[str],
    *,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
    creds: str | None = None,
    tls_ca: str | None = None,
    name: str | None = None,
    connect_attempts: int = 3,
    **kw: Any,
) -> Client:
    """Connect with nats-py; reconnect forever afterwards, but fail fast at first connect.

    `servers` is one URL, a comma-joined string, or a list. The first connect tries each
    server `connect_attempts` times; a rejected credential raises `nats.errors.AuthorizationError`
    rather than retrying forever. After that the client reconnects without limit unless
    `max_reconnect_attempts` is passed. Other keywords go to `nats.connect` unchanged.
    """
    max_reconnect = kw.pop("max_reconnect_attempts", -1)
    user_error_cb = kw.pop("error_cb", None)
    seen: list[Exception] = []

    async def error_cb(e: Exception) -> None:
        seen.append(e)
        del seen[:-16]  # only the latest errors matter for the first-connect diagnosis
        if user_error_cb is not None:
            await user_error_cb(e)
        else:
            _log.warning("nats: %s: %s", type(e).__name__, e)

    opts: dict[str, Any] = {
        "reconnect_time_wait": 0.25,
        "connect_timeout": 2,
        # a server cut off by a partition closes nothing: only unanswered pings reveal it,
        # so they come every 3 s and two missed mean reconnect to another (6-9 s; at 10 s
        # and three missed, a cut server held a client for 30-40 s)
        "ping_interval": 3,
        "max_outstanding_pings": 2,
    }
    opts.update(kw)
    if tls_ca is not None and "tls" not in opts:
        opts["tls"] = ssl.create_default_context(cafile=tls_ca)
    try:
        nc = await nats.connect(
            servers=_server_list(servers),
            user=user,
            password=password,
            token=token,
            user_credentials=creds,
            name=name,
            error_cb=error_cb,
            max_reconnect_attempts=max(1, connect_attempts),
            **opts,
        )
    except nats.errors.NoServersError as e:
        for err in seen:
            if isinstance(err, nats.errors.AuthorizationError) or (
                "authorization violation" in str(err).lower()
            ):
                raise nats.errors.AuthorizationError() from e
        last = seen[-1] if seen else None
        raise nats.errors.NoServersError() from (last or e)
    nc.options["max_reconnect_attempts"] = max_reconnect
    return nc


# --------------------------------------------------------------------------- endpoints

# NatsEndpoint field -> its jetstream source option (the keys users' Spark code may pass)
_OPTION_KEYS = {
    "user": "user",
    "password": "password",
    "token": "token",
    "creds": "creds",
    "tls_ca": "tlsCa",
    "tls_cert": "tlsCert",
    "tls_key": "tlsKey",
}


@dataclass(frozen=True)
class NatsEndpoint:
    """Where a client reaches NATS and as whom: URL(s), credentials, TLS files, client name.

    Plain strings only (the TLS context is built at connect time), so it pickles to Spark
    executors. `url` may be comma-joined, as `connect` accepts.
    """

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = field(default=None, repr=False)
    name: str | None = None

    @classmethod
    def from_config(
        cls, cfg: Config, role: str = "admin", *, url: str = "", name: str | None = None
    ) -> NatsEndpoint:
        """`url` (default `nats.url`) as `role`: its NATS user when `nats.role_users` or
        `[nats.users.<role>]` say so, else the shared credentials. With `[tls]` on it trusts
        `tls.ca` and presents the client pair when there is one (a server with
        `tls.verify_clients` needs it); otherwise it trusts `nats.tls_ca` when set."""
        from runtime.nats.roles import credentials
        from runtime.tls import tls_files

        who = credentials(cfg, role)
        files = tls_files(cfg)
        return cls(
            url=url or cfg.nats.url,
            user=who.user or None,
            password=who.password or None,
            token=who.token or None,
            creds=who.creds or None,
            tls_ca=str(files.ca) if files is not None else cfg.nats.tls_ca or None,
            tls_cert=str(files.client_cert) if files and files.client_cert else None,
            tls_key=str(files.client_key) if files and files.client_key else None,
            name=name,
        )

    def named(self, name: str) -> NatsEndpoint:
        """The same endpoint under another client name (what the server's connz shows)."""
        return replace(self, name=name)

    def ssl_context(self) -> ssl.SSLContext | None:
        """Trusting `tls_ca` (hostnames checked), presenting the client pair when set; None
        when neither is set (plain, or nats-py's defaults for a ``tls://`` URL)."""
        if not (self.tls_ca or self.tls_cert):
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca or None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key or None)
        return ctx

    def connect_kwargs(self) -> dict[str, Any]:
        """The keywords `connect` takes for this endpoint."""
        kw: dict[str, Any] = {
            "servers": self.url,
            "user": self.user,
            "password": self.password,
            "token": self.token,
            "creds": self.creds,
            "name": self.name,
        }
        ctx = self.ssl_context()
        if ctx is not None:
            kw["tls"] = ctx
        return kw

    async def connect(self, **kw: Any) -> Client:
        """`connect` to this endpoint; keywords given here (e.g. ``name``) win."""
        return await connect(**{**self.connect_kwargs(), **kw})

    def to_options(self) -> dict[str, str]:
        """The jetstream source's string options for this endpoint (empty ones left out;
        the client name is the source's own per connection)."""
        opts = {"url": self.url}
        for attr, key in _OPTION_KEYS.items():
            value = getattr(self, attr)
            if value:
                opts[key] = value
        return opts

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> NatsEndpoint:
        """The endpoint in string options (`to_options`; Spark's are case-insensitive)."""
        url = options.get("url")
        if not url:
            raise ValueError("option 'url' (the NATS server URL) is required")
        values = {attr: options.get(key) or None for attr, key in _OPTION_KEYS.items()}
        return cls(url=url, **values)


__all__ = ["NatsEndpoint", "connect"]
