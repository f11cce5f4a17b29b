"""Stream logic (book ch. 2): validate, enrich, filter and route a stream's events.

`compile_logic` builds a stream's `StreamLogic` once from its `[streams.NAME.logic]`
table (a `filter` that is not a hook is a WHERE clause, `runtime.data.query.compile_where`);
`StreamLogic.apply` never raises for bad events: they come back as `invalid` with a
reason, for `deadletter.{stream}` (see `dead_letters`). It is pure and lives in the
foundation because three floors use it: the config validates it at load, the Collector
applies it (RBML/SBML) and the BrokerBridge applies it after logging (HML).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime.data.events import Event, json_kind
from runtime.data.query import Data, Getter, compile_where, getter
from runtime.errors import ConfigError
from runtime.hooks import is_hook, load_hook

__all__ = [
    "LogicConfig",
    "LogicResult",
    "StreamLogic",
    "compile_logic",
    "dead_letters",
]

# --------------------------------------------------------------------------- config and result


class LogicConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A stream's `[streams.NAME.logic]` table; every key optional (default: no logic).

    ```toml
    [streams.orders.logic]
    validate = { sku = "str", qty = "int", "shop.country" = "str" }
    validate_hook = "mypkg.rules:check"      # fn(data) -> None/True ok, False/str invalid
    enrich = ["received_at", "collector", "mypkg.rules:add_geo"]  # hook: fn(data) -> dict|None
    filter = "status = 'paid' AND qty >= 0"       # keep where true; or "mypkg.rules:keep"
    route = "raw.orders.{shop.country}"           # subject template over dotted paths
    route_default = "unknown"                     # token for a missing field
    ```

    `validate` maps dotted paths (quoted, or as TOML dotted keys) to a type: str, int,
    float (any number), number, bool, object, array, any (present, not null); a `?`
    suffix makes the field optional (absent or null is fine).
    """

    validate: dict[str, Any] = {}
    validate_hook: str = ""
    enrich: list[str] = []
    filter: str = ""
    route: str = ""
    route_default: str = "unknown"


@dataclass(frozen=True, slots=True)
class LogicResult:
    """What `StreamLogic.apply` made of a batch: every input event is in exactly one list."""

    kept: list[Event]  # processed=True, subject routed, data enriched
    dropped: list[Event]  # filtered out (as received)
    invalid: list[tuple[Event, str]]  # (event as received, reason) for deadletter.{stream}


# --------------------------------------------------------------------------- validate


def _split_path(path: str, key: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in path.split("."))
    if not path.strip() or any(not p for p in parts):
        raise ConfigError(f"{key}: bad field path {path!r}")
    return parts


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "any": lambda v: True,
}


def _flatten_schema(table: dict[str, Any], key: str, prefix: str = "") -> dict[str, str]:
    """`{"group": {"city": "str"}}` (TOML dotted keys) and `{"group.city": "str"}` alike."""
    out: dict[str, str] = {}
    for name, value in table.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(_flatten_schema(value, key, f"{path}."))
        elif isinstance(value, str) and value.removesuffix("?") in _TYPE_CHECKS:
            out[path] = value
        else:
            raise ConfigError(
                f"{key}.{path}: expected one of {', '.join(_TYPE_CHECKS)} (optionally with"
                f" '?'), got {value!r}"
            )
    return out


def _compile_schema(table: dict[str, Any], key: str) -> Callable[[Data], str | None]:
    checks = []
    for path, type_name in _flatten_schema(table, key).items():
        optional = type_name.endswith("?")
        base = type_name.removesuffix("?")
        checks.append((path, getter(_split_path(path, key)), _TYPE_CHECKS[base], base, optional))

    def check(data: Data) -> str | None:
        problems = []
        for path, get, ok, base, optional in checks:
            value = get(data)
            if value is None:
                if not optional:
                    problems.append(f"missing field {path}")
            elif not ok(value):
                problems.append(f"field {path}: expected {base}, got {json_kind(value)}")
        return "; ".join(problems) or None

    return check


# --------------------------------------------------------------------------- hooks and enrichment

Hook = Callable[[Data, Event], Data | None]
ENRICH_BUILTINS = ("received_at", "collector")


def _received_at(data: Data, event: Event) -> None:
    data["received_at"] = event.received_ms


def _collector_hook(name: str) -> Hook:
    def add(data: Data, event: Event) -> None:
        data["collector"] = name

    return add


def _wrap_user_enrich(fn: Callable[[Data], Any]) -> Hook:
    return lambda data, event: fn(data)


