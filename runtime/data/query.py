"""Queries over one event's JSON (book chs. 2 and 7): the WHERE compiler and consumer filters.

Both are compiled once and evaluated per event, and both live in the foundation because
three floors use them: the config validates them at load, stream logic (`runtime.data.logic`)
keeps a stream's events by a WHERE clause, and the access tier (gateway, fan-out,
webhooks) hands each client the events and fields its filter selects.

`compile_where(clause, key)` is a SQL WHERE clause as a predicate over a JSON object:
dotted paths, SQL three-valued logic (a missing field is NULL and a comparison with NULL is
not true). A bad clause raises `ConfigError` naming `key`, the line and the column.

`compile_filter(sql)` is a consumer filter, a small SQL query compiled once per distinct
text:

    SELECT group.group_city, response AS r WHERE response = 'yes' AND guests > 0

Both parts are optional (`SELECT *` and no condition by default); a text starting with
`WHERE`, or a bare condition (`response = 'yes'`), is a WHERE clause alone, compiled by
`compile_where`. The pseudo-field `_subject` is the message's NATS subject, in WHERE and in
SELECT. Projection keeps the shape of the event: `SELECT a.b, c` gives
`{"a": {"b": ..}, "c": ..}`, a missing field gives null, `x.y AS z` gives `{"z": ..}`, and
`*` alongside fields keeps the whole object and adds them (`SELECT *, _subject`). A bad
query raises `FilterError` with the reason and the line/column in the text the client
sent; the gateway answers it as HTTP 400 or an error frame.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, SqlglotError, TokenError

from runtime.errors import ConfigError, TierflowError

__all__ = [
    "MATCH_ALL",
    "MAX_FILTER_CHARS",
    "SUBJECT_FIELD",
    "Data",
    "Filter",
    "FilterError",
    "Getter",
    "compile_filter",
    "compile_named",
    "compile_where",
    "getter",
]

Data = dict[str, Any]  # one event's JSON object
Getter = Callable[[Data], Any]


def getter(path: Sequence[str]) -> Getter:
    """Value at a dotted path; None when any step is missing or not an object."""
    keys = tuple(path)
    if len(keys) == 1:
        key = keys[0]
        return lambda data: data.get(key)

    def get(data: Data) -> Any:
        node: Any = data
        for key in keys:
            if not isinstance(node, dict):
                return None
            node = node.get(key)
        return node

    return get


# --------------------------------------------------------------------------- positions in a text

_SQLGLOT_CLASS = re.compile(r"<class '(?:\w+\.)*(\w+)'>")


def _line_col(text: str, offset: int) -> tuple[int, int]:
    """1-based (line, column) of `offset` in `text`."""
    offset = max(0, min(offset, len(text)))
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def _text_where(text: str, offset: int) -> str:
    line, column = _line_col(text, offset)
    return f"line {line}, column {column}"


def _unterminated_quote(text: str) -> int | None:
    """Offset of the quote that opens an unterminated string or quoted name."""
    quote, start = "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""  # a doubled quote re-opens at the next char: same result
        elif ch in "'\"`":
            quote, start = ch, i
    return start if quote else None


def _node_offset(node: exp.Expression) -> int:
    """Where `node` starts in the parsed text (its first token with a position)."""
    starts = [n.meta["start"] for n in node.walk() if "start" in n.meta]
    return min(starts) if starts else 0


# --------------------------------------------------------------------------- WHERE

_SUPPORTED = "=, !=, <, <=, >, >=, AND, OR, NOT, IN (...), [NOT] LIKE 'a%', IS [NOT] NULL"
_ORDER = {exp.LT: operator.lt, exp.LTE: operator.le, exp.GT: operator.gt, exp.GTE: operator.ge}
_NUMBER = re.compile(r"^[0-9]+$")


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "num"
    if isinstance(value, str):
        return "str"
    return "other"


def _equal(a: Any, b: Any) -> bool | None:
    """SQL `=` over JSON values: NULL if either is null; different kinds are unequal."""
    if a is None or b is None:
        return None
    return _kind(a) == _kind(b) and a == b


def _ordered(op: Callable[[Any, Any], bool], a: Any, b: Any) -> bool | None:
    """SQL `<` etc.: only numbers with numbers and strings with strings; else NULL."""
    if a is None or b is None:
        return None
    ka = _kind(a)
    if ka != _kind(b) or ka not in ("num", "str"):
        return None
    return op(a, b)


def _position(clause: str, node: exp.Expression) -> str:
    """Where `node` sits in `clause`: its operator's token if found, else its first token."""
    offset = _node_offset(node)
    word = type(node).__name__.upper()
    try:
        tokens = sqlglot.tokenize(clause)
    except SqlglotError:
        tokens = []
    for tok in tokens:  # the node's own operator is the first such token from its start
        if tok.start >= offset and tok.token_type.name == word:
            offset = tok.start
            break
    return _text_where(clause, offset)


