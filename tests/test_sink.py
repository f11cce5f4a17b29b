"""jobs/sink.py: idempotent results + KV upserts + dead letters; exactly-once across restarts.

Real nats-server, real Spark (the shared session), and for the harshest case a Spark driver in
a child process that is SIGKILLed (with its JVM) right after a batch's results are durable and
before Spark commits the batch, so the restart must replay it and JetStream must drop the
replayed results as duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError
from nats.js.kv import _is_key_valid

from jobs.jetstream import register
from jobs.sink import (
    BATCH_HEADER,
    ERROR_HEADER,
    MSG_ID_HEADER,
    SOURCE_SEQ_HEADER,
    SOURCE_STREAM_HEADER,
    SOURCE_SUBJECT_HEADER,
    ResultSink,
    SinkError,
    close_sinks,
    key_from_kv,
    kv_items,
    kv_key,
    result_id,
)
from runtime.waiting import wait_until
from tests.support import NatsFactory, with_nats

pytestmark = pytest.mark.timeout(240)
T = TypeVar("T")
KEYS = 10


# ---- helpers ------------------------------------------------------------------------------


def add_stream(url: str, name: str, subjects: list[str]) -> None:
    async def go(nc: Client) -> None:
        cfg = StreamConfig(name=name, subjects=subjects, duplicate_window=600)
        await nc.jetstream().add_stream(cfg)

    with_nats(go, url)


def publish(url: str, subject: str, payloads: list[bytes]) -> None:
    async def go(nc: Client) -> None:
        js = nc.jetstream()
        futs = [await js.publish_async(subject, p) for p in payloads]
        await asyncio.wait_for(asyncio.gather(*futs), 60)

    with_nats(go, url)


def events(start: int, n: int) -> list[bytes]:
    """Event i has key k(i % KEYS); the exact counts are computed from these same bytes."""
    return [json.dumps({"k": f"k{i % KEYS}", "i": i}).encode() for i in range(start, start + n)]


def exact_counts(payloads: list[bytes]) -> dict[str, int]:
    return dict(Counter(json.loads(p)["k"] for p in payloads))


def stream_msgs(url: str, stream: str, subject: str) -> list[tuple[int, dict[str, str], bytes]]:
    """(seq, headers, data) of every message of `stream` on `subject`."""

    async def go(nc: Client) -> list[tuple[int, dict[str, str], bytes]]:
        js = nc.jetstream()
        state = (await js.stream_info(stream)).state
        out = []
        for seq in range(max(state.first_seq, 1), state.last_seq + 1):
            try:
                m = await js.get_msg(stream, seq)
            except NotFoundError:
                continue
            if m.subject == subject:
                out.append((seq, dict(m.headers or {}), m.data or b""))
        return out

    return with_nats(go, url)


def kv_values(url: str, bucket: str) -> dict[str | None, dict[str, Any]]:
    """The bucket's latest values, keyed by the original result key."""

    async def go(nc: Client) -> dict[str | None, dict[str, Any]]:
        items = await kv_items(nc.jetstream(), bucket)
        return {key_from_kv(k): json.loads(v) for k, v in items.items()}

    return with_nats(go, url)


def kv_counts(url: str, bucket: str) -> dict[str, int]:
    try:
        return {k: v["count"] for k, v in kv_values(url, bucket).items()}
    except NotFoundError:
        return {}


def count_query(
    spark: Any,
    url: str,
    stream: str,
    write: Callable[[Any, int], None],
    ckpt: str | Path,
    *,
    max_events: int = 0,
    trigger: dict[str, Any] | None = None,
) -> Any:
    """Count valid events by their JSON "k", written through `write` (a ResultSink)."""
    from pyspark.sql import functions as F

    src = spark.readStream.format("jetstream").option("url", url).option("stream", stream)
    if max_events:
        src = src.option("maxEventsPerTrigger", str(max_events))
    counts = (
        src.load()
        .where("valid")
        .select(F.get_json_object("data", "$.k").alias("key"))
        .groupBy("key")
        .count()
    )
    return (
        counts.writeStream.outputMode("update")
        .foreachBatch(write)
        .option("checkpointLocation", str(ckpt))
        .trigger(**(trigger or {"availableNow": True}))
        .start()
    )