# --------------------------------------------------------------------------- route

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_TOKEN_BAD = re.compile(r"[^A-Za-z0-9_-]")
_TOKEN_OK = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_ROUTE_TOKEN = 128


def _valid_subject(subject: str) -> bool:
    tokens = subject.split(".")
    return all(t and not any(c.isspace() or c in "*>{}" for c in t) for t in tokens)


def _route_token(value: Any, default: str) -> str:
    """A field value made safe as (part of) one subject token."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str | int | float):
        text = str(value)
    else:
        return default
    text = _TOKEN_BAD.sub("_", text)[:MAX_ROUTE_TOKEN]
    return text or default


def _compile_route(template: str, default: str, key: str) -> Callable[[Data], str] | None:
    """None for a template without fields; else a function of the event's JSON."""
    if not _TOKEN_OK.match(default):
        raise ConfigError(f"{key}_default: {default!r} must be letters, digits, '_' or '-'")
    parts: list[str | Getter] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(template):
        parts.append(template[pos : m.start()])
        parts.append(getter(_split_path(m.group(1), key)))
        pos = m.end()
    parts.append(template[pos:])
    sample = "".join(p if isinstance(p, str) else "x" for p in parts)
    if any(isinstance(p, str) and ("{" in p or "}" in p) for p in parts):
        raise ConfigError(f"{key}: unbalanced braces in {template!r}")
    if not _valid_subject(sample):
        raise ConfigError(
            f"{key}: {template!r} does not make a subject (dot-separated non-empty tokens,"
            " no spaces or wildcards)"
        )
    if len(parts) == 1:
        return None
    compiled = [p for p in parts if p != ""]

    def route(data: Data) -> str:
        return "".join(
            p if isinstance(p, str) else _route_token(p(data), default) for p in compiled
        )

    return route


# --------------------------------------------------------------------------- StreamLogic


