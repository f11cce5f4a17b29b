"""Webhooks (book ch. 7): registered HTTP callbacks, signed, retried, dead-lettered.

A registration (url, stream, filter, secret, start position) is stored in the KV bucket
`tierflow_webhooks`, so it survives any gateway restart, and every replica watches that
bucket. Exactly one replica delivers a given webhook at a time: it holds the webhook's lease
(a KV key renewed by compare-and-set; taken over once it expires, e.g. after a SIGKILL).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import random
import secrets
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from actors.access.cursors import CursorRecord, CursorStore, open_bucket
from actors.access.fanout import Event, OpenReader
from runtime.clock import now_ms
from runtime.query import Filter
from runtime.supervision import backoff_delay

log = logging.getLogger(__name__)

__all__ = [
    "BUCKET",
    "DEADLETTER_SUBJECT",
    "GuardedResolver",
    "Registration",
    "TargetPolicy",
    "WebhookError",
    "WebhookOptions",
    "Webhooks",
    "check_target",
    "delivery_id",
    "sender_session",
    "sign",
    "verify",
]

BUCKET = "tierflow_webhooks"
DEADLETTER_SUBJECT = "deadletter.webhooks"
CURSOR_CLIENT = "webhook"
SIGNATURE_HEADER = "X-Tierflow-Signature"
DELIVERY_HEADER = "X-Tierflow-Delivery"
ATTEMPT_HEADER = "X-Tierflow-Attempt"
_json = msgspec.json.Encoder()


class WebhookError(ValueError):
    """A registration that cannot be accepted: `status` (400/404) and the reason."""

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(reason)


class WebhookOptions(msgspec.Struct, frozen=True, kw_only=True):
    max_attempts: int = 5
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    timeout_s: float = 10.0
    lease_s: float = 5.0
    bucket: str = BUCKET
    # CIDRs a target may be in besides public addresses (loopback, private, link-local
    # ones are refused unless listed here), e.g. ["127.0.0.1/32", "10.20.0.0/16"]
    allow_networks: list[str] = []


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


class _Lease(msgspec.Struct):
    owner: str
    until_ms: int


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
    """The webhooks of one gateway replica: registry, leases and one sender task per lease.

    `resolve(stream) -> (jetstream name, Filter maker)` and `open_reader(jetstream name)`
    come from the gateway, so webhooks see streams and filters exactly as clients do.
    """

    def __init__(
        self,
        js: Any,
        *,
        owner: str,
        cursors: CursorStore,
        open_reader: Callable[[str], OpenReader],
        stream_name: Callable[[str], str],
        compile_filter: Callable[[str], Filter],
        options: WebhookOptions | None = None,
    ) -> None:
        self.js = js
        self.owner = owner
        self.cursors = cursors
        self._open_reader = open_reader
        self._stream_name = stream_name
        self._compile = compile_filter
        self.options = options or WebhookOptions()
        self.policy = TargetPolicy.from_networks(self.options.allow_networks)
        self.kv: Any = None
        self.registrations: dict[str, Registration] = {}
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._watch: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._resolver = GuardedResolver(self.policy)
        self._stopping = False
        self.holding: set[str] = set()
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
        self._session = sender_session(self._resolver, self.options.timeout_s)
        self._watch = asyncio.get_running_loop().create_task(self._watch_registrations())

    async def stop(self) -> None:
        self._stopping = True
        tasks = [t for t in (self._watch, *self._runners.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for wid in list(self.holding):  # hand the leases over at once
            with contextlib.suppress(Exception):
                await self.kv.delete(f"lease.{wid}")
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
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

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
        self._drop(wid)
        with contextlib.suppress(Exception):
            await self.kv.delete(f"lease.{wid}")
        return True

    async def status(self, wid: str) -> dict[str, Any] | None:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        reg = await self.get(wid)
        if reg is None:
            return None
        cursor = await self.cursors.get(CURSOR_CLIENT, wid)
        owner = None
        with contextlib.suppress(KeyNotFoundError, KeyDeletedError, msgspec.DecodeError):
            entry = await self.kv.get(f"lease.{wid}")
            if entry.value:
                owner = msgspec.json.decode(entry.value, type=_Lease).owner
        return {
            **reg.public(),
            "delivered_seq": cursor.seq if cursor else reg.start_seq - 1,
            "owner": owner,
        }

    def _adopt(self, reg: Registration) -> None:
        self.registrations[reg.id] = reg
        if reg.id not in self._runners and not self._stopping:
            task = asyncio.get_running_loop().create_task(self._run(reg), name=f"webhook-{reg.id}")
            self._runners[reg.id] = task

    def _drop(self, wid: str) -> None:
        self.registrations.pop(wid, None)
        task = self._runners.pop(wid, None)
        if task is not None:
            task.cancel()

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
                    except msgspec.DecodeError:
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

    def _lease_value(self) -> bytes:
        until = now_ms() + int(self.options.lease_s * 1000)
        return msgspec.json.encode(_Lease(self.owner, until))

    async def _acquire(self, wid: str) -> int | None:
        """The lease's revision if this replica holds it now, else None."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

        key = f"lease.{wid}"
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            entry = None
        try:
            if entry is None or not entry.value:
                return await self.kv.create(key, self._lease_value())
            lease = msgspec.json.decode(entry.value, type=_Lease)
            if lease.owner == self.owner or lease.until_ms < now_ms():
                return await self.kv.update(key, self._lease_value(), last=entry.revision)
        except (KeyWrongLastSequenceError, msgspec.DecodeError):
            return None
        return None

    async def _run(self, reg: Registration) -> None:
        """Hold the lease and deliver; without it, check again every half lease."""
        while not self._stopping:
            try:
                revision = await self._acquire(reg.id)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001
                log.info("webhook %s: lease: %r", reg.id, err)
                revision = None
            if revision is None:
                await asyncio.sleep(self.options.lease_s / 2)
                continue
            self.counters["leases_taken"] += 1
            self.holding.add(reg.id)
            deliver = asyncio.get_running_loop().create_task(self._deliver_all(reg))
            try:
                await self._hold(reg.id, revision, deliver)
            finally:
                self.holding.discard(reg.id)
                deliver.cancel()
                await asyncio.gather(deliver, return_exceptions=True)
                with contextlib.suppress(Exception):
                    await self.cursors.flush([(CURSOR_CLIENT, reg.id)])
            if not deliver.cancelled() and deliver.exception() is not None:
                log.info("webhook %s: delivery stopped: %r", reg.id, deliver.exception())
                await asyncio.sleep(1.0)

    async def _hold(self, wid: str, revision: int, deliver: asyncio.Task[None]) -> None:
        """Renew the lease every third of its length until lost or delivery ends."""
        while not deliver.done():
            done, _ = await asyncio.wait({deliver}, timeout=self.options.lease_s / 3)
            if done:
                return
            try:
                revision = await self.kv.update(f"lease.{wid}", self._lease_value(), last=revision)
            except Exception as err:  # noqa: BLE001 - taken over, or NATS unreachable
                self.counters["leases_lost"] += 1
                log.info("webhook %s: lease lost: %r", wid, err)
                return

    # ---- delivery ---------------------------------------------------------------------

    async def _deliver_all(self, reg: Registration) -> None:
        cursor = await self.cursors.get(CURSOR_CLIENT, reg.id)
        next_seq = cursor.seq + 1 if cursor else reg.start_seq
        flt = self._compile(reg.filter)
        reader = await self._open_reader(self._stream_name(reg.stream))(next_seq)
        try:
            while True:
                for ev in await reader.fetch(32, 1.0):
                    body = ev.view(flt)
                    if body is not None:
                        await self._deliver(reg, ev, body)
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

    async def _deliver(self, reg: Registration, ev: Event, data: bytes) -> None:
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

    async def _dead_letter(self, reg: Registration, ev: Event, data: bytes, error: str) -> None:
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
            lambda: self.js.publish(DEADLETTER_SUBJECT, record, headers=headers),
            what=f"webhook {reg.id}: dead letter of seq {ev.seq}",
        )
        self.counters["dead_lettered"] += 1

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "registered": len(self.registrations),
            "holding": sorted(self.holding),
        }


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