def assert_exactly_once(url: str, query: str, bucket: str, payloads: list[bytes]) -> None:
    """KV holds the exact counts; the results stream holds each (batch, key) result once."""
    want = exact_counts(payloads)
    assert kv_counts(url, bucket) == want
    msgs = stream_msgs(url, "results", f"results.{query}")
    ids = [h[MSG_ID_HEADER] for _, h, _ in msgs]
    assert len(ids) == len(set(ids)), "a result id repeats"
    # per key, results come in batch order with growing counts, the last one exact
    last: dict[str, tuple[int, int]] = {}
    for _, h, data in msgs:
        row, batch = json.loads(data), int(h[BATCH_HEADER])
        assert h[MSG_ID_HEADER] == result_id(query, batch, row["key"])
        prev_batch, prev_count = last.get(row["key"], (-1, 0))
        assert batch > prev_batch and row["count"] > prev_count, (row, batch, last)
        last[row["key"]] = (batch, row["count"])
    assert {k: c for k, (_, c) in last.items()} == want


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    # Spark is what gets killed here, never NATS, so fsync every 2 minutes is enough.
    server = nats_factory(sync_interval="2m")
    add_stream(server.url, "results", ["results.>"])
    add_stream(server.url, "deadletter", ["deadletter.>"])
    return server.url


@pytest.fixture(scope="module")
def sp(spark: Any) -> Any:
    register(spark)
    return spark


# ---- the sink on its own --------------------------------------------------------------------


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=40)))
def test_kv_keys_are_valid_and_reversible(key: str | None) -> None:
    k = kv_key(key)
    assert _is_key_valid(k), k
    assert key_from_kv(k) == key


@pytest.mark.unit
def test_kv_keys_keep_plain_keys_and_encode_the_rest() -> None:
    assert kv_key("k1") == "k1" and kv_key("a/b=c.d_e-f") == "a/b=c.d_e-f"
    assert kv_key(42) == "42"
    for odd in ["two words", "ünï", ".lead", "trail.", "b64.looks-encoded", "a*b>c"]:
        assert kv_key(odd).startswith("b64.") and key_from_kv(kv_key(odd)) == odd


def test_publish_results_is_idempotent_per_batch_and_key(nats_url: str) -> None:
    sink = ResultSink(nats_url, "results", "unit_kv", "unit")
    rows = [{"key": "a", "count": 3}, {"key": "two words", "count": 1}, {"key": None, "count": 2}]
    first = sink.publish_results(rows, 0)
    assert (first.published, first.duplicates, first.kv_puts) == (3, 0, 3)
    again = sink.publish_results(rows, 0)  # a replay of batch 0
    assert (again.published, again.duplicates) == (3, 3)
    sink.publish_results([{"key": "a", "count": 5}], 1)

    msgs = stream_msgs(nats_url, "results", "results.unit")
    assert [h[MSG_ID_HEADER] for _, h, _ in msgs] == [
        "unit:0:a",
        f"unit:0:{kv_key('two words')}",
        "unit:0:b64.-",
        "unit:1:a",
    ]
    assert kv_values(nats_url, "unit_kv") == {
        "a": {"key": "a", "count": 5},
        "two words": {"key": "two words", "count": 1},
        None: {"key": None, "count": 2},
    }
    assert sink.stats.batches == 3 and sink.stats.duplicates == 3 and sink.stats.results == 7


def test_a_sink_keeps_one_connection_across_batches_until_closed_or_idle(
    nats_factory: NatsFactory,
) -> None:
    """The connection is made once for many batches (not once a batch), closed when its
    query's sinks are closed, made again by the next batch, and closed when left idle."""
    server = nats_factory(sync_interval="2m")
    add_stream(server.url, "results", ["results.>"])

    def names(state: str) -> list[str]:
        status, connz = server.monitor(f"connz?state={state}&limit=1024")
        assert status == 200
        return [c.get("name") for c in connz.get("connections") or []]

    sink = ResultSink(server.url, "results", "keep_kv", "keep")
    for batch in range(4):
        sink.publish_results([{"key": "a", "count": batch}], batch)
    assert sink.connected and names("open").count("result-sink-keep") == 1
    assert names("all").count("result-sink-keep") == 1  # one connection for four batches

    assert close_sinks("keep") == 1 and not sink.connected
    wait_until(lambda: "result-sink-keep" not in names("open"), 10, what="sink disconnected")
    assert sink.publish_results([{"key": "a", "count": 9}], 4).published == 1  # reconnects
    assert names("all").count("result-sink-keep") == 2
    assert kv_values(server.url, "keep_kv") == {"a": {"key": "a", "count": 9}}
    sink.close()

    idle = ResultSink(server.url, "results", "keep_kv", "idle", idle_close_s=0.2)
    idle.publish_results([{"key": "b", "count": 1}], 0)
    wait_until(lambda: not idle.connected, 10, what="idle sink closed")
    wait_until(lambda: "result-sink-idle" not in names("open"), 10, what="idle disconnect")


