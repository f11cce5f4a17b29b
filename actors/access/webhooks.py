"""Webhooks (book ch. 7): registered HTTP callbacks, signed, retried, dead-lettered.

A registration (url, stream, filter, secret, start position) is stored in the KV bucket
`tierflow_webhooks`, so it survives any gateway restart, and every replica watches that
bucket. Exactly one replica delivers a given webhook at a time: the one holding the webhook's
lease, key `webhook.<id>` of the lease bucket (runtime/nats/lease.py: revision-checked renewals, a
server-side TTL of `lease_s` rounded up to whole seconds, so the lease of a replica that was
SIGKILLed lapses by itself and another takes over). A sender checks that its lease is fresh
before each POST.

Delivery is in stream order, one event at a time per webhook, from the webhook's own
ephemeral consumer (a webhook waits minutes in backoff; it must not hold a shared feed).
Each POST carries:

- body `{"webhook","stream","seq","subject","data"}` (`data` as the filter selects it);
- `X-Tierflow-Signature: sha256=<hex HMAC-SHA256 of the body with the secret>`;
- `X-Tierflow-Delivery: <webhook id>:<seq>`, the same on every retry and after a failover,
  so a receiver drops duplicates by it; `X-Tierflow-Attempt: <n>`.

A non-2xx answer or a network error is retried with exponential backoff; after
`max_attempts` the event goes to `deadletter.webhooks` (with `Nats-Msg-Id`
`webhook:<id>:<seq>`, so a failover does not dead-letter it twice) and delivery goes on.
Progress is the webhook's cursor (`actors/access/cursors.py`, client `webhook`): delivery is
at-least-once, repeats limited to the last cursor flush interval after a failover.

Targets (server-side request forgery): a webhook may reach only public (global unicast)
addresses, plus the networks in `allow_networks` (CIDRs; e.g. `["127.0.0.1/32"]` for a
receiver on this host). A host name is resolved and EVERY address it gives must be allowed,
at registration (400 otherwise) and again at each connection (the sender connects only to
addresses its resolver checked, so a name rebound to a private address after registration is
refused). Redirects are not followed: a 3xx is a failed attempt. A registration belongs to
the token that made it (its owner): other tokens neither see nor delete it.

Tuning (attempts, backoff, lease, allowed networks) is `[gateway.options.webhooks]`
(runtime.config.WebhookOptions, checked when the config loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import math
import random
import secrets
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from actors.access.cursors import CursorRecord, CursorStore, open_bucket
from actors.access.messages import OpenReader, StreamMessage
from runtime.clock import now_ms
from runtime.config import WebhookOptions
from runtime.data.query import Filter
from runtime.errors import TierflowError
from runtime.nats.lease import KvLease, Leadership, Term, ensure_lease_bucket
from runtime.nats.server import js_publish
from runtime.supervision.policy import backoff_delay

log = logging.getLogger(__name__)

__all__ = [
    "BUCKET",
    "DEADLETTER_SUBJECT",
    "GuardedResolver",
    "Registration",
    "TargetPolicy",
    "WebhookError",
    "Webhooks",
    "check_target",
    "delivery_id",
    "sender_session",
    "sign",
    "verify",
]

BUCKET = "tierflow_webhooks"
LEASE_PREFIX = "webhook"  # lease keys `webhook.<id>` in runtime.nats.lease.LEASE_BUCKET
DEADLETTER_SUBJECT = "deadletter.webhooks"
CURSOR_CLIENT = "webhook"
SIGNATURE_HEADER = "X-Tierflow-Signature"
DELIVERY_HEADER = "X-Tierflow-Delivery"
ATTEMPT_HEADER = "X-Tierflow-Attempt"
_json = msgspec.json.Encoder()


class WebhookError(TierflowError, ValueError):
    """A registration that cannot be accepted: `status` (400/404) and the reason."""

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(reason)


class Registration(msgspec.Struct, kw_only=True):
    id: str
    url: str
    stream: str
    filter: str = ""
    secret: str
    start_seq: int = 1
    created_ms: int = 0
    owner: str = ""  # actors.access.cursors.owner_of(token that registered it); "" before owners

    def public(self) -> dict[str, Any]:
        """What a listing shows: everything but the secret and the owner's identity."""
        out = msgspec.to_builtins(self)
        out.pop("secret")
        out.pop("owner", None)
        return out


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, signature: str) -> bool:
    """What a receiver does: recompute and compare in constant time."""
    return hmac.compare_digest(sign(secret, body), signature or "")


