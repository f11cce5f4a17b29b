"""The jetstream PySpark DataSource (jobs/jetstream*.py) against a real nats-server and Spark."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, TypeVar

import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, ReadMinRows

from jobs.jetstream import register, skipped_total
from jobs.jetstream_options import (
    AgedOutError,
    Bounds,
    JetStreamSourceError,
    SeqRange,
    SourceOptions,
    make_offset,
    next_offset,
    only_compaction,
    split_range,
    starting_sequence,
)
from jobs.jetstream_read import _parse_reply, _reply_columns, check_payload, read_range
from runtime.nats.server import NatsEndpoint
from tests.support import NatsFactory, delete_consumers, with_nats

pytestmark = pytest.mark.timeout(180)
T = TypeVar("T")


# ---- pure policy ------------------------------------------------------------------------


@pytest.mark.unit
def test_next_offset_caps_by_limit_and_target_and_reports_no_data() -> None:
    b = Bounds(first=1, last=100)
    kw: dict[str, Any] = {"stream": "s", "on_aged_out": "fail"}
    assert next_offset(make_offset(1), b, limit=ReadAllAvailable(), **kw) == make_offset(101)
    assert next_offset(make_offset(1), b, limit=ReadMaxRows(30), **kw) == make_offset(31)
    assert next_offset(make_offset(91), b, limit=ReadMaxRows(30), **kw) == make_offset(101)
    assert next_offset(make_offset(1), b, limit=ReadAllAvailable(), target=51, **kw) == (
        make_offset(51)
    )
    # nothing new: the start comes back unchanged
    assert next_offset(make_offset(101), b, limit=ReadMaxRows(30), **kw) == make_offset(101)
    assert next_offset(make_offset(95), b, limit=ReadMinRows(10), **kw) == make_offset(95)
    # an empty stream that never held anything reports first=0, last=0
    assert next_offset(make_offset(1), Bounds(0, 0), limit=ReadAllAvailable(), **kw) == (
        make_offset(1)
    )


@pytest.mark.unit
def test_next_offset_aged_out_fails_by_default_and_skip_counts_the_gap() -> None:
    b = Bounds(first=251, last=350)
    with pytest.raises(AgedOutError, match=r"'ev'.*start sequence 51.*first sequence .* 251"):
        next_offset(make_offset(51), b, stream="ev", on_aged_out="fail", limit=ReadAllAvailable())
    end = next_offset(make_offset(51, 7), b, stream="ev", on_aged_out="skip", limit=ReadMaxRows(40))
    assert end == {"seq": 291, "skipped": 207}
    # a stream purged down to nothing: first = last + 1
    end = next_offset(
        make_offset(5), Bounds(11, 10), stream="ev", on_aged_out="skip", limit=ReadAllAvailable()
    )
    assert end == {"seq": 11, "skipped": 6}


@pytest.mark.unit
def test_on_a_compacted_stream_a_gap_below_the_first_sequence_is_not_loss() -> None:
    kw: dict[str, Any] = {"stream": "ev", "on_aged_out": "fail", "limit": ReadAllAvailable()}
    compacted = Bounds(first=251, last=350, compacted=True)
    assert not compacted.aged_out(51) and Bounds(251, 350).aged_out(51)
    # read on from where the query was: the range's missing sequences were superseded
    assert next_offset(make_offset(51, 3), compacted, **kw) == {"seq": 351, "skipped": 3}
    # which streams remove only by compaction (JetStream limits as stream_info reports them)
    assert only_compaction(1, 0, -1, -1, "old")
    assert only_compaction(3, None, None, None, None)
    assert only_compaction(1, 0, 1000, 1 << 20, "new")  # full: refuses new, drops nothing
    assert not only_compaction(-1, 0, -1, -1, "old")  # not compacted
    assert not only_compaction(1, 3600.0, -1, -1, "old")  # ages out too
    assert not only_compaction(1, 0, 1000, -1, "old")  # a count limit drops the oldest
    assert not only_compaction(1, 0, -1, 1 << 20, "old")  # a size limit too


@pytest.mark.unit
def test_a_compacted_gap_costs_no_partitions() -> None:
    from jobs.jetstream import JetStreamStreamReader

    r = JetStreamStreamReader(SourceOptions.parse({"url": "nats://x", "stream": "s"}))
    r._latest = Bounds(first=90_001, last=100_000, compacted=True)
    parts = r.partitions(make_offset(1), make_offset(100_001))
    assert parts[0].start == 90_001 and parts[-1].end == 100_001  # not 5 empty ones before
    r._latest = Bounds(first=90_001, last=100_000)  # not compacted: the fetcher decides
    assert r.partitions(make_offset(1), make_offset(100_001))[0].start == 1


@pytest.mark.unit
def test_split_range_and_reply_parsing() -> None:
    assert split_range(5, 5, 10) == []
    assert split_range(1, 26, 10) == [SeqRange(1, 11), SeqRange(11, 21), SeqRange(21, 26)]
    assert _parse_reply("$JS.ACK.ev.cons.1.42.40.1795301006886081543.7") == (
        42,
        1795301006886081543,
        7,
    )
    v2 = "$JS.ACK.hub.ACCHASH.ev.cons.1.42.40.1795301006886081543.0.tok"
    assert _parse_reply(v2) == (42, 1795301006886081543, 0)
    with pytest.raises(JetStreamSourceError):
        _parse_reply("_INBOX.abc")


@pytest.mark.unit
def test_reply_columns_read_both_forms_by_column_and_refuse_a_bad_subject() -> None:
    short = [f"$JS.ACK.ev.cons.1.{s}.{s}.17953010068860815{s:02d}.7".encode() for s in (1, 2, 9)]
    v2 = [f"$JS.ACK.hub.ACCHASH.ev.cons.1.{s}.3.1795.0.tok".encode() for s in (4, 5)]
    for replies in (short, v2, short + v2):
        seq, ts = _reply_columns(replies)
        want = [_parse_reply(r.decode()) for r in replies]
        assert seq.to_pylist() == [w[0] for w in want]
        assert ts.to_pylist() == [w[1] for w in want]
    with pytest.raises(JetStreamSourceError):
        _reply_columns([*short, b"$JS.ACK.ev.cons.1.x.2.3.4"])
    too_big = b"$JS.ACK.ev.cons.1.99999999999999999999.1.2.3"
    with pytest.raises(JetStreamSourceError):
        _reply_columns([too_big])


@pytest.mark.unit
def test_payload_checks() -> None:
    assert check_payload(b'{"k": "a"}', "json") == ('{"k": "a"}', None)
    text, err = check_payload(b'{"k": ', "json")
    assert text == '{"k": ' and err and "not JSON" in err
    assert check_payload(b"plain text", "utf8") == ("plain text", None)
    text, err = check_payload(b"\xff\xfe{}", "utf8")
    assert text is None and err and "not UTF-8" in err


@pytest.mark.unit
def test_options_are_validated_with_clear_errors() -> None:
    base = {"url": "nats://127.0.0.1:4222", "stream": "ev"}
    opts = SourceOptions.parse({**base, "subject": "raw.a, raw.b", "maxEventsPerTrigger": "50"})
    assert opts.subjects == ("raw.a", "raw.b") and opts.max_events == 50
    for bad, match in [
        ({"stream": "ev"}, "'url'"),
        ({"url": "nats://x"}, "'stream'"),
        ({**base, "onAgedOut": "ignore"}, "onAgedOut"),
        ({**base, "maxEventsPerTrigger": "0"}, "maxEventsPerTrigger"),
        ({**base, "startingOffset": "-3"}, "startingOffset"),
        ({**base, "validate": "xml"}, "validate"),
    ]:
        with pytest.raises(JetStreamSourceError, match=match):
            SourceOptions.parse(bad)


@pytest.mark.unit
def test_the_endpoint_travels_as_the_same_option_keys() -> None:
    ep = NatsEndpoint(
        "nats://a:4222,nats://b:4222",
        user="u",
        password="p",
        tls_ca="/ca.pem",
        tls_cert="/c.pem",
        tls_key="/k.pem",
    )
    options = ep.to_options()
    assert options == {
        "url": "nats://a:4222,nats://b:4222",
        "user": "u",
        "password": "p",
        "tlsCa": "/ca.pem",
        "tlsCert": "/c.pem",
        "tlsKey": "/k.pem",
    }
    opts = SourceOptions.parse({**options, "stream": "ev", "timeout": "3"})
    assert opts.nats == ep and opts.timeout == 3.0
    token = SourceOptions.parse({"url": "nats://x", "stream": "ev", "token": "t", "creds": "f"})
    assert (token.nats.token, token.nats.creds, token.nats.user) == ("t", "f", None)


@pytest.mark.unit
def test_starting_offset_names_a_sequence() -> None:
    b = Bounds(first=5, last=9)
    assert [starting_sequence(s, b) for s in ("earliest", "latest", "7")] == [5, 10, 7]
    assert starting_sequence("earliest", Bounds(first=0, last=0)) == 1


# ---- against nats-server and Spark ------------------------------------------------------


async def publish(nc: Client, msgs: list[tuple[str, bytes, str | None]]) -> None:
    """Publish (subject, payload, msg id) in order with all acks in flight, then await them."""
    js = nc.jetstream()
    futs = []
    for subject, payload, msg_id in msgs:
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        futs.append(await js.publish_async(subject, payload, headers=headers))
    await asyncio.wait_for(asyncio.gather(*futs), 60)


def add_stream(url: str, name: str, subjects: list[str], **kw: Any) -> None:
    async def go(nc: Client) -> None:
        await nc.jetstream().add_stream(StreamConfig(name=name, subjects=subjects, **kw))

    with_nats(go, url)


def event(i: int, key: str) -> bytes:
    return json.dumps({"k": key, "i": i}).encode()


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    # The tests kill Spark, never NATS, so fsync every 2 minutes is enough and far faster.
    return nats_factory(sync_interval="2m").url


@pytest.fixture(scope="module")
def sp(spark: Any) -> Any:
    register(spark)
    return spark


N = 10_000


@pytest.fixture(scope="module")
def ten_k(nats_url: str) -> list[tuple[int, str, str, str]]:
    """Stream `ev` with 10k JSON events on raw.ev.a / raw.ev.b: (seq, subject, msg id, data)."""
    # a duplicate window longer than the module: the streaming test re-sends an id minutes
    # later (on a loaded machine) and expects JetStream to drop it
    add_stream(nats_url, "ev", ["raw.ev.>"], duplicate_window=3600)
    msgs = [(f"raw.ev.{'ab'[i % 3 == 0]}", event(i, f"k{i % 7}"), f"ev-{i}") for i in range(N)]
    with_nats(lambda nc: publish(nc, msgs), nats_url)
    return [(i + 1, s, mid, p.decode()) for i, (s, p, mid) in enumerate(msgs)]


def reader(sp: Any, url: str, stream: str, **opts: str) -> Any:
    r = sp.read.format("jetstream").option("url", url).option("stream", stream)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_batch_read_returns_exactly_what_was_published(
    sp: Any, nats_url: str, ten_k: list[tuple[int, str, str, str]]
) -> None:
    df = reader(sp, nats_url, "ev", partitionSize="3000", fetchBatch="1000")
    assert df.rdd.getNumPartitions() == 4
    rows = df.select("seq", "subject", "msg_id", "data", "valid", "ts").collect()
    got = sorted((r.seq, r.subject, r.msg_id, r.data) for r in rows)
    assert got == ten_k
    assert all(r.valid for r in rows)
    assert [r[0] for r in got] == list(range(1, N + 1))  # contiguous
    assert all(r.ts is not None for r in rows)

    t0 = time.perf_counter()
    counted = reader(sp, nats_url, "ev").count()
    dt = time.perf_counter() - t0
    assert counted == N
    opts = SourceOptions.parse({"url": nats_url, "stream": "ev"})
    t1 = time.perf_counter()
    direct = sum(batch.num_rows for batch in read_range(opts, SeqRange(1, N + 1)))
    dt1 = time.perf_counter() - t1
    assert direct == N
    print(
        f"\njetstream read of {N} events: Spark count() {N / dt:,.0f} events/s "
        f"(job overhead included); one partition's reader alone {N / dt1:,.0f} events/s"
    )


def test_a_lost_consumer_is_replaced_without_gap_or_repeat(
    nats_url: str, ten_k: list[tuple[int, str, str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    opts = SourceOptions.parse(
        {"url": nats_url, "stream": "ev", "fetchBatch": "1000", "timeout": "1"}
    )

    seqs: list[int] = []
    for i, batch in enumerate(read_range(opts, SeqRange(1, N + 1))):
        seqs.extend(batch.column("seq").to_pylist())
        if i == 2:
            assert delete_consumers(nats_url, "ev") == 1
    assert seqs == list(range(1, N + 1))
    assert "starting a new consumer" in caplog.text


def test_subject_filter_and_sequence_range(
    sp: Any, nats_url: str, ten_k: list[tuple[int, str, str, str]]
) -> None:
    want_b = [(seq, mid) for seq, subject, mid, _ in ten_k if subject == "raw.ev.b"]
    rows = reader(sp, nats_url, "ev", subject="raw.ev.b", partitionSize="2500").collect()
    assert sorted((r.seq, r.msg_id) for r in rows) == want_b
    assert {r.subject for r in rows} == {"raw.ev.b"}

    both = reader(sp, nats_url, "ev", subject="raw.ev.a,raw.ev.b").count()
    assert both == N

    part = reader(sp, nats_url, "ev", startingOffset="101", endingOffset="201", subject="raw.ev.a")
    want = [seq for seq, subject, _, _ in ten_k if 101 <= seq < 201 and subject == "raw.ev.a"]
    assert sorted(r.seq for r in part.collect()) == want


def test_missing_stream_is_a_clear_error(sp: Any, nats_url: str) -> None:
    with pytest.raises(Exception, match="stream 'nosuch' does not exist"):
        reader(sp, nats_url, "nosuch").count()


def stream_query(sp: Any, url: str, stream: str, ckpt: Path, seen: list[int], **opts: str) -> Any:
    """An availableNow query appending every seq it sees to `seen` (driver-side foreachBatch)."""
    r = sp.readStream.format("jetstream").option("url", url).option("stream", stream)
    for k, v in opts.items():
        r = r.option(k, v)

    def collect(df: Any, batch_id: int) -> None:
        seen.extend(row.seq for row in df.select("seq").collect())

    return (
        r.load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )


def test_streaming_reads_in_capped_batches_and_resumes_from_checkpoint(
    sp: Any, nats_url: str, ten_k: list[tuple[int, str, str, str]], tmp_path: Path
) -> None:
    seen: list[int] = []
    q = stream_query(sp, nats_url, "ev", tmp_path / "ck", seen, maxEventsPerTrigger="2500")
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(seen) == list(range(1, N + 1))
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sizes == [2500] * 4
    t = sum(p["durationMs"]["addBatch"] for p in q.recentProgress) / 1000
    print(f"\njetstream streaming: {N} events in 4 micro-batches, addBatch {t:.2f} s")

    more = [("raw.ev.a", event(i, "late"), f"ev-{i}") for i in range(N, N + 300)]
    more.append(("raw.ev.a", event(0, "dup"), "ev-5"))  # a duplicate id: JetStream drops it
    with_nats(lambda nc: publish(nc, more), nats_url)
    seen.clear()
    q = stream_query(sp, nats_url, "ev", tmp_path / "ck", seen, maxEventsPerTrigger="2500")
    assert q.awaitTermination(120)
    assert sorted(seen) == list(range(N + 1, N + 301))  # only the new events, once each


def test_aged_out_start_fails_clearly_or_skips_and_counts(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    add_stream(nats_url, "small", ["raw.small"], max_msgs=100)
    with_nats(
        lambda nc: publish(nc, [("raw.small", event(i, "a"), None) for i in range(50)]), nats_url
    )
    ckpt = tmp_path / "ck"
    seen: list[int] = []
    q = stream_query(sp, nats_url, "small", ckpt, seen)
    assert q.awaitTermination(120)
    assert sorted(seen) == list(range(1, 51))

    # 300 more: the stream keeps 100, so sequences 51..250 are gone before the query returns
    more = [("raw.small", event(i, "a"), None) for i in range(50, 350)]
    with_nats(lambda nc: publish(nc, more), nats_url)

    failed = stream_query(sp, nats_url, "small", ckpt, seen)
    with pytest.raises(Exception) as info:
        failed.awaitTermination(120)
    msg = str(info.value)
    assert "'small'" in msg and "start sequence 51" in msg and "251" in msg, msg
    assert not failed.isActive

    seen.clear()
    q = stream_query(sp, nats_url, "small", ckpt, seen, onAgedOut="skip")
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(seen) == list(range(251, 351))
    assert skipped_total(q.lastProgress) == 200

    # batch reads apply the same rule to an explicit start
    with pytest.raises(Exception, match="start sequence 10 has aged out"):
        reader(sp, nats_url, "small", startingOffset="10").count()
    assert reader(sp, nats_url, "small", startingOffset="10", onAgedOut="skip").count() == 100


def test_a_compacted_stream_has_gaps_not_losses(sp: Any, nats_url: str, tmp_path: Path) -> None:
    """Compaction removes superseded events, the first sequence included: a query whose
    next sequence was compacted away reads on (no AgedOutError, nothing counted as
    skipped) and sees the latest event of every key; the same gap on a compacted stream
    that also has a count limit is still reported as aged out."""
    add_stream(nats_url, "latest", ["raw.latest.*"], max_msgs_per_subject=1)
    keyed = lambda keys: [(f"raw.latest.{k}", event(i, k), None) for i, k in keys]  # noqa: E731
    with_nats(lambda nc: publish(nc, keyed([(0, "a"), (1, "b")])), nats_url)
    ckpt = tmp_path / "ck"
    seen: list[int] = []
    q = stream_query(sp, nats_url, "latest", ckpt, seen)
    assert q.awaitTermination(120) and q.exception() is None
    assert sorted(seen) == [1, 2]
    # a: seqs 1, 3, 6; b: 2, 4; c: 5. Retained 4, 5, 6: the query's next sequence (3) and
    # the first two are gone, superseded
    more = [(2, "a"), (3, "b"), (4, "c"), (5, "a")]
    with_nats(lambda nc: publish(nc, keyed(more)), nats_url)
    info = with_nats(lambda nc: nc.jetstream().stream_info("latest"), nats_url)
    assert (info.state.first_seq, info.state.last_seq, info.state.messages) == (4, 6, 3)

    seen.clear()
    q = stream_query(sp, nats_url, "latest", ckpt, seen)
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(seen) == [4, 5, 6]
    assert skipped_total(q.lastProgress) == 0
    rows = reader(sp, nats_url, "latest", startingOffset="1").collect()
    assert sorted((r.seq, json.loads(r.data)["k"]) for r in rows) == [(4, "b"), (5, "c"), (6, "a")]

    # compacted and capped at 2 messages: the third key pushes the first out, a real loss
    add_stream(nats_url, "capped", ["raw.capped.*"], max_msgs_per_subject=1, max_msgs=2)
    capped = [(f"raw.capped.{k}", event(i, k), None) for i, k in enumerate("xyz")]
    with_nats(lambda nc: publish(nc, capped), nats_url)
    with pytest.raises(Exception, match="start sequence 1 has aged out"):
        reader(sp, nats_url, "capped", startingOffset="1").count()


def test_malformed_events_are_flagged_with_their_bytes(sp: Any, nats_url: str) -> None:
    add_stream(nats_url, "mixed", ["raw.mixed"])
    payloads = [event(0, "a"), b"\xff\xfenot utf-8", b"{not json", event(1, "b"), b""]
    with_nats(lambda nc: publish(nc, [("raw.mixed", p, None) for p in payloads]), nats_url)
    rows = sorted(reader(sp, nats_url, "mixed").collect(), key=lambda r: r.seq)
    assert [r.valid for r in rows] == [True, False, False, True, False]
    assert rows[0].data == payloads[0].decode() and rows[0].raw is None and rows[0].error is None
    assert rows[1].data is None and bytes(rows[1].raw) == payloads[1]
    assert "not UTF-8" in rows[1].error
    assert rows[2].data == "{not json" and "not JSON" in rows[2].error
    assert bytes(rows[2].raw) == payloads[2]
    lenient = reader(sp, nats_url, "mixed", validate="utf8").where("valid").count()
    assert lenient == 4  # "{not json" and "" are UTF-8
