"""Sketches against exact answers (hypothesis), their merges, and the Spark glue.

Statistical properties (HLL within 3 sigma, count-min within eps*N for 1-delta of items,
reservoir uniformity) use `derandomize=True` or fixed seeds: the examples are fixed, so
a pass is reproducible rather than a 99.7% coin that flakes once in a few hundred runs.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import sketches as sk
from jobs.sketches import Distinct, Frequency, Membership, Reservoir, TopN
from tests.support import run_stream, write_batches

# Skewed streams over a small alphabet: a few heavy hitters and a long tail.
ALPHABET = [f"t{i}" for i in range(40)]
items = st.lists(st.one_of(st.sampled_from(ALPHABET[:3]), st.sampled_from(ALPHABET)), max_size=400)
weighted = st.lists(st.tuples(st.sampled_from(ALPHABET), st.integers(0, 50)), max_size=200)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def build(cls: type, stream: list[str], **params: object) -> object:
    s = cls(**params)
    for x in stream:
        s.update(x)
    return s


# --------------------------------------------------------------------------- TopN


def assert_space_saving(s: TopN, truth: Counter[str]) -> None:
    rows = s.top(None)
    for r in rows:
        assert r["count"] - r["error"] <= truth[r["item"]] <= r["count"], r
        assert r["error"] <= s.max_error()
    for item in set(truth) | set(ALPHABET):
        lo, hi = s.bounds(item)
        assert lo <= truth[item] <= hi
    listed = {r["item"] for r in rows}
    for item, c in truth.items():  # no heavy hitter above the error is missed
        if c > s.max_error():
            assert item in listed
    assert [r["count"] for r in rows] == sorted((r["count"] for r in rows), reverse=True)


@pytest.mark.unit
@FAST
@given(items, st.sampled_from([1, 4, 8, 24]))
def test_topn_space_saving_bounds(stream: list[str], capacity: int) -> None:
    s = build(TopN, stream, capacity=capacity)
    assert s.total == len(stream)
    assert_space_saving(s, Counter(stream))
    assert s.max_error() <= 3.5 * len(stream) / (s.capacity / 0.75) + 1


@pytest.mark.unit
@FAST
@given(weighted)
def test_topn_weighted_bounds(stream: list[tuple[str, int]]) -> None:
    s, truth = TopN(capacity=6), Counter[str]()
    for x, w in stream:
        s.update(x, w)
        truth[x] += w
    assert s.total == sum(truth.values())
    assert_space_saving(s, truth)


@pytest.mark.unit
def test_topn_book_output_shape_and_exact_when_it_fits() -> None:
    s = build(TopN, ["a"] * 5 + ["b"] * 3 + ["c"], capacity=100)
    assert s.top(2) == [
        {"item": "a", "count": 5, "error": 0},
        {"item": "b", "count": 3, "error": 0},
    ]
    assert s.capacity >= 100


@pytest.mark.unit
@FAST
@given(items, items, st.sampled_from([4, 16]))
def test_topn_merge_keeps_bounds_of_the_union(a: list[str], b: list[str], cap: int) -> None:
    merged = build(TopN, a, capacity=cap).merge(build(TopN, b, capacity=cap))
    assert merged.total == len(a) + len(b)
    assert_space_saving(merged, Counter(a + b))


@pytest.mark.unit
@FAST
@given(items, items)
def test_topn_merge_equals_sketch_of_union_when_nothing_is_purged(a: list[str], b: list[str]):
    merged = build(TopN, a, capacity=64).merge(build(TopN, b, capacity=64))
    assert merged.top(None) == build(TopN, a + b, capacity=64).top(None)


@pytest.mark.unit
@FAST
@given(items)
def test_topn_roundtrip(stream: list[str]) -> None:
    s = build(TopN, stream, capacity=8)
    back = TopN.from_bytes(s.to_bytes())
    assert back.top(None) == s.top(None) and back.capacity == s.capacity
    assert back.total == s.total


# --------------------------------------------------------------------------- Distinct


def hll8_registers(s: Distinct) -> bytes:
    """The 2**lg_k registers of an HLL_8 sketch in HLL mode (DataSketches layout)."""
    blob = s._s.serialize_updatable()
    assert blob[7] & 3 == 2, "sketch not in HLL mode"
    return bytes(blob[40 : 40 + 2**s.lg_k])


STAT = settings(max_examples=12, deadline=None, derandomize=True)


@pytest.mark.unit
@STAT
@given(st.integers(0, 30_000), st.sampled_from([8, 10, 12]), st.integers(0, 10**9))
def test_distinct_within_three_sigma(n: int, lg_k: int, offset: int) -> None:
    s = Distinct(lg_k)
    for i in range(n):
        s.update(f"u{offset + i}")
        if i % 3 == 0:
            s.update(f"u{offset + i}")  # repeats change nothing
    lo, hi = s.bounds(3)
    assert lo <= n <= hi
    assert abs(s.estimate() - n) <= s.relative_error(3) * max(n, 1) + 1e-9


@pytest.mark.unit
@STAT
@given(st.integers(200, 8000), st.integers(200, 8000), st.integers(0, 8000))
def test_distinct_merge_equals_sketch_of_union(na: int, nb: int, start_b: int) -> None:
    a_items = [f"x{i}" for i in range(na)]
    b_items = [f"x{i}" for i in range(start_b, start_b + nb)]
    a, b = build(Distinct, a_items, lg_k=8), build(Distinct, b_items, lg_k=8)
    union = build(Distinct, a_items + b_items, lg_k=8)
    ab = Distinct.from_bytes(a.to_bytes()).merge(b)
    ba = Distinct.from_bytes(b.to_bytes()).merge(a)
    assert hll8_registers(ab) == hll8_registers(union) == hll8_registers(ba)
    assert ab.estimate() == ba.estimate()
    true = len(set(a_items) | set(b_items))
    assert abs(ab.estimate() - true) <= ab.relative_error(3) * true


@pytest.mark.unit
def test_distinct_small_is_exact_and_roundtrips() -> None:
    s = build(Distinct, ["a", "b", "a", "c"], lg_k=12)
    assert round(s.estimate()) == 3
    assert Distinct.from_bytes(s.to_bytes()).estimate() == s.estimate()


# --------------------------------------------------------------------------- Frequency


@pytest.mark.unit
@FAST
@given(weighted)
def test_count_min_never_undercounts(stream: list[tuple[str, int]]) -> None:
    s, truth = Frequency(eps=0.05, delta=0.1), Counter[str]()
    for x, w in stream:
        s.update(x, w)
        truth[x] += w
    for item in ALPHABET:
        assert s.bounds(item)[1] == s.estimate(item) >= truth[item]


@pytest.mark.unit
@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.integers(0, 10**6), st.sampled_from([(0.01, 0.05), (0.002, 0.01)]))
def test_count_min_within_eps_n_for_most_items(seed: int, params: tuple[float, float]) -> None:
    import random

    eps, delta = params
    rng = random.Random(seed)
    stream = [f"i{int(rng.paretovariate(1.1))}" for _ in range(20_000)]
    s = build(Frequency, stream, eps=eps, delta=delta)
    truth = Counter(stream)
    assert s.eps <= eps and s.delta <= delta
    over = [x for x, c in truth.items() if s.estimate(x) - c > s.eps * len(stream)]
    assert over == [x for x, c in truth.items() if s.bounds(x)[0] > c]
    m = len(truth)
    # Per item P(over) <= delta; allow 3 binomial standard deviations above delta * m.
    assert len(over) <= delta * m + 3 * math.sqrt(delta * m) + 1


@pytest.mark.unit
@FAST
@given(weighted, weighted)
def test_count_min_merge_is_exactly_the_sketch_of_union(a: list, b: list) -> None:
    def cm(stream: list[tuple[str, int]]) -> Frequency:
        s = Frequency(eps=0.05, delta=0.1)
        for x, w in stream:
            s.update(x, w)
        return s

    merged = Frequency.from_bytes(cm(a).to_bytes()).merge(cm(b))
    assert merged.to_bytes() == cm(a + b).to_bytes()


@pytest.mark.unit
def test_count_min_rejects_negative_weights() -> None:
    with pytest.raises(ValueError):
        Frequency().update("a", -1)


# --------------------------------------------------------------------------- Membership


@pytest.mark.unit
@FAST
@given(st.lists(st.text(max_size=12), max_size=300), st.sampled_from([10, 100, 1000]))
def test_bloom_has_no_false_negatives(stream: list[str], capacity: int) -> None:
    s = build(Membership, stream, capacity=capacity, fpp=0.01)
    assert all(s.might_contain(x) for x in stream)
    assert all(x in Membership.from_bytes(s.to_bytes()) for x in stream)


@pytest.mark.unit
@FAST
@given(st.lists(st.text(max_size=8), max_size=100), st.lists(st.text(max_size=8), max_size=100))
def test_bloom_merge_equals_filter_of_union(a: list[str], b: list[str]) -> None:
    merged = build(Membership, a, capacity=200).merge(build(Membership, b, capacity=200))
    assert merged.to_bytes() == build(Membership, a + b, capacity=200).to_bytes()


@pytest.mark.unit
def test_bloom_false_positive_rate_near_fpp() -> None:
    s = build(Membership, [f"in{i}" for i in range(2000)], capacity=2000, fpp=0.01)
    fp = sum(s.might_contain(f"out{i}") for i in range(20_000)) / 20_000
    assert fp < 0.02  # hashing is deterministic, so this is a fixed measurement
    with pytest.raises(ValueError):
        s.merge(Membership(capacity=10))


# --------------------------------------------------------------------------- Reservoir


@pytest.mark.unit
@FAST
@given(st.lists(st.sampled_from(ALPHABET), max_size=300), st.integers(1, 20), st.integers(0, 99))
def test_reservoir_size_and_items_from_stream(stream: list[str], k: int, seed: int) -> None:
    s = build(Reservoir, stream, k=k, seed=seed)
    sample = s.sample()
    assert len(sample) == min(k, len(stream)) and s.n == len(stream)
    assert not Counter(sample) - Counter(stream)  # a sub-multiset of the stream
    # Deterministic, and state round-trips mid-stream.
    half = build(Reservoir, stream[: len(stream) // 2], k=k, seed=seed)
    resumed = Reservoir.from_bytes(half.to_bytes())
    for x in stream[len(stream) // 2 :]:
        resumed.update(x)
    assert resumed.sample() == sample


@pytest.mark.unit
@FAST
@given(
    st.lists(st.sampled_from(ALPHABET), max_size=100),
    st.lists(st.sampled_from(ALPHABET), max_size=100),
    st.integers(1, 12),
)
def test_reservoir_merge_size_and_origin(a: list[str], b: list[str], k: int) -> None:
    merged = build(Reservoir, a, k=k, seed=1).merge(build(Reservoir, b, k=k, seed=2))
    assert merged.n == len(a) + len(b)
    assert len(merged.sample()) == min(k, len(a) + len(b))
    assert not Counter(merged.sample()) - Counter(a + b)


def chi2_ok(counts: list[int], trials: int, p: float) -> bool:
    """Pearson chi-square under 'each item kept with probability p' at about 1e-4 level."""
    exp = trials * p
    chi2 = sum((c - exp) ** 2 / exp for c in counts)
    dof = len(counts) - 1
    return chi2 < dof + 6 * math.sqrt(2 * dof)


@pytest.mark.unit
def test_reservoir_is_uniform_and_so_is_its_merge() -> None:
    trials, k = 1500, 5
    direct, merged = [0] * 40, [0] * 40
    for seed in range(trials):
        for x in build(Reservoir, [str(i) for i in range(40)], k=k, seed=seed).sample():
            direct[int(x)] += 1
        a = build(Reservoir, [str(i) for i in range(10)], k=k, seed=seed)
        b = build(Reservoir, [str(i) for i in range(10, 40)], k=k, seed=seed + trials)
        for x in a.merge(b).sample():
            merged[int(x)] += 1
    assert chi2_ok(direct, trials, k / 40)
    assert chi2_ok(merged, trials, k / 40)


# --------------------------------------------------------------------------- by kind


PARAMS = {
    "topn": {"capacity": 8},
    "distinct": {"lg_k": 10},
    "frequency": {"eps": 0.05, "delta": 0.1},
    "membership": {"capacity": 100},
    "reservoir": {"k": 5, "seed": 3},
}


@pytest.mark.unit
@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_merge_bytes_and_update_bytes(kind: str) -> None:
    parts = [["a", "b", "a"], ["c"], ["a", "d", "e", "f"]]
    blobs = [sk.update_bytes(kind, None, p, **PARAMS[kind]) for p in parts]
    expected = sk.load(kind, blobs[0])  # merge_bytes folds left from the first sketch
    for blob in blobs[1:]:
        expected.merge(sk.load(kind, blob))
    assert sk.merge_bytes(kind, [None, *blobs]) == expected.to_bytes()
    assert sk.merge_bytes(kind, []) is None
    grown = sk.update_bytes(kind, blobs[0], ["z"])
    assert sk.load(kind, grown).to_bytes() != blobs[0]
    with pytest.raises(ValueError):
        sk.new_sketch("nope")


# --------------------------------------------------------------------------- Spark glue


@pytest.fixture(scope="module")
def topics(spark: object) -> tuple[object, list[tuple[str, str]]]:
    rows = [(f"k{i % 3}", f"t{(i * i) % 17}") for i in range(600)]
    return spark.createDataFrame(rows, "key string, topic string").repartition(4), rows


def test_spark_topn_and_count_min_per_partition_merge_to_the_exact_answer(topics) -> None:
    df, rows = topics
    truth = Counter(t for _, t in rows)
    top = TopN.from_bytes(sk.topn_agg(df, "topic", capacity=64))
    assert top.top(None) == [
        {"item": t, "count": c, "error": 0}
        for t, c in sorted(truth.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    small = TopN.from_bytes(sk.topn_agg(df, "topic", capacity=4))
    assert_space_saving(small, truth)
    cm = sk.sketch_column(df, "topic", "frequency", eps=0.01, delta=0.01)
    assert cm == build(Frequency, [t for _, t in rows], eps=0.01, delta=0.01).to_bytes()
    bloom = sk.sketch_column(df, "topic", "membership", capacity=100)
    assert bloom == build(Membership, [t for _, t in rows], capacity=100).to_bytes()
    res = Reservoir.from_bytes(sk.sketch_column(df, "topic", "reservoir", k=7))
    assert res.n == 600 and len(res.sample()) == 7 and set(res.sample()) <= set(truth)


def test_spark_hll_sketch_agg_is_byte_compatible_with_distinct(spark) -> None:
    ids = [f"user-{i}" for i in range(3000)]
    df = spark.createDataFrame([(i,) for i in ids], "u string").repartition(3)
    from_spark = Distinct.from_bytes(sk.distinct_agg(df, "u", lg_k=10))
    local = build(Distinct, ids, lg_k=10)
    assert hll8_registers(from_spark) == hll8_registers(local)  # same hashing, same registers
    assert abs(from_spark.estimate() - 3000) <= from_spark.relative_error(3) * 3000


def test_spark_sketch_by_key(topics) -> None:
    df, rows = topics
    got = {
        r.key: TopN.from_bytes(r.sketch)
        for r in sk.sketch_by_key(df, "key", "topic", "topn", capacity=64).collect()
    }
    assert sorted(got) == ["k0", "k1", "k2"]
    for key, s in got.items():
        truth = Counter(t for k, t in rows if k == key)
        assert {r["item"]: r["count"] for r in s.top(None)} == dict(truth)


def test_spark_keyed_sketch_state_accumulates_across_micro_batches(spark, tmp_path) -> None:
    batches = [
        [{"k": "a", "v": "x"}, {"k": "a", "v": "y"}, {"k": "b", "v": "x"}],
        [{"k": "a", "v": "x"}],
        [{"k": "b", "v": "z"}, {"k": "a", "v": "x"}],
    ]
    src = write_batches(tmp_path / "src", batches)
    stream = spark.readStream.schema("k string, v string").option("maxFilesPerTrigger", 1).json(src)
    out = sk.keyed_sketch_state(stream, "k", "v", "frequency", eps=0.01, delta=0.01)
    emitted, _ = run_stream(out, tmp_path / "ck", "update")
    assert len(emitted) == 3  # every data batch changed some key
    last = {}
    for _batch, rows in emitted:
        for r in rows:
            last[r.k] = (r.sketch, r.n)
    for key in ("a", "b"):
        values = [e["v"] for b in batches for e in b if e["k"] == key]
        assert last[key] == (build(Frequency, values, eps=0.01, delta=0.01).to_bytes(), len(values))


@pytest.mark.unit
@pytest.mark.parametrize("into", [[], ["z"], list("hijklmn")])
def test_topn_merge_of_a_sketch_whose_purges_left_nothing_keeps_its_weight(into: list[str]) -> None:
    """DataSketches skips merging (and serialises as empty) a sketch with no tracked item
    left; TopN carries such a sketch's weight and offset itself."""
    hollow = build(TopN, list("abcdefg"), capacity=4)  # 7 singletons in a 6-counter map
    assert hollow.total == 7 and hollow.top(None) == []
    back = TopN.from_bytes(hollow.to_bytes())
    assert back.total == 7 and back.max_error() == hollow.max_error() >= 1
    merged = build(TopN, into, capacity=4).merge(back)
    assert merged.total == 7 + len(into)
    assert_space_saving(merged, Counter(into + list("abcdefg")))