class _WhereCompiler:
    """SQL WHERE clause -> closure over a JSON object, with SQL's three-valued logic."""

    def __init__(self, clause: str, key: str) -> None:
        self.clause = clause
        self.key = key

    def compile(self) -> Callable[[Data], bool]:
        """The condition as a predicate; every failure is a ConfigError naming the key."""
        try:
            return self._compile()
        except RecursionError:  # the parser's limit: ~55+ nested parentheses
            raise ConfigError(f"{self.key}: the condition is nested too deeply") from None

    def _compile(self) -> Callable[[Data], bool]:
        try:
            tree = sqlglot.parse_one(self.clause)
        except ParseError as err:
            info = err.errors[0] if err.errors else {}
            where = f"line {info.get('line', 1)}, column {info.get('col', 1)}"
            what = _SQLGLOT_CLASS.sub(r"\1", info.get("description") or str(err))
            raise ConfigError(
                f"{self.key}: cannot parse {self.clause!r} at {where}: {what}"
            ) from None
        except TokenError:
            start = _unterminated_quote(self.clause)
            where = _text_where(self.clause, start) if start is not None else "its end"
            raise ConfigError(
                f"{self.key}: cannot parse {self.clause!r} at {where}: unterminated quote"
            ) from None
        except SqlglotError as err:
            raise ConfigError(f"{self.key}: cannot parse {self.clause!r}: {err}") from None
        test = self.condition(tree)
        return lambda data: test(data) is True

    def unsupported(self, node: exp.Expression, why: str = "") -> ConfigError:
        alias = node.args.get("alias") if isinstance(node, exp.Alias) else None
        if isinstance(alias, exp.Identifier):  # `a = 0x10` parses as `a = 0 AS x10`
            node, why = alias, f"unexpected {alias.name!r}"
        why = why or f"unsupported syntax {type(node).__name__.upper()}"
        return ConfigError(
            f"{self.key}: {why} at {_position(self.clause, node)} in {self.clause!r}"
            f" (supported: {_SUPPORTED})"
        )

    def condition(self, node: exp.Expression) -> Callable[[Data], bool | None]:
        if isinstance(node, exp.Paren):
            return self.condition(node.this)
        if isinstance(node, exp.And | exp.Or):
            left, right = self.condition(node.this), self.condition(node.expression)
            return _and(left, right) if isinstance(node, exp.And) else _or(left, right)
        if isinstance(node, exp.Not):
            inner = self.condition(node.this)

            def negate(data: Data) -> bool | None:
                value = inner(data)
                return None if value is None else not value

            return negate
        if isinstance(node, exp.EQ | exp.NEQ):
            a, b = self.operand(node.this), self.operand(node.expression)
            if isinstance(node, exp.EQ):
                return lambda data: _equal(a(data), b(data))

            def differ(data: Data) -> bool | None:
                same = _equal(a(data), b(data))
                return None if same is None else not same

            return differ
        if type(node) in _ORDER:
            op = _ORDER[type(node)]
            a, b = self.operand(node.this), self.operand(node.expression)
            return lambda data: _ordered(op, a(data), b(data))
        if isinstance(node, exp.In):
            return self.in_list(node)
        if isinstance(node, exp.Like):
            return self.like(node)
        if isinstance(node, exp.Is):
            if not isinstance(node.expression, exp.Null):
                raise self.unsupported(node, "only IS NULL / IS NOT NULL are supported")
            value = self.operand(node.this)
            return lambda data: value(data) is None
        if isinstance(node, exp.Column | exp.Dot | exp.Literal | exp.Boolean):
            raise self.unsupported(node, "expected a comparison (e.g. flag = TRUE)")
        raise self.unsupported(node)

    def like(self, node: exp.Like) -> Callable[[Data], bool | None]:
        """`x LIKE 'pat%'`: `%` any run of characters, `_` one; a string pattern only
        (a literal), matched against a string (anything else is not a match: NULL)."""
        pattern = node.expression
        if not (isinstance(pattern, exp.Literal) and pattern.is_string):
            raise self.unsupported(node, "LIKE needs a quoted pattern ('job.%')")
        text = "".join(
            ".*" if c == "%" else "." if c == "_" else re.escape(c) for c in pattern.this
        )
        matcher = re.compile(text, re.DOTALL)
        value = self.operand(node.this)

        negate = bool(node.args.get("negate"))  # sqlglot's `x NOT LIKE p`

        def like(data: Data) -> bool | None:
            v = value(data)
            return None if not isinstance(v, str) else (matcher.fullmatch(v) is None) is negate

        return like

    def in_list(self, node: exp.In) -> Callable[[Data], bool | None]:
        extra = [k for k in ("query", "unnest", "field") if node.args.get(k)]
        if extra or not node.expressions:
            raise self.unsupported(node, "IN needs a non-empty list of values")
        value = self.operand(node.this)
        options = [self.operand(e) for e in node.expressions]

        def member(data: Data) -> bool | None:
            v = value(data)
            if v is None:
                return None
            unknown = False
            for option in options:
                same = _equal(v, option(data))
                if same:
                    return True
                unknown = unknown or same is None
            return None if unknown else False

        return member

    def operand(self, node: exp.Expression) -> Getter:
        if isinstance(node, exp.Column | exp.Dot):
            path = self.path(node)
            return getter(path)
        if isinstance(node, exp.Literal):
            const = self.literal(node)
            return lambda data: const
        if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal):
            const = self.literal(node.this)
            if not isinstance(const, int | float):
                raise self.unsupported(node, "'-' applies to numbers only")
            neg = -const
            return lambda data: neg
        if isinstance(node, exp.Boolean):
            flag = bool(node.this)
            return lambda data: flag
        if isinstance(node, exp.Null):
            return lambda data: None
        raise self.unsupported(node)

    def literal(self, node: exp.Literal) -> Any:
        text = str(node.this)
        if node.is_string:
            return text
        if _NUMBER.match(text):
            return int(text)
        try:
            return float(text)
        except ValueError:  # sqlglot reads `0E` as a number
            raise self.unsupported(node, f"{text!r} is not a number") from None

    def path(self, node: exp.Expression) -> list[str]:
        if isinstance(node, exp.Dot):
            if not isinstance(node.expression, exp.Identifier):
                raise self.unsupported(node)
            return [*self.path(node.this), node.expression.name]
        parts = node.parts if isinstance(node, exp.Column) else None  # `''.a`: Dot on a literal
        if not parts or any(not isinstance(p, exp.Identifier) for p in parts):
            raise self.unsupported(node, "expected a field name")
        return [p.name for p in parts]