def test_a_replayed_old_batch_never_overwrites_a_newer_kv_value(nats_url: str) -> None:
    """KV keeps the value of the newest batch; an older batch that arrives late
    (a replay after a crash, a slow twin) publishes its results but leaves KV alone."""
    sink = ResultSink(nats_url, "results", "order_kv", "order", run_id="run-a")
    sink.publish_results([{"key": "a", "count": 5}, {"key": "b", "count": 1}], 7)
    old = sink.publish_results([{"key": "a", "count": 3}, {"key": "c", "count": 9}], 4)
    assert (old.published, old.kv_puts, old.kv_stale) == (2, 1, 1)  # only the new key c
    assert kv_values(nats_url, "order_kv") == {
        "a": {"key": "a", "count": 5},
        "b": {"key": "b", "count": 1},
        "c": {"key": "c", "count": 9},
    }
    newer = sink.publish_results([{"key": "a", "count": 8}], 8)
    assert newer.kv_puts == 1 and kv_values(nats_url, "order_kv")["a"]["count"] == 8


def test_a_sink_puts_its_own_keys_without_reading_them_and_reads_any_other(
    nats_url: str,
) -> None:
    """A key nobody has put, or one whose value this sink put for an earlier batch, is put
    in one conditional write (no read); a value anyone else put (another sink, a restart of
    the driver) fails that write, and the key is read and judged: a newer batch's
    value stays, an older one's is replaced, and this sink's own replay leaves KV alone."""
    sink = ResultSink(nats_url, "results", "own_kv", "own", run_id="run-a")
    assert sink.publish_results([{"key": "a", "n": 1}, {"key": "b", "n": 1}], 0).kv_puts == 2
    assert sink.publish_results([{"key": "a", "n": 2}, {"key": "c", "n": 1}], 1).kv_puts == 2
    assert sink.stats.kv_reads == 0
    replay = sink.publish_results([{"key": "a", "n": 2}], 1)  # its own batch 1 again
    assert (replay.kv_puts, replay.kv_stale) == (0, 1) and sink.stats.kv_reads == 1

    twin = ResultSink(nats_url, "results", "own_kv", "own", run_id="run-a")  # e.g. a restart
    done = twin.publish_results([{"key": "a", "n": 5}, {"key": "b", "n": 5}], 5)
    assert done.kv_puts == 2 and twin.stats.kv_reads == 2  # values it did not put: read
    late = sink.publish_results([{"key": "a", "n": 3}, {"key": "b", "n": 3}], 2)
    assert (late.kv_puts, late.kv_stale) == (0, 2)  # its remembered revisions are gone
    assert sink.publish_results([{"key": "a", "n": 9}], 9).kv_puts == 1
    assert kv_values(nats_url, "own_kv") == {
        "a": {"key": "a", "n": 9},
        "b": {"key": "b", "n": 5},
        "c": {"key": "c", "n": 1},
    }
    reset = ResultSink(nats_url, "results", "own_kv", "own", run_id="run-b")
    with pytest.raises(SinkError, match="checkpoint was reset"):
        reset.publish_results([{"key": "c", "n": 1}], 0)


def test_a_reset_checkpoint_is_a_clear_error_and_kv_stays(nats_url: str) -> None:
    """A query whose checkpoint was reset (a new run, batch ids back at 0) would
    see its new results dropped as duplicates of the old run's ids while KV went back in
    time; the sink refuses the batch, names the cause, and KV keeps the old run's values."""
    first = ResultSink(nats_url, "results", "reset_kv", "reset", run_id="run-old")
    first.publish_results([{"key": "a", "count": 40}], 12)
    again = ResultSink(nats_url, "results", "reset_kv", "reset", run_id="run-new")
    with pytest.raises(SinkError, match=r"query 'reset'.*checkpoint was reset.*batch 12"):
        again.publish_results([{"key": "a", "count": 2}], 0)
    assert kv_values(nats_url, "reset_kv") == {"a": {"key": "a", "count": 40}}
    # the old run itself goes on
    assert first.publish_results([{"key": "a", "count": 41}], 13).kv_puts == 1


def test_bad_batches_are_refused_before_anything_is_published(nats_url: str) -> None:
    sink = ResultSink(nats_url, "results", "unit_kv2", "unit2")
    with pytest.raises(ValueError, match="two rows for key 'a'"):
        sink.publish_results([{"key": "a", "n": 1}, {"key": "a", "n": 2}], 0)
    with pytest.raises(ValueError, match="no key column 'key'"):
        sink.publish_results([{"topic": "a"}], 0)
    assert stream_msgs(nats_url, "results", "results.unit2") == []
    lost = ResultSink(nats_url, "nowhere", "unit_kv2", "unit2")
    with pytest.raises(SinkError, match="no JetStream stream captures subject 'nowhere.unit2'"):
        lost.publish_results([{"key": "a"}], 0)
    with pytest.raises(ValueError, match="query_name"):
        ResultSink(nats_url, query_name="has.dot")


