"""A stream's declared schema (`[streams.X] schema`, a Spark DDL) as a check on its events.

Spark's JSON reader (`from_json`, which sql jobs and `tierflow sql` parse events with)
reads a field whose JSON does not fit its declared type as null, without a word: a producer
that sends ``"price": "12.5"`` for ``price DOUBLE`` would see its events accepted and its
prices gone from every answer. So the collector refuses such an event (400, naming the
field) before it is accepted, by these rules, which follow what Spark's reader takes
(tests/test_event_schema.py runs both over the same values):

- BIGINT, INT, SMALLINT, TINYINT: a JSON integer in the type's range (not ``1.0``);
- DOUBLE, FLOAT: a JSON number, or one of Spark's names for the non-finite ones
  (``"NaN"``, ``"Infinity"``, ``"+INF"``, ...);
- DECIMAL(p, s): a number, or a numeric string, that rounded half up to s places has at
  most p - s digits before the point;
- BOOLEAN: ``true`` or ``false``;
- STRING (VARCHAR, CHAR): anything (Spark keeps a non-string as its JSON text);
- DATE, TIMESTAMP_NTZ, BINARY: a string; TIMESTAMP: a string or an integer (seconds);
- STRUCT<...>: an object, its fields by these rules; ARRAY<T>: an array of T;
  MAP<K, V>: an object of V;
- any field may be null or absent, and fields the schema does not name are anything.

Strings for dates and timestamps are left to Spark's parser, which accepts many forms:
one it cannot read is still null there. A type this module does not know takes anything.

msgspec does the checking, from a Struct type built from the DDL (one decode in C per
event); sqlglot reads the DDL. Hand-written here is only the mapping of Spark's types to
msgspec's, and the DECIMAL bound, which no msgspec constraint states.
"""

from __future__ import annotations

import decimal
import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import msgspec
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from runtime.errors import TierflowError

DType = exp.DataType.Type

# Spark's names for the non-finite doubles (JacksonParser), as JSON strings
NON_FINITE = Literal["NaN", "Infinity", "+Infinity", "-Infinity", "+INF", "-INF"]
_INTEGRAL = {
    DType.BIGINT: 63,
    DType.INT: 31,
    DType.SMALLINT: 15,
    DType.TINYINT: 7,
}
_FLOATING = {DType.DOUBLE, DType.FLOAT}
_STRINGS = {DType.DATE, DType.TIMESTAMPNTZ, DType.BINARY, DType.VARBINARY}
_TIMESTAMPS = {DType.TIMESTAMP, DType.TIMESTAMPTZ, DType.TIMESTAMPLTZ}


class SchemaError(TierflowError, ValueError):
    """A schema text that is not a list of fields with Spark types."""


def schema_fields(ddl: str) -> list[tuple[str, exp.DataType | None]]:
    """The top-level fields of a Spark DDL (``a INT, b STRING``, ``a: INT``, or
    ``STRUCT<...>``), in order, each with its type as sqlglot reads it (None for a type it
    cannot read, such as VOID: Spark is the judge of those, and the check takes anything).

    sqlglot reads Spark's types but not every field list Spark does (a VOID field fails
    the whole list; after ``INTERVAL YEAR`` it stops early), so the list is split into
    fields here, at the commas outside brackets, quotes and backticks."""
    text = ddl.strip()
    if text[:7].lower() == "struct<" and text.endswith(">"):
        text = text[7:-1]
    if not text.strip():
        raise SchemaError("no fields: a Spark DDL such as 'id BIGINT, price DOUBLE'")
    fields: list[tuple[str, exp.DataType | None]] = []
    for part in _split_top_level(text):
        m = _FIELD.match(part)
        if m is None:
            raise SchemaError(f"{part.strip()!r} is not a field: a name, then a Spark type")
        name = m["quoted"].replace("``", "`") if m["quoted"] is not None else m["bare"]
        if any(name == seen for seen, _ in fields):
            raise SchemaError(f"field {name!r} is declared twice")
        fields.append((name, _read_type(part[m.end() :])))
    return fields