def _and(left: Callable[[Data], bool | None], right: Callable[[Data], bool | None]) -> Any:
    def both(data: Data) -> bool | None:
        a = left(data)
        if a is False:
            return False
        b = right(data)
        if b is False:
            return False
        return None if a is None or b is None else True

    return both


def _or(left: Callable[[Data], bool | None], right: Callable[[Data], bool | None]) -> Any:
    def either(data: Data) -> bool | None:
        a = left(data)
        if a is True:
            return True
        b = right(data)
        if b is True:
            return True
        return None if a is None or b is None else False

    return either


def compile_where(clause: str, key: str = "filter") -> Callable[[Data], bool]:
    """A SQL WHERE clause as a predicate over a JSON object: True keeps the event.

    Fields are dotted paths (`group.group_country`; quote reserved words: `"select"`).
    A missing field or JSON null is SQL NULL, and a comparison with NULL is not true.
    `=`/`!=` between different JSON kinds are false/true (`1 = '1'` is false; true is
    not 1); `<` etc. compare numbers with numbers and strings with strings only.
    Anything else raises ConfigError naming the line and column.
    """
    return _WhereCompiler(clause, key).compile()


# --------------------------------------------------------------------------- filters

SUBJECT_FIELD = "_subject"
MAX_FILTER_CHARS = 4096
_SELECT_ARGS = frozenset({"expressions", "where", "kind"})
_POSITION = re.compile(r"at line (\d+), column (\d+)")
_PREFIX = re.compile(r"^filter: ")
_CLAUSE_WORDS = {"order": "ORDER BY", "group": "GROUP BY", "from_": "FROM", "joins": "JOIN"}