def _describe(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


class StreamLogic:
    """A stream's compiled logic; build it with `compile_logic`.

    `apply` runs validate -> enrich -> filter -> route on each event's JSON, never
    raises for a bad event, and passes events already `processed` through unchanged
    (so an SBML replay cannot run logic twice). A stream with no logic skips decoding.
    Picklable: it pickles as its config and recompiles on load.
    """

    def __init__(
        self,
        stream: str,
        cfg: LogicConfig,
        default_subject: str,
        collector: str,
        *,
        schema: Callable[[Data], str | None] | None,
        validate_hook: Callable[[Data], Any] | None,
        enrich: list[tuple[str, Hook]],
        keep: Callable[[Data], Any] | None,
        route: Callable[[Data], str] | None,
        subject: str,
    ) -> None:
        self.stream = stream
        self.cfg = cfg
        self.default_subject = default_subject
        self.collector = collector
        self._schema = schema
        self._validate_hook = validate_hook
        self._enrich = enrich
        self._keep = keep
        self._route = route
        self._subject = subject
        self._needs_data = any((schema, validate_hook, enrich, keep, route))

    def _fixed_subject(self, event: Event) -> str:
        """A constant route wins; else the subject the event came with, else the default."""
        return self._subject or event.subject or self.default_subject

    def __reduce__(self) -> tuple[Any, ...]:
        return (_recompile, (self.stream, self.cfg, self.default_subject, self.collector))

    def apply(self, events: Sequence[Event]) -> LogicResult:
        if not self._needs_data:
            return LogicResult(self._mark_processed(events), [], [])
        kept: list[Event] = []
        dropped: list[Event] = []
        invalid: list[tuple[Event, str]] = []
        for event in events:
            if event.processed:
                kept.append(event)
            else:
                outcome = self._one(event)
                if isinstance(outcome, Event):
                    kept.append(outcome)
                elif outcome is None:
                    dropped.append(event)
                else:
                    invalid.append((event, outcome))
        return LogicResult(kept, dropped, invalid)

    def _mark_processed(self, events: Sequence[Event]) -> list[Event]:
        """No logic: every event kept, data untouched (never decoded), marked processed,
        with its fixed subject (`_fixed_subject`)."""
        fixed = self._subject
        default = self.default_subject
        return [
            e
            if e.processed
            else Event(
                e.id, e.stream, fixed or e.subject or default, e.data, e.received_ms, True, e.token
            )
            for e in events
        ]

    def _one(self, event: Event) -> Event | str | None:
        """The processed event, None if filtered out, or the reason it is invalid."""
        try:
            data = msgspec.json.decode(event.data)
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as err:
            return f"data is not JSON: {err}"
        if not isinstance(data, dict):
            return f"data is not a JSON object, got {json_kind(data)}"
        if self._schema is not None:
            problem = self._schema(data)
            if problem:
                return problem
        if self._validate_hook is not None:
            try:
                verdict = self._validate_hook(data)
            except Exception as err:
                return f"validate_hook raised {_describe(err)}"
            if verdict is False:
                return "rejected by validate_hook"
            if isinstance(verdict, str) and verdict:
                return verdict
        for name, hook in self._enrich:
            try:
                new = hook(data, event)
            except Exception as err:
                return f"enrich {name} raised {_describe(err)}"
            if isinstance(new, dict):
                data = new
            elif new is not None:
                return f"enrich {name} returned {type(new).__name__}, expected dict or None"
        if self._keep is not None:
            try:
                if not self._keep(data):
                    return None
            except Exception as err:
                return f"filter raised {_describe(err)}"
        subject = self._route(data) if self._route is not None else self._fixed_subject(event)
        payload = event.data
        if self._enrich:
            try:
                payload = msgspec.json.encode(data)
            except Exception as err:
                return f"enriched event cannot be encoded: {_describe(err)}"
        return msgspec.structs.replace(event, subject=subject, data=payload, processed=True)


def compile_logic(
    stream_name: str, cfg: LogicConfig, default_subject: str, *, collector: str = ""
) -> StreamLogic:
    """Compile a stream's logic once; ConfigError naming `streams.NAME.logic.KEY` if bad.

    `collector` is the name the `collector` enrichment writes (default host:pid).
    """
    key = f"streams.{stream_name}.logic"
    collector = collector or f"{socket.gethostname()}:{os.getpid()}"
    schema = _compile_schema(cfg.validate, f"{key}.validate") if cfg.validate else None
    validate_hook = (
        load_hook(cfg.validate_hook, f"{key}.validate_hook") if cfg.validate_hook else None
    )
    enrich: list[tuple[str, Hook]] = []
    for i, spec in enumerate(cfg.enrich):
        if spec == "received_at":
            enrich.append((spec, _received_at))
        elif spec == "collector":
            enrich.append((spec, _collector_hook(collector)))
        elif is_hook(spec):
            enrich.append((spec, _wrap_user_enrich(load_hook(spec, f"{key}.enrich[{i}]"))))
        else:
            raise ConfigError(
                f"{key}.enrich[{i}]: {spec!r} is neither a built-in"
                f" ({', '.join(ENRICH_BUILTINS)}) nor 'module:function'"
            )
    keep: Callable[[Data], Any] | None = None
    if cfg.filter.strip():
        if is_hook(cfg.filter):
            keep = load_hook(cfg.filter, f"{key}.filter")
        else:
            keep = compile_where(cfg.filter, f"{key}.filter")
    subject = ""  # a constant route; "" keeps each event's own subject
    route = None
    if cfg.route:
        route = _compile_route(cfg.route, cfg.route_default, f"{key}.route")
        if route is None:
            subject = cfg.route
    elif not _TOKEN_OK.match(cfg.route_default):
        raise ConfigError(f"{key}.route_default: {cfg.route_default!r} is not a subject token")
    return StreamLogic(
        stream_name,
        cfg,
        default_subject,
        collector,
        schema=schema,
        validate_hook=validate_hook,
        enrich=enrich,
        keep=keep,
        route=route,
        subject=subject,
    )


def _recompile(stream: str, cfg: LogicConfig, default_subject: str, collector: str) -> StreamLogic:
    return compile_logic(stream, cfg, default_subject, collector=collector)


# --------------------------------------------------------------------------- dead letters


def dead_letters(invalid: Sequence[tuple[Event, str]]) -> list[Event]:
    """Records for `deadletter.{stream}`: the reason plus the event as received.

    Each keeps its event's id (JetStream dedups per stream, so a replayed dead letter
    is not stored twice) and is marked processed (no logic runs on it again).
    """
    out = []
    for event, reason in invalid:
        try:
            msgspec.json.decode(event.data)
            original: Any = msgspec.Raw(event.data)
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
            original = event.data.decode("utf-8", "replace")
        record = {
            "id": event.id,
            "stream": event.stream,
            "reason": reason,
            "received_ms": event.received_ms,
            "event": original,
        }
        out.append(
            msgspec.structs.replace(
                event,
                subject=f"deadletter.{event.stream}",
                data=msgspec.json.encode(record),
                processed=True,
            )
        )
    return out
