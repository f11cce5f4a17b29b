"""Mergeable stream summaries (book ch. 5 and ch. 9) with one shape, and their Spark glue.

Every summary has `update`, `merge` (in place, returns self), `to_bytes`/`from_bytes` (how
it lives in a Spark binary state column and crosses partitions) and its query:

=============  ==========================  ============================================
class          built on                    query
=============  ==========================  ============================================
`TopN`         datasketches frequent        `top(n) -> [{"item", "count", "error"}]`,
               strings (Space-Saving        `bounds(item)`
               equivalent, see class doc)
`Distinct`     datasketches HLL (HLL_8);    `estimate()`, `bounds(num_std)`
               Spark's `hll_sketch_agg`
               writes the same bytes
`Frequency`    datasketches count-min       `estimate(item)`, `bounds(item)`
`Membership`   hand-written Bloom filter    `might_contain(item)`
               (datasketches' Python
               binding has none)
`Reservoir`    hand-written algorithm R     `sample()`
               (datasketches has no
               seedable uniform reservoir)
=============  ==========================  ============================================

Items are strings throughout: tierflow keys (topic names, ids) are strings, and one item
type keeps every sketch's hashing the same in Python and in Spark (cast numbers first).

Spark code paths: distinct counts use Spark's own JVM `hll_sketch_agg` / `hll_union_agg`
(no Python worker; the binary is the DataSketches HLL format `Distinct.from_bytes` reads,
strings hash identically). Spark's `count_min_sketch` aggregate is not used: its binary is
Spark's own format with no Python reader. Everything else is built per partition or per
group in pandas workers and merged with `merge_bytes`.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import datasketches as ds
import msgspec

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.state import GroupState


class Sketch(Protocol):
    kind: ClassVar[str]

    def update(self, item: str, weight: int = 1) -> None: ...
    def merge(self, other: Self) -> Self: ...
    def to_bytes(self) -> bytes: ...
    @classmethod
    def from_bytes(cls, blob: bytes) -> Self: ...


def _check_weight(weight: int | float) -> None:
    if weight < 0:
        raise ValueError(f"weights must be >= 0 (the bounds assume it), got {weight}")


# --------------------------------------------------------------------------- top-N


_PROBE = "\x00tierflow-probe\x00"  # an item never seen: its bounds give the offset


class TopN:
    """Heavy hitters with Space-Saving's contract: `count - error <= true <= count`.

    Built on DataSketches' frequent-items sketch (Anderson et al. 2017), the Misra-Gries
    family member that is isomorphic to Space-Saving (Metwally et al.) but purges in
    batches. Per tracked item it keeps a lower bound `lb` (its counter) and an upper bound
    `ub = lb + offset`, the offset being the weight purged so far. The book's output maps
    as `count = ub` (= datasketches' `get_estimate`) and `error = ub - lb`, so
    `count - error = lb <= true <= ub = count`. Any item whose true count exceeds
    `max_error()` (<= 3.5 * N / map size) is tracked, so `top()` misses no such item.

    `capacity` is how many counters the summary keeps (at least the number asked for: the
    map size is the next power of two with 0.75 * size >= capacity, at least 8).
    """

    kind: ClassVar[str] = "topn"

    # DataSketches treats a sketch whose purges left no tracked item as empty: `merge`
    # skips it and `serialize` drops its weight and offset. What such a sketch held is kept
    # beside it (weight, offset) and travels in the bytes behind this marker.
    _CARRY = b"tfTN1"

    def __init__(self, capacity: int = 1024, *, _sketch: Any = None) -> None:
        if _sketch is None:
            if capacity < 1:
                raise ValueError("capacity must be >= 1")
            lg = max(3, math.ceil(math.log2(capacity / 0.75)))
            _sketch = ds.frequent_strings_sketch(lg)
        self._s = _sketch
        self._carried_weight = 0
        self._carried_offset = 0

    def _sketch_offset(self) -> int:
        lb, ub = self._s.get_lower_bound(_PROBE), self._s.get_upper_bound(_PROBE)
        return int(ub - lb)

    def _carry_if_hollow(self) -> None:
        """Move a hollow sketch's weight and offset beside it (see `_CARRY`)."""
        if self._s.num_active_items == 0 and self._s.total_weight > 0:
            self._carried_weight += int(self._s.total_weight)
            self._carried_offset += self._sketch_offset()
            self._s = ds.frequent_strings_sketch(self._lg_max_map_size())

    @property
    def capacity(self) -> int:
        return int(0.75 * 2 ** self._lg_max_map_size())

    def _lg_max_map_size(self) -> int:
        return self._s.serialize()[3]  # preamble byte 3 of the DataSketches format

    @property
    def total(self) -> int:
        """Sum of all weights seen (N)."""
        return int(self._s.total_weight) + self._carried_weight

    def update(self, item: str, weight: int = 1) -> None:
        _check_weight(weight)
        if weight:
            self._s.update(item, int(weight))
            self._carry_if_hollow()

    def merge(self, other: TopN) -> TopN:
        other._carry_if_hollow()
        self._s.merge(other._s)
        self._carried_weight += other._carried_weight
        self._carried_offset += other._carried_offset
        self._carry_if_hollow()
        return self

    def max_error(self) -> int:
        """The sketch's offset: every item's error, and the upper bound of untracked items."""
        return self._sketch_offset() + self._carried_offset

    def bounds(self, item: str) -> tuple[int, int]:
        """(lower, upper) with lower <= true count <= upper, for tracked or untracked items."""
        lb, ub = self._s.get_lower_bound(item), self._s.get_upper_bound(item)
        return int(lb), int(ub) + self._carried_offset

    def top(self, n: int | None = 10) -> list[dict[str, Any]]:
        """The n items with the highest count, as the book's `[{"item","count","error"}]`.

        Ordered by count (desc), then error (asc), then item, so output is deterministic.
        """
        rows = self._s.get_frequent_items(ds.frequent_items_error_type.NO_FALSE_NEGATIVES, 0)
        extra = self._carried_offset
        out = [
            {"item": it, "count": int(ub) + extra, "error": int(ub - lb) + extra}
            for it, _e, lb, ub in rows
        ]
        out.sort(key=lambda r: (-r["count"], r["error"], r["item"]))
        return out if n is None else out[:n]

    def to_bytes(self) -> bytes:
        self._carry_if_hollow()
        blob = bytes(self._s.serialize())
        if not (self._carried_weight or self._carried_offset):
            return blob  # the plain DataSketches format: nothing carried
        head = struct.pack("<QQ", self._carried_weight, self._carried_offset)
        return self._CARRY + head + blob

    @classmethod
    def from_bytes(cls, blob: bytes) -> TopN:
        blob = bytes(blob)
        weight = offset = 0
        if blob.startswith(cls._CARRY):
            n = len(cls._CARRY)
            weight, offset = struct.unpack("<QQ", blob[n : n + 16])
            blob = blob[n + 16 :]
        out = cls(_sketch=ds.frequent_strings_sketch.deserialize(blob))
        out._carried_weight, out._carried_offset = weight, offset
        return out


# --------------------------------------------------------------------------- distinct


_HLL_PREAMBLE_INTS = 10  # DataSketches HLL preamble size in HLL mode (LIST 2, SET 3)
_OUT_OF_ORDER_FLAG = 16


class Distinct:
    """Distinct count with HyperLogLog (DataSketches HLL_8, byte-compatible with Spark).

    Relative standard error is about 1.04 / sqrt(2**lg_k) (lg_k=12: 1.6%, 4 KiB). Below
    about 2**lg_k / 4 distinct items the sketch is in list/set mode and exact.

    Merging is lossless (register-wise max) but a merged sketch estimates with the
    composite estimator, not HIP (HIP is not mergeable), so `merge(a, b).estimate()` can
    differ from the estimate of a sketch fed the union directly by a within-bound amount;
    their registers are identical. Merging different lg_k gives the smaller lg_k.
    """

    kind: ClassVar[str] = "distinct"

    def __init__(self, lg_k: int = 12, *, _sketch: Any = None) -> None:
        self._s = _sketch if _sketch is not None else ds.hll_sketch(lg_k, ds.tgt_hll_type.HLL_8)

    @property
    def lg_k(self) -> int:
        return int(self._s.lg_config_k)

    def update(self, item: str, weight: int = 1) -> None:
        """Add an item; weight is ignored (distinctness has no multiplicity)."""
        self._s.update(item)

    def merge(self, other: Distinct) -> Distinct:
        union = ds.hll_union(max(self.lg_k, other.lg_k))
        union.update(self._s)
        union.update(other._s)
        self._s = union.get_result(ds.tgt_hll_type.HLL_8)
        return self

    def estimate(self) -> float:
        return float(self._s.get_estimate())

    def bounds(self, num_std: int = 2) -> tuple[float, float]:
        """Confidence interval at 1, 2 or 3 standard deviations (68%, 95%, 99.7%)."""
        return float(self._s.get_lower_bound(num_std)), float(self._s.get_upper_bound(num_std))

    def relative_error(self, num_std: int = 2) -> float:
        """A priori relative error bound at num_std standard deviations for this lg_k."""
        return max(
            abs(ds.hll_sketch.get_rel_err(upper, False, self.lg_k, num_std))
            for upper in (True, False)
        )

    def to_bytes(self) -> bytes:
        return bytes(self._s.serialize_compact())

    @classmethod
    def from_bytes(cls, blob: bytes) -> Distinct:
        return cls(_sketch=ds.hll_sketch.deserialize(bytes(blob)))

    def order_free(self) -> Distinct:
        """The same registers, estimated by the composite estimator: a function of the
        registers alone, so the same whatever order the items or partial sketches came in.
        A sketch only ever updated estimates by HIP, which depends on that order and is
        lost on merging, so a view merged from two sketches and one counted in one pass
        would differ by a few tenths of a percent. The Python binding has no switch for
        it: the serialized form's out-of-order flag (preamble byte 5, bit 4, HLL mode
        only) is the documented one the estimators read."""
        blob = bytearray(self._s.serialize_compact())
        if blob[0] == _HLL_PREAMBLE_INTS:
            blob[5] |= _OUT_OF_ORDER_FLAG
        return Distinct(_sketch=ds.hll_sketch.deserialize(bytes(blob)))


# --------------------------------------------------------------------------- frequency


class Frequency:
    """Point frequencies with a count-min sketch (DataSketches; merge adds counters).

    With non-negative weights the estimate never undercounts, and with probability at
    least 1 - delta it overcounts by at most eps * N (N = total weight). `eps` and `delta`
    report the sketch's actual values (buckets = ceil(e / eps), rows = ceil(ln(1/delta))),
    which are at least as tight as asked. `bounds()` is (estimate - eps * N, estimate): the
    upper bound is certain, the lower one holds with probability 1 - delta.
    DataSketches' own get_lower/upper_bound place the interval above the estimate, which is
    for streams with negative weights; this wrapper rejects those instead.
    """

    kind: ClassVar[str] = "frequency"

    def __init__(self, eps: float = 0.001, delta: float = 0.01, *, _sketch: Any = None) -> None:
        if _sketch is None:
            if not (0 < eps < 1 and 0 < delta < 1):
                raise ValueError("eps and delta must be in (0, 1)")
            _sketch = ds.count_min_sketch(
                ds.count_min_sketch.suggest_num_hashes(1 - delta),
                ds.count_min_sketch.suggest_num_buckets(eps),
            )
        self._s = _sketch

    @property
    def eps(self) -> float:
        return float(self._s.get_relative_error())

    @property
    def delta(self) -> float:
        return math.exp(-self._s.num_hashes)

    @property
    def total(self) -> float:
        return float(self._s.total_weight)

    def update(self, item: str, weight: int | float = 1) -> None:
        _check_weight(weight)
        self._s.update(item, float(weight))

    def merge(self, other: Frequency) -> Frequency:
        self._s.merge(other._s)
        return self

    def estimate(self, item: str) -> float:
        """Never below the true count; above it by <= eps * N with probability 1 - delta."""
        return float(self._s.get_estimate(item))

    def bounds(self, item: str) -> tuple[float, float]:
        est = self.estimate(item)
        return max(0.0, est - self.eps * self.total), est

    def to_bytes(self) -> bytes:
        return bytes(self._s.serialize())

    @classmethod
    def from_bytes(cls, blob: bytes) -> Frequency:
        return cls(_sketch=ds.count_min_sketch.deserialize(bytes(blob)))


# --------------------------------------------------------------------------- membership


_BLOOM_MAGIC = b"TFBF\x01"
_BLOOM_HEADER = struct.Struct(">5sHQQ")  # magic+version, k, m bits, items added


class Membership:
    """Bloom filter: `might_contain` has no false negatives; false positives near `fpp`.

    Hand-written because the datasketches 5.2 Python binding has no Bloom filter and
    Spark's BloomFilter (spark-sketch) has no Python API. Sized for `capacity` items at
    false-positive probability `fpp` (m = -n ln p / ln^2 2 bits, k = m/n ln 2 hashes);
    past capacity the rate degrades but false negatives stay impossible. Indices use
    Kirsch-Mitzenmacher double hashing over BLAKE2b-128 of the UTF-8 item, so bit
    positions are stable across processes and versions (Python's hash() is salted).
    Merge is bitwise OR and needs filters of the same shape.
    """

    kind: ClassVar[str] = "membership"

    def __init__(self, capacity: int = 10_000, fpp: float = 0.01) -> None:
        if capacity < 1 or not 0 < fpp < 1:
            raise ValueError("capacity must be >= 1 and fpp in (0, 1)")
        m = max(8, math.ceil(-capacity * math.log(fpp) / math.log(2) ** 2))
        self.num_bits = m
        self.num_hashes = max(1, round(m / capacity * math.log(2)))
        self.count = 0
        self._bits = bytearray((m + 7) // 8)

    def _indices(self, item: str) -> Iterator[int]:
        d = hashlib.blake2b(item.encode(), digest_size=16).digest()
        h1, h2 = int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") | 1
        m = self.num_bits
        return ((h1 + i * h2) % m for i in range(self.num_hashes))

    def update(self, item: str, weight: int = 1) -> None:
        for i in self._indices(item):
            self._bits[i >> 3] |= 1 << (i & 7)
        self.count += 1

    def might_contain(self, item: str) -> bool:
        return all(self._bits[i >> 3] >> (i & 7) & 1 for i in self._indices(item))

    def __contains__(self, item: str) -> bool:
        return self.might_contain(item)

    def merge(self, other: Membership) -> Membership:
        if (self.num_bits, self.num_hashes) != (other.num_bits, other.num_hashes):
            raise ValueError("cannot merge Bloom filters of different sizes")
        self._bits = bytearray(a | b for a, b in zip(self._bits, other._bits, strict=True))
        self.count += other.count
        return self

    def to_bytes(self) -> bytes:
        head = _BLOOM_HEADER.pack(_BLOOM_MAGIC, self.num_hashes, self.num_bits, self.count)
        return head + bytes(self._bits)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Membership:
        blob = bytes(blob)
        magic, k, m, count = _BLOOM_HEADER.unpack_from(blob)
        if magic != _BLOOM_MAGIC:
            raise ValueError("not a tierflow Bloom filter")
        self = cls.__new__(cls)
        self.num_bits, self.num_hashes, self.count = m, k, count
        self._bits = bytearray(blob[_BLOOM_HEADER.size :])
        if len(self._bits) != (m + 7) // 8:
            raise ValueError("truncated Bloom filter")
        return self


# --------------------------------------------------------------------------- reservoir


class _ReservoirState(msgspec.Struct, array_like=True):
    version: int
    k: int
    seed: int
    n: int
    merges: int
    items: list[str]


class Reservoir:
    """Uniform sample of k items (Vitter's algorithm R), deterministic for a given seed.

    Hand-written because datasketches' Python binding offers only var_opt/EBPPS
    (weighted samplers whose union reweights items) whose RNG cannot be seeded: a replay
    after a crash would draw a different sample. Here item n's draw is a hash of
    (seed, n), so a replayed stream rebuilds the same sample and no RNG state needs
    storing. Merge draws how many of the k slots come from each side hypergeometrically
    (population sizes n_a, n_b) and a uniform subset of each side's sample, giving a
    uniform k-sample of the union. Two sides built with the same seed make correlated
    draws by stream position (marginals stay uniform); `sketch_partitions` therefore
    salts the seed with the partition id.
    """

    kind: ClassVar[str] = "reservoir"

    def __init__(self, k: int = 100, seed: int = 0) -> None:
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k, self.seed, self.n, self._merges = k, seed, 0, 0
        self._items: list[str] = []

    def _draw(self, n: int) -> int:
        """Uniform in [0, n) from (seed, n); bias below 2**-40 for n < 2**24."""
        d = hashlib.blake2b(f"{self.seed}:{n}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "little") % n

    def update(self, item: str, weight: int = 1) -> None:
        self.n += 1
        if len(self._items) < self.k:
            self._items.append(item)
            return
        j = self._draw(self.n)
        if j < self.k:
            self._items[j] = item

    def merge(self, other: Reservoir) -> Reservoir:
        k = min(self.k, other.k)
        total = self.n + other.n
        rng = random.Random(f"{self.seed}:{self.n}:{other.n}:{self._merges}")
        # Hypergeometric: how many of min(k, total) draws fall in our n.
        take, left_a, left = 0, self.n, total
        for _ in range(min(k, total)):
            if rng.random() * left < left_a:
                take += 1
                left_a -= 1
            left -= 1
        mine = rng.sample(self._items, take)
        theirs = rng.sample(other._items, min(k, total) - take)
        self._items = mine + theirs
        rng.shuffle(self._items)
        self.k, self.n, self._merges = k, total, self._merges + 1
        return self

    def sample(self) -> list[str]:
        return list(self._items)

    def to_bytes(self) -> bytes:
        state = _ReservoirState(1, self.k, self.seed, self.n, self._merges, self._items)
        return msgspec.msgpack.encode(state)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Reservoir:
        st = msgspec.msgpack.decode(bytes(blob), type=_ReservoirState)
        self = cls(st.k, st.seed)
        self.n, self._merges, self._items = st.n, st.merges, list(st.items)
        return self


# --------------------------------------------------------------------------- by kind

KINDS: dict[str, type[Any]] = {
    c.kind: c for c in (TopN, Distinct, Frequency, Membership, Reservoir)
}


def new_sketch(kind: str, **params: Any) -> Any:
    """An empty sketch of `kind` ("topn", "distinct", "frequency", "membership", "reservoir")."""
    try:
        return KINDS[kind](**params)
    except KeyError:
        raise ValueError(f"unknown sketch kind {kind!r}; one of {sorted(KINDS)}") from None


def load(kind: str, blob: bytes) -> Any:
    return KINDS[kind].from_bytes(blob)


def merge_bytes(kind: str, blobs: Iterable[bytes | None]) -> bytes | None:
    """Merge serialized sketches of one kind (Nones skipped); None when there are none."""
    acc = None
    for blob in blobs:
        if blob is None:
            continue
        s = load(kind, blob)
        acc = s if acc is None else acc.merge(s)
    return None if acc is None else acc.to_bytes()


def update_bytes(
    kind: str,
    blob: bytes | None,
    items: Iterable[str],
    weights: Iterable[int | float] | None = None,
    **params: Any,
) -> bytes:
    """One micro-batch step for state: load `blob` (or start from params), add items."""
    s = load(kind, blob) if blob is not None else new_sketch(kind, **params)
    if weights is None:
        for item in items:
            s.update(item)
    else:
        for item, w in zip(items, weights, strict=True):
            s.update(item, w)
    return s.to_bytes()


# --------------------------------------------------------------------------- Spark glue


def _partition_builder(
    kind: str, column: str, weight: str | None, params: dict[str, Any]
) -> Callable[[Iterator[pd.DataFrame]], Iterator[pd.DataFrame]]:
    def build(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas as pd
        from pyspark import TaskContext

        args = dict(params)
        if kind == "reservoir":  # independent draws per partition (see Reservoir.merge)
            ctx = TaskContext.get()
            args["seed"] = args.get("seed", 0) * 1_000_003 + (ctx.partitionId() if ctx else 0)
        blob = None
        for pdf in batches:
            pdf = pdf[pdf[column].notna()]
            w = None if weight is None else pdf[weight].tolist()
            blob = update_bytes(kind, blob, pdf[column].astype(str).tolist(), w, **args)
        if blob is not None:
            yield pd.DataFrame({"sketch": [blob]})

    return build


def sketch_partitions(
    df: DataFrame, column: str, kind: str, weight: str | None = None, **params: Any
) -> DataFrame:
    """One serialized sketch per non-empty partition, as a DataFrame with a `sketch` column."""
    return df.select(column, *([weight] if weight else [])).mapInPandas(
        _partition_builder(kind, column, weight, params), "sketch binary"
    )


def sketch_column(
    df: DataFrame, column: str, kind: str, weight: str | None = None, **params: Any
) -> bytes | None:
    """A whole (static) column summarised: per-partition sketches merged on the driver.

    `kind="distinct"` runs in the JVM with Spark's `hll_sketch_agg` (see `distinct_agg`).
    """
    if kind == "distinct":
        return distinct_agg(df, column, **params)
    blobs = [r.sketch for r in sketch_partitions(df, column, kind, weight, **params).collect()]
    return merge_bytes(kind, blobs) if blobs else new_sketch(kind, **params).to_bytes()


def topn_agg(df: DataFrame, column: str, capacity: int = 1024, weight: str | None = None) -> bytes:
    """A `TopN` sketch of a column; `TopN.from_bytes(...).top(10)` gives the book's output."""
    blob = sketch_column(df, column, "topn", weight, capacity=capacity)
    assert blob is not None
    return blob


def distinct_agg(df: DataFrame, column: str, lg_k: int = 12) -> bytes:
    """An HLL sketch of a column built by Spark's own `hll_sketch_agg` (JVM, HLL_8).

    The column is cast to string so the hashing matches `Distinct.update(str)`.
    """
    from pyspark.sql import functions as F

    row = df.agg(F.hll_sketch_agg(F.col(column).cast("string"), lg_k).alias("s")).first()
    if row is None or row.s is None:
        return Distinct(lg_k).to_bytes()
    return bytes(row.s)


def sketch_by_key(
    df: DataFrame, key: str, column: str, kind: str, weight: str | None = None, **params: Any
) -> DataFrame:
    """One sketch per key: `[key, sketch binary]`, via groupBy().applyInPandas.

    For `kind="distinct"` prefer `groupBy(key).agg(hll_sketch_agg(...))`, which stays in
    the JVM; this path exists for the kinds Spark has no aggregate for.
    """
    key_type = df.schema[key].dataType.simpleString()

    def build(pdf: pd.DataFrame) -> pd.DataFrame:
        import pandas as pd

        key_value = pdf[key].iloc[0]
        pdf = pdf[pdf[column].notna()]
        w = None if weight is None else pdf[weight].tolist()
        blob = update_bytes(kind, None, pdf[column].astype(str).tolist(), w, **params)
        return pd.DataFrame({key: [key_value], "sketch": [blob]})

    cols = [key, column, *([weight] if weight else [])]
    return df.select(*cols).groupBy(key).applyInPandas(build, f"{key} {key_type}, sketch binary")


def keyed_sketch_state(
    df: DataFrame, key: str, column: str, kind: str, weight: str | None = None, **params: Any
) -> DataFrame:
    """Streaming: a sketch per key kept in Spark state across micro-batches.

    Each micro-batch loads the key's sketch from state (a binary column), adds the batch's
    items, stores it back and emits `[key, sketch, n]` for every key that changed (use
    output mode "update"). State survives restarts through the query checkpoint. Keys
    never expire (NoTimeout): suited to bounded key sets such as topics or windows.
    """
    from pyspark.sql.streaming.state import GroupStateTimeout

    key_type = df.schema[key].dataType.simpleString()

    def step(
        key_value: tuple[Any, ...], pdfs: Iterator[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        import pandas as pd

        blob, n = (state.get[0], state.get[1]) if state.exists else (None, 0)
        for pdf in pdfs:
            pdf = pdf[pdf[column].notna()]
            w = None if weight is None else pdf[weight].tolist()
            blob = update_bytes(kind, blob, pdf[column].astype(str).tolist(), w, **params)
            n += len(pdf)
        if blob is None:
            return
        state.update((blob, n))
        yield pd.DataFrame({key: [key_value[0]], "sketch": [blob], "n": [n]})

    cols = [key, column, *([weight] if weight else [])]
    return (
        df.select(*cols)
        .groupBy(key)
        .applyInPandasWithState(
            step,
            f"{key} {key_type}, sketch binary, n long",
            "sketch binary, n long",
            "update",
            GroupStateTimeout.NoTimeout,
        )
    )