Path = tuple[str, ...]


class FilterError(TierflowError, ValueError):
    """A filter that cannot be compiled: `reason` in words, `line`/`column` (1-based) where."""

    def __init__(self, reason: str, line: int = 1, column: int = 1) -> None:
        self.reason = reason
        self.line = line
        self.column = column
        super().__init__(reason)

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "line": self.line, "column": self.column}


@dataclass(frozen=True, eq=False)
class Filter:
    """A compiled filter; immutable and shared by every subscription with the same text.

    `where(data)` and `project(data)` read `_subject` from the dict like any field; use
    `matches` / `select` to get it from the message subject without copying the event
    unless the query names `_subject`.
    """

    text: str
    where: Callable[[Data], bool]
    project: Callable[[Data], Any]
    uses_subject: bool = False
    match_all: bool = True
    select_all: bool = True

    def _view(self, data: Any, subject: str) -> Data:
        """The event as an object (a non-object payload has no fields), `_subject` added
        only when the query names it."""
        base = data if isinstance(data, dict) else {}
        return {**base, SUBJECT_FIELD: subject} if self.uses_subject else base

    def matches(self, data: Any, subject: str = "") -> bool:
        if self.match_all:
            return True
        return self.where(self._view(data, subject))

    def select(self, data: Any, subject: str = "") -> Any:
        if self.select_all:
            return data
        return self.project(self._view(data, subject))


def _where_all(data: Data) -> bool:
    return True


def _identity(data: Any) -> Any:
    return data


MATCH_ALL = Filter("", _where_all, _identity)


def _offset(text: str, line: int, column: int) -> int:
    """The offset of 1-based (line, column) in `text`."""
    start = 0
    for _ in range(line - 1):
        nl = text.find("\n", start)
        if nl < 0:
            break
        start = nl + 1
    return start + max(0, column - 1)


def _tokens(text: str) -> list[Any]:
    try:
        return list(sqlglot.tokenize(text))
    except TokenError as err:
        raise _token_error(text, err) from None


def _token_error(text: str, err: Exception) -> FilterError:
    quote = _unterminated_quote(text)
    if quote is not None:
        line, col = _line_col(text, quote)
        return FilterError(f"unterminated quote at line {line}, column {col}", line, col)
    return FilterError(f"cannot read the query: {err}")


def _error_at(text: str, offset: int, why: str) -> FilterError:
    line, col = _line_col(text, offset)
    return FilterError(f"{why} at line {line}, column {col}", line, col)