def delivery_id(webhook: str, seq: int) -> str:
    return f"{webhook}:{seq}"


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class TargetPolicy:
    """Which addresses a webhook may reach: global unicast ones and the allowed networks."""

    def __init__(self, allowed: Sequence[IPNetwork] = ()) -> None:
        self.allowed = tuple(allowed)

    @classmethod
    def from_networks(cls, networks: Sequence[str]) -> TargetPolicy:
        nets: list[IPNetwork] = []
        for text in networks:
            try:
                nets.append(ipaddress.ip_network(text, strict=False))
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"webhooks.allow_networks: {text!r} is not a network (CIDR such as "
                    f"'127.0.0.1/32' or '10.0.0.0/8'): {err}"
                ) from None
        return cls(nets)

    def allows(self, ip: IPAddress) -> bool:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:10.0.0.1 is 10.0.0.1 to the kernel
        if any(ip in net for net in self.allowed):
            return True
        return ip.is_global and not ip.is_multicast

    def check(self, host: str, addresses: Sequence[str]) -> None:
        """WebhookError 400 unless every address `host` resolved to is allowed."""
        if not addresses:
            raise WebhookError(400, f"webhook host {host!r} resolves to no address")
        for text in addresses:
            try:
                ip = ipaddress.ip_address(text.split("%", 1)[0])
            except ValueError:
                raise WebhookError(400, f"webhook host {host!r}: bad address {text!r}") from None
            if not self.allows(ip):
                raise WebhookError(
                    400,
                    f"webhook target {host!r} ({ip}) is not allowed: loopback, private, "
                    "link-local and other non-public addresses are refused unless their "
                    "network is in gateway.options.webhooks.allow_networks",
                )

    def check_literal(self, host: str) -> bool:
        """Check `host` if it is an IP literal (True), else leave it to the resolver."""
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        self.check(host, [host])
        return True


class GuardedResolver(aiohttp.abc.AbstractResolver):
    """The sender's resolver: every answer is checked, so the connection goes only to an
    address that passed (a name rebound to a private address at delivery is refused)."""

    def __init__(self, policy: TargetPolicy, inner: aiohttp.abc.AbstractResolver | None = None):
        self.policy = policy
        self.inner = inner or aiohttp.DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        results = await self.inner.resolve(host, port, family)
        self.policy.check(host, [r["host"] for r in results])
        return results

    async def close(self) -> None:
        await self.inner.close()


