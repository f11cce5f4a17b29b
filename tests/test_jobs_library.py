"""The job library (jobs/specs, paths, plans, running): specs and JSON paths (pure), then
each job kind on small data.

Spark tests use the shared session and a real nats-server: a few hundred known events are
published once, each job reads them with `availableNow` in several micro-batches
(`max_events_per_trigger`), so state carried across batches is exercised, and its KV results
are compared with a plain-Python recomputation over the same events.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.js.api import StreamConfig

from jobs.event_time import iso_ms
from jobs.jetstream import register
from jobs.paths import extract, json_schema
from jobs.plans import load_function
from jobs.running import checkpoint_run_id, start_deadletters, start_job
from jobs.sink import MSG_ID_HEADER, SOURCE_SEQ_HEADER
from jobs.sketch_state import pane_windows
from jobs.windows import late_count
from runtime.errors import ConfigError, JobError
from runtime.job_specs import JobSpec, WindowSpec, decode_spec, duration_ms, interval, parse_job
from runtime.json_paths import Step, parse_path
from runtime.nats.server import NatsEndpoint
from tests.oracles import sliding_reference
from tests.support import NatsFactory, kv_results, with_nats

pytestmark = pytest.mark.timeout(300)

STREAM = "lib"
T0 = 1_700_000_000_000  # ms, a multiple of every window used here
N_EVENTS = 240
TAGS = [f"t{i}" for i in range(30)]


def event(i: int) -> dict[str, Any]:
    """Event i: a user, 0-3 tags (skewed), a kind, a time 1 s apart, a response."""
    tags = [TAGS[(i * i + j) % (3 + i % 27)] for j in range(i % 4)]
    return {
        "user": {"id": i % 37, "name": f"u{i % 37}"},
        "tags": [{"name": t} for t in tags],
        "kind": "ab"[i % 2] if i % 5 else None,
        "t": T0 + i * 1000,
        "response": "yes" if i % 3 else "no",
    }


EVENTS = [event(i) for i in range(N_EVENTS)]


# --------------------------------------------------------------------------- pure


@pytest.mark.unit
def test_paths_walk_objects_and_explode_arrays() -> None:
    assert parse_path("group.group_topics[].topic_name") == (
        Step("group"),
        Step("group_topics", True),
        Step("topic_name"),
    )
    assert parse_path("$.a") == (Step("a"),)
    assert parse_path("_subject") == (Step("_subject"),)
    for bad in ("", "a..b", "a[0]", "a[]x", "$."):
        with pytest.raises(JobError, match="JSON path"):
            parse_path(bad)


@pytest.mark.unit
def test_schema_is_built_from_the_paths_and_conflicts_are_named() -> None:
    schema = json_schema(["a.b[].c", "a.d", "e[]", "_seq"])
    assert schema.simpleString() == (
        "struct<a:struct<b:array<struct<c:string>>,d:string>,e:array<string>>"
    )
    with pytest.raises(JobError, match="'a.b' and 'a.b.c' disagree"):
        json_schema(["a.b", "a.b.c"])
    with pytest.raises(JobError, match="disagree"):
        json_schema(["a[].b", "a.c"])


@pytest.mark.unit
def test_specs_from_cli_words_and_json() -> None:
    spec = parse_job(
        "name=topics kind=topn stream=meetup field=group.group_topics[].topic_name n=5 "
        "window=5m/10s watermark=30s"
    )
    assert (spec.kind, spec.n, spec.field) == ("topn", 5, "group.group_topics[].topic_name")
    assert spec.window == WindowSpec(length="5m", slide="10s", watermark="30s")
    count = parse_job("name=c kind=count stream=s by=a.b,c by_as=x,y state_partitions=1")
    assert count.by == ["a.b", "c"] and count.by_as == ["x", "y"]
    assert (count.state_partitions, spec.state_partitions) == (1, 0)  # 0: the session's
    again = parse_job(msgspec.json.encode(spec).decode())
    assert again == spec


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("name=x kind=topn stream=s", "topn needs `field`"),
        ("name=x kind=count stream=s", "count needs `by`"),
        ("name=x kind=custom stream=s", "custom needs `function`"),
        ("name=x kind=median stream=s", "Expected `str` matching|Invalid enum value"),
        ("name=checkpoints kind=distinct stream=s field=a", "reserved"),
        ("name=deadletter_s kind=distinct stream=s field=a", "reserved"),
        ("name=x kind=distinct stream=s field=a window=5 minutes", "expected key=value"),
        ("name=x kind=distinct stream=s field=a window=5y", "duration '5y'"),
        ("name=x kind=distinct stream=s field=a colour=red", "unknown field"),
        ("name=x kind=count stream=s by=a by_as=x,y", "by_as must name"),
        ("name=x kind=count stream=s by=a count_as=key", "taken by the result row"),
        ("name=x kind=count stream=s by=a.b[] time_field=t[] window=1m", "cannot explode"),
        ("name=x kind=topn stream=s field=a n=ten", "n must be a number"),
        ("name=x kind=topn stream=s field=a state_partitions=-1", r">= 0 - at `\$.state_part"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(JobError, match=why):
        parse_job(text)


@pytest.mark.unit
def test_intervals_and_iso_times() -> None:
    assert interval("10s") == "10 seconds" and interval("5m") == "5 minutes"
    assert interval("500ms") == "500 milliseconds" and interval(" 2  Hours ") == "2 hours"
    with pytest.raises(JobError, match="whole numbers"):
        interval("0.5s")
    assert iso_ms(1473159120000) == "2016-09-06T10:52:00Z"
    assert iso_ms(1473159120250) == "2016-09-06T10:52:00.250Z"


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 10**7),
    st.sampled_from([(300, 10), (60, 60), (20, 10), (30, 20), (50, 20)]),
)
def test_panes_fall_in_the_windows_spark_puts_their_events_in(
    t_s: int, length_slide: tuple[int, int]
) -> None:
    length, slide = (x * 1000 for x in length_slide)
    pane = math.gcd(length, slide)
    t = T0 + t_s * 7  # any ms
    spark_windows = (
        [w.start_ms for w in sliding_reference([(t, "x")], length, slide)]
        if (length % slide == 0)
        else _windows_by_definition(t, length, slide)
    )
    assert pane_windows(t - t % pane, pane, length, slide) == spark_windows


def _windows_by_definition(t: int, length: int, slide: int) -> list[int]:
    """Starts s (multiples of slide) with s <= t < s + length."""
    first = (t - length) - (t - length) % slide
    return [s for s in range(first, t + 1, slide) if s <= t < s + length]


@pytest.mark.unit
def test_durations_in_ms() -> None:
    assert duration_ms("10s") == 10_000 and duration_ms("5 minutes") == 300_000
    assert duration_ms("1h") == 3_600_000 and duration_ms("250ms") == 250


@pytest.mark.unit
def test_custom_functions_are_named_module_colon_function_and_nothing_is_guessed() -> None:
    from cluster.demo.meetup import responses

    assert load_function("cluster.demo.meetup:responses") is responses
    assert load_function("jobs.windows:late_count") is late_count
    for ref, why in (
        ("windows:late_count", "cannot import 'windows'"),  # no `jobs.` prefix added
        ("jobs.windows", "expected 'module:function'"),  # no "the only public function"
        ("no_such_job_module:f", "cannot import"),
        ("jobs.windows:no_such_fn", "has no attribute"),
        ("jobs.windows:LATE_OPERATOR", "not callable"),
    ):
        with pytest.raises(ConfigError, match=why) as err:
            load_function(ref, "job 'j': function")
        assert str(err.value).startswith("job 'j': function: "), err.value
    with pytest.raises(JobError, match="function: expected 'module:function'"):
        decode_spec({"name": "j", "kind": "custom", "stream": "s", "function": "windows"})


# --------------------------------------------------------------------------- Spark + NATS


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    server = nats_factory(sync_interval="2m")

    async def setup(nc: Any) -> None:
        js = nc.jetstream()
        for name, subjects in ((STREAM, ["raw.lib"]), ("results", ["results.>"])):
            await js.add_stream(StreamConfig(name=name, subjects=subjects, duplicate_window=600))
        await js.add_stream(StreamConfig(name="deadletter", subjects=["deadletter.>"]))
        for i, ev in enumerate(EVENTS):
            await js.publish("raw.lib", json.dumps(ev).encode(), headers={MSG_ID_HEADER: f"e{i}"})
        await js.publish("raw.lib", b'{"user": ', headers={MSG_ID_HEADER: "broken"})

    with_nats(setup, server.url)
    return server.url


@pytest.fixture(scope="module")
def sp(spark: Any) -> Any:
    register(spark)
    return spark


def run_job(sp: Any, url: str, spec: JobSpec, ckpt: Path) -> Any:
    query = start_job(sp, spec, NatsEndpoint(url), ckpt, trigger={"availableNow": True})
    assert query.awaitTermination(240), f"{spec.name} did not finish"
    assert query.exception() is None
    return query


def base(name: str, kind: str, **kw: Any) -> JobSpec:
    return decode_spec({"name": name, "kind": kind, "stream": STREAM, **kw})


def tag_counts() -> Counter[str]:
    return Counter(t["name"] for e in EVENTS for t in e["tags"])


def test_extract_reads_paths_as_strings_and_explodes(sp: Any) -> None:
    rows = [
        (json.dumps({"a": {"b": [{"c": 1}, {"c": "x"}]}, "n": 2.5, "o": {"k": [1]}}),),
        (json.dumps({"a": {"b": []}}),),
        (json.dumps({"a": "not an object"}),),
    ]
    df = sp.createDataFrame(rows, "data string")
    inner = extract(df, {"c": "a.b[].c", "n": "n", "o": "o"}).select("c", "n", "o").collect()
    assert [tuple(r) for r in inner] == [("1", "2.5", '{"k":[1]}'), ("x", "2.5", '{"k":[1]}')]
    outer = extract(df, {"c": "a.b[].c"}, outer=True).select("c").collect()
    assert [r.c for r in outer] == ["1", "x", None, None]


def test_topn_over_micro_batches_is_exact_when_it_fits(sp: Any, nats_url: str, tmp_path: Path):
    spec = base("lib_topn", "topn", field="tags[].name", n=5, max_events_per_trigger=100)
    q = run_job(sp, nats_url, spec, tmp_path)
    assert len(q.recentProgress) >= 3  # 241 sequences in batches of 100
    got = kv_results(nats_url, "lib_topn")["all"]
    exact = sorted(tag_counts().items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    assert got["top"] == [{"item": t, "count": c, "error": 0} for t, c in exact]
    assert got["events"] == N_EVENTS  # events without tags count too; the malformed one not


def test_topn_with_fewer_counters_than_items_is_still_exact(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    """Top-N counts every item in Spark's state: `capacity` (the old Space-Saving bound)
    no longer limits anything, so 6 counters for 30 items still give the exact answer."""
    spec = base("lib_topn_small", "topn", field="tags[].name", n=8, capacity=6)
    run_job(sp, nats_url, spec, tmp_path)
    got = kv_results(nats_url, "lib_topn_small")["all"]
    exact = sorted(tag_counts().items(), key=lambda kv: (-kv[1], kv[0]))[:8]
    assert len(tag_counts()) > 6
    assert got["top"] == [{"item": t, "count": c, "error": 0} for t, c in exact]


def test_topn_and_sample_per_sliding_window(sp: Any, nats_url: str, tmp_path: Path) -> None:
    window = {"length": "20s", "slide": "10s", "watermark": "1m"}
    common = {"window": window, "time_field": "t", "max_events_per_trigger": 100}
    topn = base("lib_topn_win", "topn", field="tags[].name", n=3, **common)
    sample = base("lib_sample_win", "sample", field="user.name", n=4, seed=1, **common)
    run_job(sp, nats_url, topn, tmp_path / "topn")
    run_job(sp, nats_url, sample, tmp_path / "sample")
    windows: dict[int, Counter[str]] = defaultdict(Counter)
    sizes: Counter[int] = Counter()
    for e in EVENTS:
        for w in sliding_reference([(e["t"], 0)], 20_000, 10_000):
            windows[w.start_ms].update(t["name"] for t in e["tags"])
            sizes[w.start_ms] += 1
    got = kv_results(nats_url, "lib_topn_win")
    assert set(got) == {iso_ms(s) for s in sizes}  # windows without tags are emitted too
    for s, counts in windows.items():
        exact = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        assert got[iso_ms(s)] == {
            "key": iso_ms(s),
            "window_start": iso_ms(s),
            "window_end": iso_ms(s + 20_000),
            "top": [{"item": t, "count": c, "error": 0} for t, c in exact],
        }
    samples = kv_results(nats_url, "lib_sample_win")
    for s, n in sizes.items():
        row = samples[iso_ms(s)]
        assert row["seen"] == n and len(row["sample"]) == min(4, n)


def test_count_per_tumbling_window_and_key(sp: Any, nats_url: str, tmp_path: Path) -> None:
    spec = base(
        "lib_count",
        "count",
        by=["kind", "user.name"],
        window={"length": "30s", "watermark": "1m"},
        time_field="t",
        max_events_per_trigger=100,
    )
    run_job(sp, nats_url, spec, tmp_path)
    want: Counter[tuple[str | None, str, int]] = Counter()
    for e in EVENTS:
        want[(e["kind"], e["user"]["name"], e["t"] - e["t"] % 30_000)] += 1
    got = kv_results(nats_url, "lib_count")
    expected = {
        f"{k or ''}|{u}|{iso_ms(s)}": {
            "key": f"{k or ''}|{u}|{iso_ms(s)}",
            "kind": k,
            "name": u,
            "window_start": iso_ms(s),
            "window_end": iso_ms(s + 30_000),
            "count": c,
        }
        for (k, u, s), c in want.items()
    }
    assert got == expected


def test_late_events_are_dropped_and_counted(sp: Any, nats_url: str, tmp_path: Path) -> None:
    stream = "late"

    async def publish(nc: Any) -> None:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=["raw.late"]))
        times = [*range(0, 100_000, 1000), 1000, 2000, 99_000]  # 3 stragglers at the end
        for i, t in enumerate(times):
            body = json.dumps({"k": "x", "t": T0 + t}).encode()
            await js.publish("raw.late", body, headers={MSG_ID_HEADER: f"l{i}"})

    with_nats(publish, nats_url)
    spec = decode_spec(
        {
            "name": "lib_late",
            "kind": "count",
            "stream": stream,
            "by": ["k"],
            "window": {"length": "10s", "watermark": "5s"},
            "time_field": "t",
            "max_events_per_trigger": 25,
        }
    )
    q = run_job(sp, nats_url, spec, tmp_path)
    assert late_count(q.recentProgress) == 2  # t=1 s and 2 s; t=99 s is on time
    got = kv_results(nats_url, "lib_late")
    assert got[f"x|{iso_ms(T0)}"]["count"] == 10
    assert got[f"x|{iso_ms(T0 + 90_000)}"]["count"] == 11


def test_distinct_within_the_hll_bounds(sp: Any, nats_url: str, tmp_path: Path) -> None:
    spec = base("lib_distinct", "distinct", field="user.id", max_events_per_trigger=100)
    run_job(sp, nats_url, spec, tmp_path)
    got = kv_results(nats_url, "lib_distinct")["all"]
    assert got["lower"] <= 37 <= got["upper"]
    assert got["distinct"] == 37  # 37 ids: the sketch is still exact (list mode)


def test_sample_is_uniform_sized_and_replays_the_same(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    spec = base("lib_sample", "sample", field="user.name", n=12, seed=7, max_events_per_trigger=100)
    run_job(sp, nats_url, spec, tmp_path / "a")
    first = kv_results(nats_url, "lib_sample")["all"]
    assert first["seen"] == N_EVENTS and len(first["sample"]) == 12
    assert set(first["sample"]) <= {e["user"]["name"] for e in EVENTS}
    again = msgspec.structs.replace(spec, name="lib_sample2")
    run_job(sp, nats_url, again, tmp_path / "b")  # a fresh run over the same batches
    assert kv_results(nats_url, "lib_sample2")["all"]["sample"] == first["sample"]


def test_custom_job_and_dead_letters(sp: Any, nats_url: str, tmp_path: Path) -> None:
    spec = base("lib_custom", "custom", function="cluster.demo.meetup:responses")
    run_job(sp, nats_url, spec, tmp_path)
    answers = Counter(e["response"] for e in EVENTS)
    assert kv_results(nats_url, "lib_custom") == {
        "all": {
            "key": "all",
            "yes": answers["yes"],
            "no": answers["no"],
            "ratio": answers["yes"] / answers["no"],
        }
    }
    counted: dict[int, int] = defaultdict(int)
    q = start_deadletters(
        sp,
        STREAM,
        NatsEndpoint(nats_url),
        tmp_path,
        trigger={"availableNow": True},
        on_batch=lambda b, report: counted.__setitem__(b, counted[b] + report.published),
    )
    assert q.awaitTermination(120) and q.exception() is None
    assert sum(counted.values()) == 1

    async def dead(nc: Any) -> list[Any]:
        js = nc.jetstream()
        info = await js.stream_info("deadletter")
        return [await js.get_msg("deadletter", s) for s in range(1, info.state.last_seq + 1)]

    (msg,) = with_nats(dead, nats_url)
    assert msg.subject == "deadletter.lib" and msg.data == b'{"user": '
    assert msg.headers[SOURCE_SEQ_HEADER] == str(N_EVENTS + 1)


def test_a_reset_checkpoint_fails_the_job_clearly_and_kv_keeps_its_answer(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    """The same job started over a new (reset) checkpoint would restart batch ids at 0, so
    its results would be dropped as the old run's duplicates while its first small
    batch rolled KV back; it fails with the reason instead, and KV keeps the full answer."""
    import shutil

    spec = base("lib_reset", "count", by=["response"], max_events_per_trigger=100)
    run_job(sp, nats_url, spec, tmp_path)
    want = Counter(e["response"] for e in EVENTS)
    before = kv_results(nats_url, "lib_reset")
    assert {k: v["count"] for k, v in before.items()} == dict(want)
    assert checkpoint_run_id(tmp_path / "lib_reset")  # Spark's query id names the run

    shutil.rmtree(tmp_path / "lib_reset")  # the reset
    query = start_job(sp, spec, NatsEndpoint(nats_url), tmp_path, trigger={"availableNow": True})
    with pytest.raises(Exception, match="checkpoint was reset"):
        query.awaitTermination(240)
    assert kv_results(nats_url, "lib_reset") == before