_FIELD = re.compile(r"\s*(?:`(?P<quoted>(?:[^`]|``)+)`|(?P<bare>[^\s:`,<>()]+))\s*:?\s*(?=\S)")


def _split_top_level(text: str) -> list[str]:
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "`'\"":
            quote = ch
        elif ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    if not parts[-1].strip() and len(parts) > 1:
        parts.pop()  # a trailing comma
    return parts


def _read_type(text: str) -> exp.DataType | None:
    """A field's type (its NOT NULL and COMMENT aside), or None where sqlglot cannot."""
    try:
        tree = sqlglot.parse_one(f"CREATE TABLE t (x {text})", read="spark")
        col = tree.this.expressions[0] if isinstance(tree.this, exp.Schema) else None
        kind = col.args.get("kind") if isinstance(col, exp.ColumnDef) else None
        if isinstance(kind, exp.DataType) and len(tree.this.expressions) == 1:
            return kind
    except (ParseError, ValueError):
        pass
    try:
        return exp.DataType.build(text.strip(), dialect="spark")
    except (ParseError, ValueError):
        return None


def _struct_fields(dt: exp.DataType) -> list[tuple[str, exp.DataType | None]]:
    out: list[tuple[str, exp.DataType | None]] = []
    for col in dt.expressions:
        kind = col.args.get("kind")
        out.append((col.name, kind if isinstance(kind, exp.DataType) else None))
    return out


# A DECIMAL's bound, checked after the decode: (path steps, precision, scale, its DDL), where a
# step is a field name, or None for every element of an array or value of a map.
_Bound = tuple[tuple[str | None, ...], int, int, str]


class _Builder:
    """One DDL's msgspec type, and where its DECIMAL fields are."""

    def __init__(self) -> None:
        self.bounds: list[_Bound] = []
        self._structs = 0

    def struct(
        self, fields: list[tuple[str, exp.DataType | None]], path: tuple[str | None, ...]
    ) -> Any:
        self._structs += 1
        members = []
        rename = {}
        for i, (name, dt) in enumerate(fields):
            attr = f"f{i}"
            rename[attr] = name
            t = self.type_of(dt, (*path, attr))
            members.append((attr, _nullable(t), None))
        return msgspec.defstruct(f"Fields{self._structs}", members, rename=rename)

    def type_of(self, dt: exp.DataType | None, path: tuple[str | None, ...]) -> Any:
        if dt is None:
            return msgspec.Raw
        t = dt.this
        if t in _INTEGRAL:
            bits = _INTEGRAL[t]
            return Annotated[int, msgspec.Meta(ge=-(2**bits), le=2**bits - 1)]
        if t in _FLOATING:
            return float | NON_FINITE
        if t == DType.DECIMAL:
            precision, scale = _decimal_args(dt)
            self.bounds.append((path, precision, scale, dt.sql("spark")))
            return decimal.Decimal
        if t == DType.BOOLEAN:
            return bool
        if t in _STRINGS:
            return str
        if t in _TIMESTAMPS:
            return Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | str
        if t == DType.STRUCT:
            return self.struct(_struct_fields(dt), path)
        if t == DType.ARRAY and dt.expressions:
            return list[_nullable(self.type_of(dt.expressions[0], (*path, None)))]  # type: ignore[misc]
        if t == DType.MAP and len(dt.expressions) == 2:
            return dict[str, _nullable(self.type_of(dt.expressions[1], (*path, None)))]  # type: ignore[misc]
        # STRING and its kin, and what Spark reads in ways not modelled here: anything,
        # skipped unbuilt (a Raw is its JSON text, null included)
        return msgspec.Raw


def _nullable(t: Any) -> Any:
    """`t` or null (a Raw takes null already, and may not be in a union)."""
    return t if t is msgspec.Raw else t | None


def _decimal_args(dt: exp.DataType) -> tuple[int, int]:
    """DECIMAL's (precision, scale); Spark's default is (10, 0)."""
    args = [
        int(e.this.this) if isinstance(e.this, exp.Literal) else int(e.name) for e in dt.expressions
    ]
    precision = args[0] if args else 10
    scale = args[1] if len(args) > 1 else 0
    return precision, scale