def _parse(sql: str) -> tuple[exp.Select, int | None]:
    """The query as a Select, and the offset where its WHERE condition starts (or None)."""
    tokens = _tokens(sql)
    if not tokens:
        return exp.Select(expressions=[exp.Star()]), None
    first = tokens[0].token_type.name
    if first not in ("SELECT", "WHERE"):
        return exp.Select(expressions=[exp.Star()]), 0  # a bare condition
    if first == "WHERE":
        tree = exp.Select(expressions=[exp.Star()])
        return tree, tokens[0].end + 1
    try:
        tree = sqlglot.parse_one(sql)
    except ParseError as err:
        info = err.errors[0] if err.errors else {}
        line, col = int(info.get("line") or 1), int(info.get("col") or 1)
        what = _SQLGLOT_CLASS.sub(r"\1", info.get("description") or str(err))
        raise FilterError(f"cannot parse at line {line}, column {col}: {what}", line, col) from None
    except SqlglotError as err:
        raise FilterError(f"cannot parse: {err}") from None
    if not isinstance(tree, exp.Select):
        raise _error_at(sql, 0, "expected SELECT ... WHERE ...")
    for key, value in tree.args.items():
        if key not in _SELECT_ARGS and value:
            word = _CLAUSE_WORDS.get(key, key.rstrip("_").upper())
            first = word.split()[0]
            tok = next((t for t in tokens if t.token_type.name.startswith(first)), None)
            node = value if isinstance(value, exp.Expression) else None
            offset = tok.start if tok else (_node_offset(node) if node is not None else 0)
            raise _error_at(sql, offset, f"{word} is not supported in a filter")
    if tree.args.get("kind"):
        raise _error_at(sql, 0, f"SELECT {tree.args['kind']} is not supported in a filter")
    where = tree.args.get("where")
    if where is None:
        return tree, None
    where_tok = next((t for t in tokens if t.token_type.name == "WHERE"), None)
    if where_tok is None:  # pragma: no cover - sqlglot found a WHERE, so a token exists
        raise _error_at(sql, 0, "cannot find WHERE")
    return tree, where_tok.end + 1


def _compile_condition(sql: str, start: int) -> tuple[Callable[[Data], bool], bool]:
    """compile_where over the condition text, with its error positions moved into `sql`."""
    clause = sql[start:]
    if not clause.strip():
        raise _error_at(sql, len(sql.rstrip()), "WHERE needs a condition")
    try:
        test = compile_where(clause, key="filter")
    except ConfigError as err:
        text = _PREFIX.sub("", str(err))
        m = _POSITION.search(text)
        if m is None:
            line, col = _line_col(sql, len(sql))
            raise FilterError(text.replace(repr(clause), repr(sql)), line, col) from None
        offset = start + _offset(clause, int(m.group(1)), int(m.group(2)))
        line, col = _line_col(sql, offset)
        text = text[: m.start()] + f"at line {line}, column {col}" + text[m.end() :]
        raise FilterError(text.replace(repr(clause), repr(sql)), line, col) from None
    uses_subject = any(
        isinstance(node, exp.Identifier) and node.name == SUBJECT_FIELD
        for node in _safe_parse(clause).walk()
    )
    return test, uses_subject


def _safe_parse(clause: str) -> exp.Expression:
    return sqlglot.parse_one(clause)  # compile_where has already parsed it successfully


def _path(sql: str, node: exp.Expression) -> Path:
    if isinstance(node, exp.Dot):
        if not isinstance(node.expression, exp.Identifier):
            raise _error_at(sql, _node_offset(node), "expected a field path")
        return (*_path(sql, node.this), node.expression.name)
    if isinstance(node, exp.Column):
        parts = node.parts
        if parts and all(isinstance(p, exp.Identifier) for p in parts):
            return tuple(p.name for p in parts)
    kind = type(node).__name__.upper()
    why = "functions are not supported" if isinstance(node, exp.Func) else f"unsupported {kind}"
    raise _error_at(sql, _node_offset(node), f"{why} in SELECT (expected field paths, AS, *)")


