"""The jetstream source's read path (jobs/jetstream_read.py) without Spark: the by-column
conversion against the per-event rule, the wire parser's fast lane against any cut of the
byte stream, and whole ranges read from a real nats-server across several partitions."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.api import StreamConfig
from nats.protocol.parser import Parser

from jobs.jetstream_options import (
    MIN_SPLIT,
    JetStreamSourceError,
    SeqRange,
    SourceOptions,
    split_range,
)
from jobs.jetstream_read import (
    _MSG_ID,
    Chunk,
    _arrow_schema,
    binary_column,
    check_payload,
    chunk_to_batch,
    msg_ids,
    payload_columns,
    read_range,
    take_deliveries,
)
from runtime.data.json_depth import MAX_DEPTH, too_deep_at
from tests.support import NatsFactory, with_nats

pytestmark = pytest.mark.timeout(120)

# ---- payloads: by column == per event -----------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=8,
)
good_json = json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode())
payloads = st.one_of(
    good_json,
    good_json.flatmap(lambda b: st.integers(0, len(b)).map(lambda i: b[:i])),  # cut short
    good_json.map(lambda b: b[:1] + b"\xff\xfe" + b[1:]),  # not UTF-8 inside JSON
    st.text().map(str.encode),  # UTF-8, rarely JSON
    st.binary(max_size=40),  # often not UTF-8
    st.sampled_from([b"", b" ", b"{}", b"[1,2]", b"1,2", b"\xc3", b'"\xed\xa0\x80"', b"nul\x00"]),
    st.integers(500, 2500).map(lambda n: b"[" * n + b"]" * n),  # nested past the limit
)


@pytest.mark.unit
@given(st.lists(payloads, max_size=40), st.sampled_from(["json", "utf8"]))
@settings(max_examples=300, deadline=None)
def test_payload_columns_match_the_per_event_check(batch: list[bytes], validate: str) -> None:
    data, valid, error, raw = payload_columns(batch, validate)
    want = [check_payload(p, validate) for p in batch]
    assert data.to_pylist() == [text for text, _ in want]
    assert valid.to_pylist() == [err is None for _, err in want]
    assert error.to_pylist() == [err for _, err in want]
    assert raw.to_pylist() == [
        p if err is not None else None for p, (_, err) in zip(batch, want, strict=True)
    ]


@pytest.mark.unit
@given(st.lists(payloads, max_size=40))
@settings(max_examples=100, deadline=None)
def test_validate_none_keeps_every_event_as_text(batch: list[bytes]) -> None:
    data, valid, error, raw = payload_columns(batch, "none")
    assert data.to_pylist() == [p.decode("utf-8", "replace") for p in batch]
    assert valid.to_pylist() == [True] * len(batch)
    assert error.null_count == raw.null_count == len(batch)


def nested(depth: int, inner: bytes = b"1") -> bytes:
    """`inner` inside `depth` levels, alternating arrays and objects."""
    out = inner
    for level in range(depth):
        out = b"[" + out + b"]" if level % 2 else b'{"k":' + out + b"}"
    return out


@pytest.mark.unit
def test_an_event_nested_past_the_limit_is_malformed_at_its_bracket_never_a_crash() -> None:
    assert check_payload(nested(MAX_DEPTH), "json")[1] is None
    for depth in (MAX_DEPTH + 1, 900, 5000):  # 5000: msgspec itself ends in RecursionError
        payload = nested(depth)
        # every bracket opens before any closes: the one past the limit is the 513th
        at = [i for i, c in enumerate(payload) if c in b"[{"][MAX_DEPTH]
        assert too_deep_at(payload) == at
        want = f"payload is not JSON: JSON is malformed: nested deeper than {MAX_DEPTH} levels"
        assert check_payload(payload, "json")[1] == f"{want} (byte {at})"
        assert payload_columns([b"{}", payload], "json")[2].to_pylist() == [
            None,
            f"{want} (byte {at})",
        ]


@pytest.mark.unit
def test_brackets_inside_strings_and_escapes_do_not_count_as_depth() -> None:
    quoted = b'["' + b"[{" * 600 + b'\\"\\\\[", "\\u005b"]'
    assert check_payload(quoted, "json")[1] is None and too_deep_at(quoted) is None
    # a syntax fault before the level past the limit is the one named, as a reader finds it
    early = b'{"a" ' + nested(600)
    assert check_payload(early, "json")[1] == (
        "payload is not JSON: JSON is malformed: expected ':' (byte 5)"
    )
    late = b"[" * (MAX_DEPTH + 1) + b"}"
    assert check_payload(late, "json")[1] == (
        f"payload is not JSON: JSON is malformed: nested deeper than {MAX_DEPTH} levels "
        f"(byte {MAX_DEPTH})"
    )


# ---- chunks: reply subjects, headers, the range's end --------------------------------------

TS = 1795301006886081543


def v1(seq: int, pending: int = 5) -> bytes:
    return b"$JS.ACK.ev.tf-read-x.1.%d.%d.%d.%d" % (seq, seq, TS + seq, pending)


def v2(seq: int) -> bytes:
    return b"$JS.ACK.hub.ACCHASH.ev.cons.1.%d.%d.%d.0.tok" % (seq, seq, TS + seq)


@pytest.mark.unit
def test_chunk_columns_from_replies_and_headers() -> None:
    chunk = Chunk()
    chunk.append(b"raw.a", v1(3), b"NATS/1.0\r\nNats-Msg-Id: id-3\r\n\r\n", b'{"a":1}')
    chunk.append(b"raw.b", v1(7), None, b"[]")  # no headers: no id
    chunk.append(b"raw.a", v1(8), b"NATS/1.0\r\nOther: x\r\nNats-Msg-Id:id 8 \r\n\r\n", b"{")
    chunk.append(b"raw.a", v1(9), b"NATS/1.0\r\nOther: x\r\n\r\n", b"1")
    chunk.append(b"raw.a", v1(12), b"NATS/1.0\r\nNats-Msg-Id: past-end\r\n\r\n", b"1")
    batch = chunk_to_batch(chunk, "json", _arrow_schema(), end=12)
    rows = batch.to_pylist()
    assert [r["seq"] for r in rows] == [3, 7, 8, 9]  # 12 is past the range's end
    assert [r["subject"] for r in rows] == ["raw.a", "raw.b", "raw.a", "raw.a"]
    assert [r["msg_id"] for r in rows] == ["id-3", None, "id 8", None]
    assert [r["valid"] for r in rows] == [True, True, False, True]
    assert rows[2]["raw"] == b"{" and "not JSON" in rows[2]["error"]
    assert rows[0]["ts"].timestamp() == pytest.approx((TS + 3) / 1e9, abs=1e-6)

    two = Chunk()
    for seq in (41, 42):
        two.append(b"s", v2(seq), None, b"{}")
    assert chunk_to_batch(two, "json", _arrow_schema()).column("seq").to_pylist() == [41, 42]

    bad = Chunk()
    bad.append(b"s", b"_INBOX.abc", None, b"{}")
    with pytest.raises(JetStreamSourceError, match="_INBOX.abc"):
        chunk_to_batch(bad, "json", _arrow_schema())


@pytest.mark.unit
@given(st.lists(st.binary(max_size=30), max_size=40))
@settings(max_examples=100, deadline=None)
def test_binary_column_is_the_array_pyarrow_builds(values: list[bytes]) -> None:
    import pyarrow as pa

    built = binary_column(values)
    built.validate(full=True)
    assert built.equals(pa.array(values, pa.binary()))


# header blocks around a message id: the publisher's shape, and every near miss of it
id_text = st.text(alphabet=st.sampled_from(list("ab7-_. \t\r\n:")), max_size=8).map(str.encode)
ID_FIRST = b"NATS/1.0\r\nNats-Msg-Id: "
id_first_blocks = st.one_of(
    id_text.map(lambda i: ID_FIRST + i + b"\r\n\r\n"),
    st.tuples(id_text, id_text).map(lambda t: ID_FIRST + t[0] + b"\r\nNats-Batch-Id: " + t[1]),
    id_text.map(lambda i: ID_FIRST + i),  # no line end after the id
    st.none(),
)
header_blocks = st.one_of(
    id_first_blocks,
    id_text.map(lambda i: b"NATS/1.0\r\nOther: x\r\nNats-Msg-Id:" + i + b"\r\n\r\n"),
    id_text.map(lambda i: b"NATS/1.0\r\nnats-msg-id: " + i + b"\r\n\r\n"),
    st.binary(max_size=30),
)


@pytest.mark.unit
@given(
    st.lists(header_blocks, max_size=12),
    st.lists(id_first_blocks, max_size=12),
    st.lists(st.text(alphabet="ab7-_.", max_size=8), max_size=12),
)
@settings(max_examples=400, deadline=None)
def test_msg_ids_are_what_the_regex_finds(
    mixed: list[bytes | None], id_first: list[bytes | None], ids: list[str]
) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    plain = [ID_FIRST + i.encode() + b"\r\n\r\n" for i in ids]  # what publishers write
    for blocks in (mixed, id_first, plain):
        headers = pa.array(blocks, pa.binary())
        want = pc.struct_field(pc.extract_regex(headers, _MSG_ID), "id")
        assert msg_ids(headers).to_pylist() == want.to_pylist()
    assert msg_ids(pa.array(plain, pa.binary())).to_pylist() == [i.encode() for i in ids]


@pytest.mark.unit
@given(
    st.lists(payloads, min_size=1, max_size=40),
    st.sampled_from(["json", "utf8"]),
    st.integers(0, 45),
)
@settings(max_examples=200, deadline=None)
def test_invalid_only_keeps_exactly_the_malformed_rows_of_the_full_batch(
    batch: list[bytes], validate: str, cut: int
) -> None:
    """`invalidOnly` (the dead-letter query's source): the rows are those of the full
    conversion with ``valid`` false, unchanged and in order, cut at the range's end too."""
    chunk = Chunk()
    for i, payload in enumerate(batch):
        chunk.append(b"raw.%d" % (i % 3), v1(10 + 2 * i), None, payload)
    end = 10 + 2 * cut
    full = chunk_to_batch(chunk, validate, _arrow_schema(), end=end).to_pylist()
    only = chunk_to_batch(chunk, validate, _arrow_schema(), end=end, invalid_only=True)
    assert only.schema == _arrow_schema()
    assert only.to_pylist() == [r for r in full if not r["valid"]]


# ---- the wire parser's fast lane ------------------------------------------------------------


class FakeClient:
    """What the protocol parser calls back on a client; records everything."""

    def __init__(self) -> None:
        self._ps = Parser(self)
        self.passed: list[tuple[int, bytes, bytes, bytes, bytes | None]] = []
        self.pings = 0

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        self.passed.append((sid, subject, reply, data, headers))

    async def _process_ping(self) -> None:
        self.pings += 1

    async def _process_pong(self) -> None:
        pass


def frame(sid: int, subject: bytes, reply: bytes, headers: bytes | None, data: bytes) -> bytes:
    args = [subject, b"%d" % sid] + ([reply] if reply else [])
    if headers is None:
        return b"MSG " + b" ".join([*args, b"%d" % len(data)]) + b"\r\n" + data + b"\r\n"
    size = [b"%d" % len(headers), b"%d" % (len(headers) + len(data))]
    return b"HMSG " + b" ".join(args + size) + b"\r\n" + headers + data + b"\r\n"


messages = st.lists(
    st.tuples(
        st.sampled_from([1, 2]),  # sid 1 is taken, sid 2 goes on to nats-py
        st.sampled_from([b"raw.a", b"_INBOX.x"]),
        st.sampled_from([b"", v1(5)]),
        st.one_of(st.none(), st.just(b"NATS/1.0\r\nNats-Msg-Id: a\r\n\r\n")),
        st.binary(max_size=30),
    ),
    max_size=12,
)


@pytest.mark.unit
@given(messages, st.lists(st.integers(1, 60), max_size=20), st.booleans())
@settings(max_examples=200, deadline=None)
def test_wire_parser_takes_each_frame_once_however_the_bytes_are_cut(
    msgs: list[tuple[int, bytes, bytes, bytes | None, bytes]], cuts: list[int], ping: bool
) -> None:
    nc = FakeClient()
    taken: list[tuple[int, bytes, bytes, bytes | None, bytes]] = []

    def take(sid: int, subject: bytes, reply: bytes, headers: bytes | None, data: bytes) -> bool:
        if sid != 1:
            return False
        taken.append((sid, subject, reply, headers, data))
        return True

    take_deliveries(nc, take)  # type: ignore[arg-type]
    wire = b"".join(frame(*m) for m in msgs)
    if ping:  # another operation in the middle
        half = b"".join(frame(*m) for m in msgs[: len(msgs) // 2])
        wire = half + b"PING\r\n" + wire[len(half) :]

    async def feed() -> None:
        pos = 0
        for cut in cuts:
            await nc._ps.parse(wire[pos : pos + cut])
            pos += cut
        await nc._ps.parse(wire[pos:])

    asyncio.run(feed())
    assert taken == [m for m in msgs if m[0] == 1]
    assert nc.passed == [(s, subj, r, d, h) for s, subj, r, h, d in msgs if s != 1]
    assert nc.pings == int(ping)
    assert not nc._ps.buf


# ---- against nats-server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    return nats_factory(sync_interval="2m").url


N = 12_000
DELETED = {2, 3, 500, 4001, 4002, 7777, N}


@pytest.fixture(scope="module")
def gappy(nats_url: str) -> list[tuple[int, str, str | None, bytes]]:
    """Stream `gappy`: N events on raw.g.a / raw.g.b, every 5th without a msg id, some
    payloads malformed, then a few sequences deleted. Returns what remains, in order."""
    msgs = []
    for i in range(N):
        subject = f"raw.g.{'ab'[i % 4 == 0]}"
        payload = b"\xff bad" if i % 1000 == 7 else json.dumps({"i": i}).encode()
        msgs.append((i + 1, subject, None if i % 5 == 0 else f"g-{i}", payload))

    async def fill(nc: Client) -> None:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="gappy", subjects=["raw.g.>"]))
        futs = []
        for _, subject, mid, payload in msgs:
            headers = {"Nats-Msg-Id": mid} if mid else None
            futs.append(await js.publish_async(subject, payload, headers=headers))
        await asyncio.wait_for(asyncio.gather(*futs), 60)
        for seq in sorted(DELETED):
            await js.delete_msg("gappy", seq)

    with_nats(fill, nats_url)
    return [m for m in msgs if m[0] not in DELETED]


def read_all(opts: SourceOptions, start: int, end: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for part in split_range(start, end, opts.partition_size, opts.min_partitions):
        for batch in read_range(opts, part):
            rows.extend(batch.to_pylist())
    return rows


def test_a_range_over_several_partitions_delivers_every_retained_seq_once_in_order(
    nats_url: str, gappy: list[tuple[int, str, str | None, bytes]]
) -> None:
    opts = SourceOptions.parse(
        {"url": nats_url, "stream": "gappy", "partitionSize": "5000", "fetchBatch": "700"}
    )
    assert len(split_range(1, N + 1, opts.partition_size, opts.min_partitions)) == 3
    rows = read_all(opts, 1, N + 1)
    assert [r["seq"] for r in rows] == [m[0] for m in gappy]  # in order, gaps skipped
    assert [(r["subject"], r["msg_id"]) for r in rows] == [(m[1], m[2]) for m in gappy]
    bad = [r["seq"] for r in rows if not r["valid"]]
    assert bad == [m[0] for m in gappy if m[3] == b"\xff bad"]
    assert all(
        r["raw"] == b"\xff bad" and "not UTF-8" in r["error"] for r in rows if not r["valid"]
    )

    # a range starting and ending inside gaps, cut in two by minPartitions
    two = SourceOptions.parse({"url": nats_url, "stream": "gappy", "minPartitions": "2"})
    assert len(split_range(3, N, two.partition_size, two.min_partitions)) == 2
    assert [r["seq"] for r in read_all(two, 3, N)] == [m[0] for m in gappy if 3 <= m[0] < N]


def test_invalid_only_reads_the_malformed_events_of_the_range_alone(
    nats_url: str, gappy: list[tuple[int, str, str | None, bytes]]
) -> None:
    opts = SourceOptions.parse(
        {"url": nats_url, "stream": "gappy", "invalidOnly": "true", "fetchBatch": "900"}
    )
    bad = [m for m in gappy if m[3] == b"\xff bad"]
    assert len(bad) > 3
    rows = read_all(opts, 1, N + 1)
    assert [(r["seq"], r["subject"], r["msg_id"], r["raw"]) for r in rows] == bad
    assert all(not r["valid"] and "not UTF-8" in r["error"] and r["data"] is None for r in rows)
    # a range holding none of them yields nothing; one ending right after one yields it
    assert read_all(opts, bad[0][0] + 1, bad[1][0]) == []
    assert [r["seq"] for r in read_all(opts, bad[1][0], bad[1][0] + 1)] == [bad[1][0]]


@pytest.mark.unit
def test_invalid_only_option_parses_and_refuses_what_cannot_hold_an_invalid_event() -> None:
    base = {"url": "nats://127.0.0.1:4222", "stream": "s"}
    assert SourceOptions.parse(base).invalid_only is False
    assert SourceOptions.parse({**base, "invalidOnly": "TRUE"}).invalid_only is True
    assert SourceOptions.parse({**base, "invalidOnly": "false"}).invalid_only is False
    with pytest.raises(JetStreamSourceError, match="invalidOnly"):
        SourceOptions.parse({**base, "invalidOnly": "yes"})
    with pytest.raises(JetStreamSourceError, match="invalidOnly"):
        SourceOptions.parse({**base, "invalidOnly": "true", "validate": "none"})


def test_a_filter_subject_reads_only_its_events_across_partitions(
    nats_url: str, gappy: list[tuple[int, str, str | None, bytes]]
) -> None:
    opts = SourceOptions.parse(
        {
            "url": nats_url,
            "stream": "gappy",
            "subject": "raw.g.b",
            "partitionSize": "4000",
            "fetchBatch": "1000",
        }
    )
    rows = read_all(opts, 1, N + 1)
    assert [r["seq"] for r in rows] == [m[0] for m in gappy if m[1] == "raw.g.b"]
    assert {r["subject"] for r in rows} == {"raw.g.b"}
    # a range whose pulls run past its end (the filter skips sequences): cut at the end
    rows = read_all(opts, 101, 1101)
    assert [r["seq"] for r in rows] == [
        m[0] for m in gappy if m[1] == "raw.g.b" and 101 <= m[0] < 1101
    ]


@pytest.mark.unit
@given(st.integers(1, 10**6), st.integers(0, 60_000), st.integers(50, 30_000), st.integers(1, 4))
@settings(deadline=None)
def test_split_range_covers_the_range_once_and_honours_min_partitions(
    start: int, span: int, size: int, min_parts: int
) -> None:
    parts = split_range(start, start + span, size, min_parts)
    assert [p.start for p in parts[1:]] == [p.end for p in parts[:-1]]  # consecutive
    assert (parts[0].start, parts[-1].end) == (start, start + span) if span else parts == []
    assert all(0 < p.end - p.start <= size for p in parts)
    if span >= min_parts * MIN_SPLIT:
        assert len(parts) >= min_parts
    if 0 < span < 2 * MIN_SPLIT and span <= size:
        assert len(parts) == 1  # never cut below MIN_SPLIT sequences a part


def test_the_source_imports_nats_without_aiohttp_and_brings_it_back_for_websockets() -> None:
    """Spark starts fresh processes for the source; nats-py's websocket transport (aiohttp)
    is left out of them unless a ws:// URL asks for it."""
    import subprocess
    import sys

    code = (
        "import sys, jobs.jetstream, jobs.jetstream_read\n"
        "import nats.aio.transport as t\n"
        "print('aiohttp' in sys.modules, t.aiohttp is None)\n"
        "jobs.jetstream_options.websocket_ready('nats://127.0.0.1:4222')\n"
        "print('aiohttp' in sys.modules)\n"
        "jobs.jetstream_options.websocket_ready('nats://a:1,ws://127.0.0.1:8080')\n"
        "print('aiohttp' in sys.modules, t.aiohttp is sys.modules.get('aiohttp'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split("\n")[:3] == ["False True", "False", "True True"]


# ---- pulls capped by bytes: events at the server's max payload -----------------------------

BIG_PAYLOAD = 64 * 1024
BIG_N = 30
BIG_BAD = {4, 17, 29}  # not UTF-8


@pytest.fixture(scope="module")
def big(nats_factory: NatsFactory) -> tuple[str, list[tuple[int, str, bytes]]]:
    """A server with max_payload 64 KiB and stream `big`: BIG_N events each exactly as large
    as the server takes (headers included), those at BIG_BAD malformed. Returns the URL and
    (seq, msg id, payload) in order."""
    url = nats_factory(sync_interval="2m", max_payload=BIG_PAYLOAD).url
    msgs = []
    for i in range(BIG_N):
        mid = f"big-{i:03d}"
        room = BIG_PAYLOAD - len(f"NATS/1.0\r\nNats-Msg-Id: {mid}\r\n\r\n")
        if i in BIG_BAD:
            payload = b"\xff" * room
        else:
            head = b'{"i":%d,"pad":"' % i
            payload = head + b"x" * (room - len(head) - 2) + b'"}'
        assert len(payload) == room
        msgs.append((i + 1, mid, payload))

    async def fill(nc: Client) -> None:
        assert nc.max_payload == BIG_PAYLOAD
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="big", subjects=["raw.big"]))
        for _, mid, payload in msgs:  # one at a time: 2 MB in flight is not the point here
            await js.publish("raw.big", payload, headers={"Nats-Msg-Id": mid})

    with_nats(fill, url)
    return url, msgs


def read_counting(
    opts: SourceOptions, start: int, end: int, fetcher_class: Any = None, chunks: Any = None
) -> tuple[list[dict[str, Any]], Any]:
    """(rows, the fetcher, for its counts) of one partition read through a `_RangeFetcher`
    (or `fetcher_class`), as `read_range` drives it; each chunk also goes into `chunks`."""
    from jobs.jetstream_read import _process, _RangeFetcher, _run

    proc = _process()
    cls = fetcher_class or _RangeFetcher
    fetcher = cls(opts, SeqRange(start, end), shared=proc.client(opts.nats))
    rows: list[dict[str, Any]] = []
    try:
        _run(proc.loop, fetcher.open(), 30)
        while (chunk := _run(proc.loop, fetcher.next_chunk(), 30)) is not None:
            if chunks is not None:
                chunks.append(chunk)
            rows.extend(chunk_to_batch(chunk, opts.validate, _arrow_schema(), end).to_pylist())
    finally:
        _run(proc.loop, fetcher.close(), 30)
    return rows, fetcher


def test_a_consumer_on_a_replica_behind_the_leader_does_not_end_the_range_short(
    nats_url: str, gappy: list[tuple[int, str, str | None, bytes]]
) -> None:
    """An R1 consumer may sit on a replica still catching up with the stream's leader (a
    server back from a partition): it answers nothing pending where the stream goes on.
    The reader asks the leader and reads on from a new consumer: nothing is skipped."""
    from jobs.jetstream_read import _RangeFetcher

    held = 1000  # how far the first consumer's replica holds the stream

    class Lagging(_RangeFetcher):
        def _advance(self) -> None:
            super()._advance()
            if self.consumers_started == 1 and not self._finished and self._next_seq > held:
                self._finished = self._short = True  # its answer: nothing pending here

    opts = SourceOptions.parse({"url": nats_url, "stream": "gappy", "fetchBatch": "500"})
    rows, fetcher = read_counting(opts, 1, N + 1, Lagging)
    assert [r["seq"] for r in rows] == [m[0] for m in gappy]
    assert (fetcher.lagging_replicas, fetcher.consumers_started) == (1, 2)


def test_a_range_ending_in_deleted_or_other_subjects_ends_without_a_new_consumer(
    nats_url: str, gappy: list[tuple[int, str, str | None, bytes]]
) -> None:
    """Nothing pending before the range's end is the end when the leader agrees: the last
    sequence deleted, or a filter whose subject has no more events in the range."""
    opts = SourceOptions.parse({"url": nats_url, "stream": "gappy"})
    rows, fetcher = read_counting(opts, 1, N + 1)  # N itself is deleted
    assert [r["seq"] for r in rows] == [m[0] for m in gappy]
    assert (fetcher.lagging_replicas, fetcher.consumers_started) == (0, 1)
    only_a = SourceOptions.parse({"url": nats_url, "stream": "gappy", "subject": "raw.g.a"})
    last_a = max(m[0] for m in gappy if m[1] == "raw.g.a")
    rows, fetcher = read_counting(only_a, 1, last_a + 3)
    assert [r["seq"] for r in rows] == [m[0] for m in gappy if m[1] == "raw.g.a"]
    assert (fetcher.lagging_replicas, fetcher.consumers_started) == (0, 1)


def test_pulls_capped_by_bytes_end_early_and_go_on_without_a_new_consumer(
    big: tuple[str, list[tuple[int, str, bytes]]], caplog: pytest.LogCaptureFixture
) -> None:
    url, msgs = big
    # 200,000 bytes hold three of these events: the fourth ends each pull with a 409
    opts = SourceOptions.parse({"url": url, "stream": "big", "fetchMaxBytes": "200000"})
    batches = list(read_range(opts, SeqRange(1, BIG_N + 1)))
    rows = [r for b in batches for r in b.to_pylist()]
    assert [(r["seq"], r["msg_id"]) for r in rows] == [(m[0], m[1]) for m in msgs]
    assert [r["data"].encode() if r["valid"] else r["raw"] for r in rows] == [m[2] for m in msgs]
    assert [b.num_rows for b in batches] == [3] * (BIG_N // 3)
    assert "starting a new consumer" not in caplog.text

    rows, fetcher = read_counting(opts, 2, BIG_N)
    assert [r["seq"] for r in rows] == list(range(2, BIG_N))
    assert fetcher.consumers_started == 1 and fetcher.pulls_cut_by_bytes == 9
    # the reader's count of a pull's bytes is the server's (its 409 says what was left)
    assert "bytes left of a pull" not in caplog.text

    # an option below one event's size is raised to the server's max_payload: still moving
    small = SourceOptions.parse({"url": url, "stream": "big", "fetchMaxBytes": "1000"})
    rows, fetcher = read_counting(small, 1, BIG_N + 1)
    assert [r["seq"] for r in rows] == [m[0] for m in msgs]
    assert fetcher.consumers_started == 1 and fetcher.pulls_cut_by_bytes == BIG_N - 1
    assert "bytes left of a pull" not in caplog.text


def test_an_event_bigger_than_the_pull_cap_is_fetched_alone(
    big: tuple[str, list[tuple[int, str, bytes]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event stored before max_payload was lowered (here: a cap not raised to it) ends
    every capped pull before it; the reader asks for it alone instead of stalling."""
    url, msgs = big
    monkeypatch.setattr("jobs.jetstream_read.pull_max_bytes", lambda option, max_payload: option)
    opts = SourceOptions.parse({"url": url, "stream": "big", "fetchMaxBytes": "1000"})
    rows, fetcher = read_counting(opts, 1, 8)
    assert [(r["seq"], r["raw"] or r["data"].encode()) for r in rows] == [
        (m[0], m[2]) for m in msgs[:7]
    ]
    assert fetcher.consumers_started == 1 and fetcher.pulls_cut_by_bytes == 7


def delivery_sizes(url: str) -> dict[int, int]:
    """Each event's cost against a pull's max_bytes as nats-server counts it (consumer.go:
    subject + ack reply + headers + payload), for a consumer starting at sequence 1, where
    the delivery count in the reply is the stream sequence."""
    chunks: list[Chunk] = []
    read_counting(SourceOptions.parse({"url": url, "stream": "big"}), 1, BIG_N + 1, None, chunks)
    return {
        int(r.split(b".")[5]): len(s) + len(r) + len(h or b"") + len(p)
        for c in chunks
        for s, r, h, p in zip(c.subjects, c.replies, c.headers, c.payloads, strict=True)
    }


def server_pull_ends(sizes: dict[int, int], cap: int, end: int) -> list[str]:
    """How nats-server ends each pull of a reader over [1, end) capped at `cap` bytes
    (consumer.go `nextWaiting`: a message that fits takes its bytes, and at exactly zero left
    the request ends with it and no status; one that does not fit ends it with a 409), the
    reader starting a new consumer after each pull it ends at zero."""
    ends, seq, dseq = [], 1, 1
    while seq < end:
        left = cap
        while seq < end:
            size = sizes[seq] - len(str(seq)) + len(str(dseq))  # the delivery count's digits
            if size > left:
                ends.append("409")
                break
            left -= size
            seq, dseq = seq + 1, dseq + 1
            if left == 0:
                ends.append("zero")
                dseq = 1
                break
        else:
            ends.append("last")
    return ends


def test_a_pull_filled_to_exactly_its_byte_cap_ends_without_a_status_and_loses_nothing(
    big: tuple[str, list[tuple[int, str, bytes]]], caplog: pytest.LogCaptureFixture
) -> None:
    """nats-server ends a pull filled to exactly max_bytes with no status: the reader ends
    it on its own count (no wait for a timeout) and goes on with a new consumer."""
    url, msgs = big
    sizes = delivery_sizes(url)
    cap = sizes[1] + sizes[2] + sizes[3]
    expected = server_pull_ends(sizes, cap, BIG_N + 1)
    assert expected[:2] == ["zero", "zero"] and "409" in expected  # both ways a pull ends
    opts = SourceOptions.parse({"url": url, "stream": "big", "fetchMaxBytes": str(cap)})
    rows, fetcher = read_counting(opts, 1, BIG_N + 1)
    assert [(r["seq"], r["msg_id"]) for r in rows] == [(m[0], m[1]) for m in msgs]
    assert fetcher.pulls_ended_at_zero == expected.count("zero")
    assert fetcher.pulls_cut_by_bytes == expected.count("409")
    zero_then_more = sum(e == "zero" for e in expected[:-1])
    assert fetcher.consumers_started == 1 + zero_then_more
    assert "starting a new consumer" not in caplog.text  # no pull waited for its timeout
    assert "bytes left of a pull" not in caplog.text


def test_a_pull_ended_on_a_byte_count_short_of_the_servers_skips_nothing(
    big: tuple[str, list[tuple[int, str, bytes]]],
) -> None:
    """A reader whose count reaches zero while the server still has room for three more
    events (its count short by their size): the server goes on filling that pull, and the
    next pull's new consumer starts right after the last event taken, so every event is
    read once."""
    from jobs.jetstream_read import _RangeFetcher

    url, msgs = big
    sizes = delivery_sizes(url)
    short = sizes[4] + sizes[5] + sizes[6]

    class ShortCount(_RangeFetcher):
        async def _pull(self) -> None:
            await super()._pull()
            if self.consumers_started == 1 and self._bytes_left is not None:
                self._bytes_left -= short  # the first consumer's pulls only

    cap = sum(sizes[s] for s in range(1, 7))
    opts = SourceOptions.parse({"url": url, "stream": "big", "fetchMaxBytes": str(cap)})
    rows, fetcher = read_counting(opts, 1, BIG_N + 1, ShortCount)
    assert [(r["seq"], r["msg_id"]) for r in rows] == [(m[0], m[1]) for m in msgs]
    assert fetcher.pulls_ended_at_zero >= 1 and fetcher.consumers_started >= 2


def test_invalid_only_through_byte_capped_pulls_yields_the_big_malformed_events_alone(
    big: tuple[str, list[tuple[int, str, bytes]]], caplog: pytest.LogCaptureFixture
) -> None:
    url, msgs = big
    opts = SourceOptions.parse(
        {"url": url, "stream": "big", "invalidOnly": "true", "fetchMaxBytes": "200000"}
    )
    rows = [r for b in read_range(opts, SeqRange(1, BIG_N + 1)) for r in b.to_pylist()]
    bad = [m for m in msgs if m[0] - 1 in BIG_BAD]
    assert [(r["seq"], r["msg_id"], r["raw"]) for r in rows] == bad
    assert all(not r["valid"] and "not UTF-8" in r["error"] for r in rows)
    assert "starting a new consumer" not in caplog.text


@pytest.mark.unit
def test_the_pull_byte_cap_always_holds_one_event_the_server_accepts() -> None:
    from jobs.jetstream_options import DEFAULT_FETCH_MAX_BYTES, PULL_BYTES_SLACK, pull_max_bytes

    base = {"url": "nats://127.0.0.1:4222", "stream": "s"}
    assert SourceOptions.parse(base).fetch_max_bytes == DEFAULT_FETCH_MAX_BYTES
    assert SourceOptions.parse({**base, "fetchMaxBytes": "5000"}).fetch_max_bytes == 5000
    for bad in ("0", "-1", "lots", "1.5"):
        with pytest.raises(JetStreamSourceError, match="fetchMaxBytes"):
            SourceOptions.parse({**base, "fetchMaxBytes": bad})
    assert pull_max_bytes(DEFAULT_FETCH_MAX_BYTES, 1 << 20) == DEFAULT_FETCH_MAX_BYTES
    assert pull_max_bytes(1000, 1 << 20) == (1 << 20) + PULL_BYTES_SLACK
    assert pull_max_bytes(1000, 64 << 20) == (64 << 20) + PULL_BYTES_SLACK  # a raised limit