class EventSchema:
    """A stream's schema as a check: `problem(raw)` is why an event's JSON does not fit it,
    or None. Built once per stream; the check is one typed decode."""

    def __init__(self, ddl: str) -> None:
        self.fields = schema_fields(ddl)
        builder = _Builder()
        self._type = builder.struct(self.fields, ())
        self._decode: Callable[[bytes], Any] = msgspec.json.Decoder(self._type).decode
        self._bounds = builder.bounds
        self._names = {f"f{i}": name for i, (name, _) in enumerate(self.fields)}

    def problem(self, raw: bytes) -> str | None:
        try:
            value = self._decode(raw)
        except msgspec.ValidationError as err:
            return self._explain(str(err), raw)
        except msgspec.DecodeError:
            return None  # not JSON: the collector's own check says so, in its words
        for path, precision, scale, spark in self._bounds:
            for where, d in _leaves(value, path, "$"):
                if not _fits(d, precision, scale):
                    return f"`{where}` must be {spark}, got {d}, which it cannot hold"
        return None

    def _explain(self, err: str, raw: bytes) -> str:
        """msgspec's `err` in the schema's words: the field, its Spark type, what came."""
        m = _AT.search(err)
        if m is None:
            return err
        where = m["path"]
        fields: list[tuple[str, exp.DataType | None]] | None = self.fields
        dt: exp.DataType | None = None
        value: Any = msgspec.json.decode(raw)
        for name, index in _STEP.findall(where[1:]):
            if name:
                found = [t for n, t in fields or [] if n == name]
                if not found:
                    return err
                dt, value = found[0], value.get(name) if isinstance(value, dict) else _UNKNOWN
            elif dt is not None and dt.expressions:
                dt = (
                    dt.expressions[-1].args.get("kind")
                    if dt.this == DType.STRUCT
                    else dt.expressions[-1]
                )
                value = (
                    value[int(index)] if index.isdigit() and isinstance(value, list) else _UNKNOWN
                )
            else:
                return err
            fields = _struct_fields(dt) if dt is not None and dt.this == DType.STRUCT else None
        if dt is None:
            return err
        spark = dt.sql("spark")
        if value is _UNKNOWN:
            return f"`{where}` must be {spark}: {err[: m.start()]}"
        got = _describe(value)
        if isinstance(value, int) and dt.this in _INTEGRAL:
            got += f", out of {spark}'s range"
        return f"`{where}` must be {spark}, got {got}"


_AT = re.compile(r" - at `(?P<path>\$.*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_UNKNOWN = object()


def _describe(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return msgspec.json.encode(value).decode()
    if isinstance(value, str):
        text = msgspec.json.encode(value).decode()
        return f"the string {text if len(text) <= 40 else text[:37] + '...'}"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    return "an object" if isinstance(value, dict) else "an array"


def _leaves(value: Any, path: tuple[str | None, ...], where: str) -> Iterator[tuple[str, Any]]:
    """The values at `path` under `value` (every element where a step is None), with
    their JSON paths; nulls and absent fields are none."""
    if value is None:
        return
    if not path:
        yield where, value
        return
    step, rest = path[0], path[1:]
    if step is None:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            yield from _leaves(
                v, rest, f"{where}[{k!r}]" if isinstance(k, str) else f"{where}[{k}]"
            )
        return
    name = value.__struct_encode_fields__[value.__struct_fields__.index(step)]
    yield from _leaves(getattr(value, step), rest, f"{where}.{name}")


def _fits(d: decimal.Decimal, precision: int, scale: int) -> bool:
    """DECIMAL(precision, scale) holds `d` as Spark stores it: rounded half up to `scale`
    places, then at most `precision` digits."""
    if not d.is_finite():
        return False
    ctx = decimal.Context(prec=max(precision, 28) + 2, rounding=decimal.ROUND_HALF_UP)
    try:
        rounded = d.quantize(decimal.Decimal(1).scaleb(-scale), context=ctx)
    except decimal.InvalidOperation:
        return False
    return abs(rounded) < decimal.Decimal(10) ** (precision - scale)