def test_dead_letters_keep_the_bytes_and_the_reason_once(nats_url: str) -> None:
    sink = ResultSink(nats_url, query_name="dl")
    rows = [
        {
            "seq": 7,
            "subject": "raw.x",
            "msg_id": "e7",
            "error": "payload is not UTF-8",
            "raw": b"\xff",
        },
        {"seq": 9, "subject": "raw.x", "msg_id": None, "error": "not\r\nJSON", "raw": b"{"},
    ]
    assert sink.dead_letter(rows, "src").published == 2
    assert sink.dead_letter(rows, "src").duplicates == 2  # a replayed batch
    msgs = stream_msgs(nats_url, "deadletter", "deadletter.src")
    assert [d for _, _, d in msgs] == [b"\xff", b"{"]
    h = msgs[0][1]
    assert h[MSG_ID_HEADER] == "dl:src:7" and h[SOURCE_STREAM_HEADER] == "src"
    assert h[SOURCE_SEQ_HEADER] == "7" and h[SOURCE_SUBJECT_HEADER] == "raw.x"
    assert h[ERROR_HEADER] == "payload is not UTF-8"
    assert msgs[1][1][ERROR_HEADER] == "not JSON"
    assert sink.stats.dead_letters == 4 and sink.stats.dead_letter_duplicates == 2


# ---- exactly-once through Spark -------------------------------------------------------------


def test_exactly_once_across_a_stop_mid_way(sp: Any, nats_url: str, tmp_path: Path) -> None:
    add_stream(nats_url, "eo1", ["raw.eo1"])
    sent = events(0, 2400)
    publish(nats_url, "raw.eo1", sent)
    ckpt = tmp_path / "ck"
    sink = ResultSink(nats_url, "results", "eo1_kv", "eo1")
    fast = {"processingTime": "50 milliseconds"}
    q = count_query(sp, nats_url, "eo1", sink.write, ckpt, max_events=400, trigger=fast)
    try:
        wait_until(lambda: sink.stats.batches >= 2 or q.exception(), 120, what="2 batches")
    finally:
        q.stop()
    assert q.exception() is None
    assert sum(kv_counts(nats_url, "eo1_kv").values()) < len(sent), "stopped too late"

    more = events(2400, 600)
    publish(nats_url, "raw.eo1", more)
    sink2 = ResultSink(nats_url, "results", "eo1_kv", "eo1")
    q = count_query(sp, nats_url, "eo1", sink2.write, ckpt, max_events=1000)
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert_exactly_once(nats_url, "eo1", "eo1_kv", sent + more)


CHILD = r"""
import json, pathlib, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["tests_dir"])
from runtime.config import load
from runtime.engines.services import spark_session
from jobs.jetstream import register
from jobs.sink import ResultSink
import test_sink

cfg = load(environ={}, overrides={"state_dir": args["state_dir"], "spark": {"master": "local[2]"}})
spark = spark_session(cfg, "tierflow-crash-child")
register(spark)
sink = ResultSink(args["url"], "results", args["bucket"], args["query"])

def write(df, batch_id):
    sink.write(df, batch_id)
    if batch_id == args["block_at"]:
        pathlib.Path(args["marker"]).write_text(str(batch_id))
        time.sleep(600)  # results are durable, Spark has not committed: the parent kills us here

q = test_sink.count_query(spark, args["url"], args["stream"], write, args["ckpt"],
                          max_events=args["max_events"])
q.awaitTermination()
"""


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's whole process group (its JVM and Python workers) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)

    def group_gone() -> bool:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(group_gone, 30, what="the child's JVM to exit")