def sender_session(resolver: GuardedResolver, timeout_s: float) -> aiohttp.ClientSession:
    """The HTTP client deliveries go through: it resolves names only by `resolver`, so it
    connects only to checked addresses (IP literals are checked before each request)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(resolver=resolver, ttl_dns_cache=1),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


def check_url(url: Any) -> str:
    if not isinstance(url, str) or not url:
        raise WebhookError(400, "url is required")
    if len(url) > 2048:
        raise WebhookError(400, "url must be at most 2048 characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookError(400, f"url must be an absolute http(s) URL, got {url!r}")
    return url


async def check_target(url: Any, policy: TargetPolicy, resolver: GuardedResolver) -> str:
    """`url` if it is an http(s) URL whose host (every address of it) may be reached."""
    check_url(url)
    parts = urlsplit(url)
    host = parts.hostname or ""
    if policy.check_literal(host):
        return url
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise WebhookError(400, f"url has a bad port: {url!r}") from None
    try:
        await resolver.resolve(host, port, socket.AF_UNSPEC)
    except OSError as err:
        raise WebhookError(400, f"webhook host {host!r} does not resolve: {err}") from None
    return url


class Webhooks:
    """The webhooks of one gateway replica: registry, and per webhook a sender that runs
    while this replica holds the webhook's lease (`owner` names the replica and its
    incarnation: a restarted replica waits for its predecessor's leases to lapse).

    `stream_name(public name)`, `compile_filter` and `open_reader(jetstream name)` come
    from the gateway, so webhooks see streams and filters exactly as clients do.
    """

    def __init__(
        self,
        nc: Any,
        *,
        owner: str,
        cursors: CursorStore,
        open_reader: Callable[[str], OpenReader],
        stream_name: Callable[[str], str],
        compile_filter: Callable[[str], Filter],
        options: WebhookOptions | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.owner = owner
        self.cursors = cursors
        self._open_reader = open_reader
        self._stream_name = stream_name
        self._compile = compile_filter
        self.options = options or WebhookOptions()
        self.policy = TargetPolicy.from_networks(self.options.allow_networks)
        self.kv: Any = None
        self.lease_kv: Any = None
        self.registrations: dict[str, Registration] = {}
        self._senders: dict[str, _Sender] = {}
        self._ending: set[asyncio.Task[None]] = set()
        self._lost_before = 0  # leases lost by senders since dropped
        self._watch: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._resolver = GuardedResolver(self.policy)
        self._stopping = False
        self.counters = {
            "delivered": 0,
            "attempts": 0,
            "retries": 0,
            "dead_lettered": 0,
            "leases_taken": 0,
            "leases_lost": 0,
            "refused_targets": 0,
        }

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self.kv = await open_bucket(self.js, self.options.bucket)
        self.lease_kv = await ensure_lease_bucket(self.js)
        self._session = sender_session(self._resolver, self.options.timeout_s)
        self._watch = asyncio.get_running_loop().create_task(self._watch_registrations())

    async def stop(self) -> None:
        """Stop every sender (cursor flushed) and hand its lease over at once."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for wid in list(self._senders):
            self._drop(wid)
        await asyncio.gather(*self._ending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # ---- registry ---------------------------------------------------------------------

    async def register(
        self,
        *,
        url: Any,
        stream: str,
        filter_text: str,
        secret: Any,
        start_seq: int,
        owner: str = "",
    ) -> Registration:
        """Store a registration (the stream and filter are already checked by the caller)."""
        await check_target(url, self.policy, self._resolver)
        if secret is None or secret == "":
            secret = secrets.token_urlsafe(32)
        if not isinstance(secret, str) or len(secret) > 1024:
            raise WebhookError(400, "secret must be a string of at most 1024 characters")
        reg = Registration(
            id=uuid.uuid4().hex[:16],
            url=url,
            stream=stream,
            filter=filter_text,
            secret=secret,
            start_seq=start_seq,
            created_ms=now_ms(),
            owner=owner,
        )
        await self.kv.put(f"reg.{reg.id}", msgspec.json.encode(reg))
        self._adopt(reg)
        return reg

    async def get(self, wid: str) -> Registration | None:
        if wid in self.registrations:
            return self.registrations[wid]
        if not wid.isalnum():
            return None
        try:
            entry = await self.kv.get(f"reg.{wid}")
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return msgspec.json.decode(entry.value, type=Registration) if entry.value else None

    async def remove(self, wid: str) -> bool:
        reg = await self.get(wid)
        if reg is None:
            return False
        await self.kv.delete(f"reg.{wid}")
        self._drop(wid)  # the holder, here or on another replica, releases the lease
        return True

    async def status(self, wid: str) -> dict[str, Any] | None:
        reg = await self.get(wid)
        if reg is None:
            return None
        cursor = await self.cursors.get(CURSOR_CLIENT, wid)
        owner = None
        with contextlib.suppress(msgspec.DecodeError):
            owner = await self._lease(wid).current_holder()
        return {
            **reg.public(),
            "delivered_seq": cursor.seq if cursor else reg.start_seq - 1,
            "owner": owner,
        }

    def _adopt(self, reg: Registration) -> None:
        self.registrations[reg.id] = reg
        if reg.id in self._senders or self._stopping:
            return
        lease = self._lease(reg.id)
        leadership = Leadership(lease, lambda: self._deliver_all(reg, lease), new_term=self._term)
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(
            leadership.run(stop), name=f"webhook-{reg.id}"
        )
        self._senders[reg.id] = _Sender(leadership, stop, task)

    def _drop(self, wid: str) -> None:
        """Stop the webhook's sender: its delivery ends, its lease is released."""
        self.registrations.pop(wid, None)
        sender = self._senders.pop(wid, None)
        if sender is None:
            return
        self._lost_before += sender.leadership.lost
        sender.stop.set()
        self._ending.add(sender.task)
        sender.task.add_done_callback(self._ending.discard)

    async def _watch_registrations(self) -> None:
        """Follow the registry (all replicas register into it) until stopped."""
        while not self._stopping:
            watcher = None
            try:
                watcher = await self.kv.watch("reg.*")
                async for entry in watcher:
                    if entry is None:
                        continue  # end of the initial values
                    wid = entry.key.split(".", 1)[1]
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        self._drop(wid)
                        continue
                    try:
                        self._adopt(msgspec.json.decode(entry.value, type=Registration))
                    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
                        log.warning("webhook registration %s unreadable; ignored", entry.key)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - NATS outage: watch again
                log.info("webhook registry watch: %r; watching again", err)
                await asyncio.sleep(1.0)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    # ---- leases -----------------------------------------------------------------------

    def _lease(self, wid: str) -> KvLease:
        ttl_s = max(1, math.ceil(self.options.lease_s))  # the server's TTL: whole seconds
        return KvLease(self.nc, self.lease_kv, f"{LEASE_PREFIX}.{wid}", self.owner, ttl_s=ttl_s)

    def _term(self, acquired_at: float) -> Term:
        self.counters["leases_taken"] += 1
        return Term(acquired_at)

    # ---- delivery ---------------------------------------------------------------------

    async def _deliver_all(self, reg: Registration, lease: KvLease) -> None:
        """Deliver from the webhook's cursor on while `lease` is held (Leadership's work)."""
        try:
            await self._deliver_from_cursor(reg, lease)
        finally:
            with contextlib.suppress(Exception):
                await self.cursors.flush([(CURSOR_CLIENT, reg.id)])

    async def _deliver_from_cursor(self, reg: Registration, lease: KvLease) -> None:
        cursor = await self.cursors.get(CURSOR_CLIENT, reg.id)
        next_seq = cursor.seq + 1 if cursor else reg.start_seq
        flt = self._compile(reg.filter)
        reader = await self._open_reader(self._stream_name(reg.stream))(next_seq)
        try:
            while True:
                for ev in await reader.fetch(32, 1.0):
                    body = ev.view(flt)
                    if body is not None:
                        await self._deliver(reg, ev, body, lease)
                    self.cursors.update(
                        CursorRecord(
                            client=CURSOR_CLIENT,
                            sub=reg.id,
                            stream=reg.stream,
                            seq=ev.seq,
                            filter=reg.filter,
                            gateway=self.owner,
                            updated_ms=now_ms(),
                        )
                    )
        finally:
            await reader.close()

    async def _deliver(
        self, reg: Registration, ev: StreamMessage, data: bytes, lease: KvLease
    ) -> None:
        body = b'{"webhook":%s,"stream":%s,"seq":%d,"subject":%s,"data":%s}' % (
            _json.encode(reg.id),
            _json.encode(reg.stream),
            ev.seq,
            _json.encode(ev.subject),
            data,
        )
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "tierflow-webhooks",
            SIGNATURE_HEADER: sign(reg.secret, body),
            DELIVERY_HEADER: delivery_id(reg.id, ev.seq),
        }
        error = ""
        opts = self.options
        for attempt in range(opts.max_attempts):
            if not lease.fresh():  # another replica may hold it soon: stop before sending
                raise _StaleLease(f"webhook {reg.id}: lease not renewed in time")
            self.counters["attempts"] += 1
            error = await self._post(reg.url, body, {**headers, ATTEMPT_HEADER: str(attempt + 1)})
            if not error:
                self.counters["delivered"] += 1
                return
            if attempt + 1 < opts.max_attempts:
                self.counters["retries"] += 1
                await asyncio.sleep(
                    backoff_delay(
                        attempt,
                        base=opts.backoff_base_s,
                        factor=2.0,
                        cap=opts.backoff_cap_s,
                        jitter=0.2,
                        rand=random.random(),
                    )
                )
        await self._dead_letter(reg, ev, data, error)

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> str:
        """'' on a 2xx answer, else what went wrong. The target is checked again here (an
        IP literal now, a name by the session's resolver) and redirects are not followed."""
        assert self._session is not None
        try:
            self.policy.check_literal(urlsplit(url).hostname or "")
            async with self._session.post(
                url, data=body, headers=headers, allow_redirects=False
            ) as resp:
                await resp.read()
                if 200 <= resp.status < 300:
                    return ""
                return f"HTTP {resp.status}"
        except WebhookError as err:
            self.counters["refused_targets"] += 1
            return err.reason
        except (aiohttp.ClientError, TimeoutError) as err:
            return f"{type(err).__name__}: {err}"

    async def _dead_letter(
        self, reg: Registration, ev: StreamMessage, data: bytes, error: str
    ) -> None:
        record = b'{"webhook":%s,"url":%s,"stream":%s,"seq":%d,"subject":%s,' % (
            _json.encode(reg.id),
            _json.encode(reg.url),
            _json.encode(reg.stream),
            ev.seq,
            _json.encode(ev.subject),
        ) + b'"attempts":%d,"error":%s,"data":%s}' % (
            self.options.max_attempts,
            _json.encode(error),
            data,
        )
        headers = {"Nats-Msg-Id": f"webhook:{reg.id}:{ev.seq}"}
        await _until_done(
            lambda: js_publish(self.js, DEADLETTER_SUBJECT, record, headers=headers),
            what=f"webhook {reg.id}: dead letter of seq {ev.seq}",
        )
        self.counters["dead_lettered"] += 1

    def stats(self) -> dict[str, Any]:
        senders = self._senders
        lost = self._lost_before + sum(x.leadership.lost for x in senders.values())
        return {
            **self.counters,
            "leases_lost": lost,
            "registered": len(self.registrations),
            "holding": sorted(w for w, x in senders.items() if x.leadership.role == "active"),
        }


@dataclass(frozen=True)
class _Sender:
    """One webhook's sender on this replica: its lease loop, until `stop` is set."""

    leadership: Leadership[Term]
    stop: asyncio.Event
    task: asyncio.Task[None]


class _StaleLease(Exception):
    """The lease was not renewed in time: deliver nothing until it is (or it is lost)."""


async def _until_done(call: Callable[[], Awaitable[Any]], what: str) -> Any:
    """Retry `call` with backoff until it succeeds (nothing is dropped; cancellable)."""
    attempt = 0
    while True:
        try:
            return await call()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001
            log.warning("%s failed (%r); retrying", what, err)
            await asyncio.sleep(min(10.0, 0.2 * 2**attempt))
            attempt += 1