def _put(out: dict[str, Any], path: Path, value: Any) -> None:
    """Set `value` at `path`, copying any dict on the way (it may be the event's own)."""
    node = out
    for key in path[:-1]:
        child = node.get(key)
        child = dict(child) if isinstance(child, dict) else {}
        node[key] = child
        node = child
    node[path[-1]] = value


def _compile_projection(sql: str, tree: exp.Select) -> tuple[Callable[[Data], Any], bool, bool]:
    """(project, select_all, uses_subject)."""
    star = False
    fields: list[tuple[Path, Path]] = []  # (source path, output path)
    for node in tree.expressions:
        if isinstance(node, exp.Star):
            star = True
            continue
        if isinstance(node, exp.Column) and isinstance(node.this, exp.Star):
            raise _error_at(sql, _node_offset(node), "a.* is not supported; use * or a.b")
        alias: Path | None = None
        if isinstance(node, exp.Alias):
            alias = (node.alias,)
            node = node.this
        source = _path(sql, node)
        fields.append((source, alias or source))
    outputs = [o for _, o in fields]
    for i, a in enumerate(outputs):
        for b in outputs[i + 1 :]:
            short, long_ = (a, b) if len(a) <= len(b) else (b, a)
            if long_[: len(short)] == short:
                node = tree.expressions[i]
                raise _error_at(
                    sql,
                    _node_offset(node),
                    f"SELECT names {'.'.join(short)!r} and {'.'.join(long_)!r}, which overlap",
                )
    uses_subject = any(src == (SUBJECT_FIELD,) for src, _ in fields)
    if star and not fields:
        return _identity, True, False
    reads = tuple((getter(source), target) for source, target in fields)

    def project(data: Data) -> Any:
        view = data if isinstance(data, dict) else {}  # a non-object payload has no fields
        out: dict[str, Any] = {}
        if star:
            out.update((k, v) for k, v in view.items() if k != SUBJECT_FIELD)
        for get, target in reads:
            _put(out, target, get(view))
        return out

    return project, False, uses_subject


@functools.lru_cache(maxsize=512)
def compile_filter(sql: str) -> Filter:
    """Compile a filter query (see the module doc); raises FilterError with line/column.

    Cached by text: many subscriptions with the same query share one Filter, so the
    gateway evaluates each (event, distinct filter) once.
    """
    if not isinstance(sql, str):
        raise FilterError(f"a filter is a string, got {type(sql).__name__}")
    if len(sql) > MAX_FILTER_CHARS:
        raise FilterError(f"filter is {len(sql)} characters; at most {MAX_FILTER_CHARS}")
    if not sql.strip():
        return MATCH_ALL
    try:
        tree, where_start = _parse(sql)
        project, select_all, subject_in_select = _compile_projection(sql, tree)
        where, subject_in_where, match_all = _where_all, False, True
        if where_start is not None:
            where, subject_in_where = _compile_condition(sql, where_start)
            match_all = False
    except RecursionError:  # ~55+ nested parentheses or ~150 NOTs: the parser's limit
        raise FilterError("filter is nested too deeply") from None
    return Filter(
        text=sql,
        where=where,
        project=project,
        uses_subject=subject_in_where or subject_in_select,
        match_all=match_all,
        select_all=select_all,
    )


def compile_named(named: Mapping[str, str]) -> dict[str, Filter]:
    """Static named filters (from config), compiled up front; an error names the filter."""
    out: dict[str, Filter] = {}
    for name, sql in named.items():
        try:
            out[name] = compile_filter(sql)
        except FilterError as err:
            raise FilterError(
                f"named filter {name!r}: {err.reason}", err.line, err.column
            ) from None
    return out