def test_exactly_once_across_sigkill_of_the_driver(sp: Any, nats_url: str, tmp_path: Path) -> None:
    add_stream(nats_url, "eo2", ["raw.eo2"])
    sent = events(0, 2000)
    publish(nats_url, "raw.eo2", sent)
    args = {
        "tests_dir": str(Path(__file__).parent),
        "state_dir": str(tmp_path / "child-state"),
        "url": nats_url,
        "stream": "eo2",
        "bucket": "eo2_kv",
        "query": "eo2",
        "ckpt": str(tmp_path / "ck"),
        "max_events": 1000,
        "block_at": 1,
        "marker": str(tmp_path / "blocked"),
    }
    log_path = tmp_path / "child.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(
            lambda: Path(args["marker"]).exists() or proc.poll() is not None,
            150,
            what="the child to finish batch 1",
        )
        assert Path(args["marker"]).exists(), log_path.read_text()[-3000:]
    finally:
        kill_group(proc)
    # batches 0 and 1 are in the results stream and KV; Spark's commit log ends at batch 0
    assert kv_counts(nats_url, "eo2_kv") == exact_counts(sent)
    assert (Path(args["ckpt"]) / "commits" / "0").exists()
    assert not (Path(args["ckpt"]) / "commits" / "1").exists()

    more = events(2000, 1000)
    publish(nats_url, "raw.eo2", more)
    sink = ResultSink(nats_url, "results", "eo2_kv", "eo2")
    q = count_query(sp, nats_url, "eo2", sink.write, args["ckpt"], max_events=1000)
    assert q.awaitTermination(120)
    assert q.exception() is None
    # batch 1 was replayed: each of its KEYS results was already stored and was dropped
    assert sink.stats.duplicates == KEYS
    assert sink.stats.batches == 2  # batches 1 (again) and 2
    assert_exactly_once(nats_url, "eo2", "eo2_kv", sent + more)
    assert len(stream_msgs(nats_url, "results", "results.eo2")) == 3 * KEYS


def test_malformed_events_go_to_dead_letter_and_the_query_keeps_running(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    add_stream(nats_url, "mal", ["raw.mal"])
    good = events(0, 300)
    bad = [b"\xff\xfe\x00", b'{"k": ', b"plain text"]
    publish(nats_url, "raw.mal", good[:150] + bad + good[150:])
    sink = ResultSink(nats_url, "results", "mal_kv", "mal")
    trigger = {"processingTime": "100 milliseconds"}
    counts = count_query(sp, nats_url, "mal", sink.write, tmp_path / "ck1", trigger=trigger)
    dead = (
        sp.readStream.format("jetstream")
        .option("url", nats_url)
        .option("stream", "mal")
        .load()
        .writeStream.foreachBatch(sink.dead_letters("mal"))
        .option("checkpointLocation", str(tmp_path / "ck2"))
        .trigger(**trigger)
        .start()
    )
    try:
        wait_until(lambda: kv_counts(nats_url, "mal_kv") == exact_counts(good), 90, what="counts")
        wait_until(lambda: sink.stats.dead_letters == 3, 60, what="3 dead letters")
        more_good, more_bad = events(300, 100), [b"\x80"]
        publish(nats_url, "raw.mal", more_bad + more_good)
        want = exact_counts(good + more_good)
        wait_until(lambda: kv_counts(nats_url, "mal_kv") == want, 90, what="later counts")
        wait_until(lambda: sink.stats.dead_letters == 4, 60, what="the 4th dead letter")
        assert counts.isActive and dead.isActive
        assert counts.exception() is None and dead.exception() is None
    finally:
        counts.stop()
        dead.stop()
    msgs = stream_msgs(nats_url, "deadletter", "deadletter.mal")
    assert [d for _, _, d in msgs] == bad + more_bad
    assert [h[SOURCE_SEQ_HEADER] for _, h, _ in msgs] == ["151", "152", "153", "304"]
    assert "not UTF-8" in msgs[0][1][ERROR_HEADER] and "not JSON" in msgs[1][1][ERROR_HEADER]


class _Conn:
    """A stand-in for a nats-py client: only the two flags `ResultSink._pause` reads."""

    def __init__(self, connected: bool) -> None:
        self.is_connected = connected
        self.is_closed = False


@pytest.mark.unit
async def test_pause_before_a_resend_waits_for_the_reconnect_within_the_timeout() -> None:
    sink = ResultSink("nats://127.0.0.1:1", "results", "kv", "q", timeout=5.0)
    up = _Conn(connected=True)
    await asyncio.wait_for(sink._pause(up, 0.0), 1.0)  # connected: no wait beyond the pause

    down = _Conn(connected=False)
    pause = asyncio.ensure_future(sink._pause(down, 0.0))
    await asyncio.sleep(0.2)
    assert not pause.done()  # still disconnected: it waits
    down.is_connected = True
    await asyncio.wait_for(pause, 1.0)  # back: the resend goes

    gone = _Conn(connected=False)
    short = ResultSink("nats://127.0.0.1:1", "results", "kv", "q", timeout=0.2)
    await asyncio.wait_for(short._pause(gone, 0.0), 2.0)  # never back: gives up at timeout
