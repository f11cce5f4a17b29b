"""The JVM jetstream source (jobs/jvm, jobs/jvm_source.py) against a real nats-server and Spark:
the same rows, offsets and errors as the Python source, over what a stranger's stream holds."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig

from jobs.jetstream import register
from jobs.jetstream_read import check_payload
from jobs.jvm_source import CHOICE_KEY, JVM_FORMAT, PYTHON_FORMAT, jvm_loaded, speaks, stream_format
from runtime.certs import make_dev_certs
from runtime.engines.source_jar import with_source_jar
from runtime.nats.endpoint import NatsEndpoint
from tests.support import NatsFactory, delete_consumers, with_nats

pytestmark = pytest.mark.timeout(300)

COLUMNS = ("seq", "subject", "ts", "msg_id", "data", "valid", "error", "raw")


@pytest.mark.unit
def test_the_jvm_source_speaks_plain_and_tls_urls_not_creds_or_websockets() -> None:
    assert speaks(NatsEndpoint(url="nats://127.0.0.1:4222", token="t"))
    assert speaks(NatsEndpoint(url="tls://a:4222,nats://b:4222", user="u", password="p"))
    assert not speaks(NatsEndpoint(url="nats://127.0.0.1:4222", creds="/x.creds"))
    assert not speaks(NatsEndpoint(url="nats://a:4222,WSS://b:443"))


@pytest.mark.unit
def test_the_jar_joins_spark_jars_once_and_only_when_it_is_built(tmp_path: Path) -> None:
    jar = tmp_path / "source.jar"
    assert with_source_jar({"spark.jars": "/a.jar"}, jar) == {"spark.jars": "/a.jar"}
    jar.write_bytes(b"PK")
    once = with_source_jar({"spark.jars": "/a.jar"}, jar)
    assert once == {"spark.jars": f"/a.jar,{jar}"}
    assert with_source_jar(once, jar) == once
    assert with_source_jar({}, jar) == {"spark.jars": str(jar)}


async def _publish(nc: Client, msgs: list[tuple[str, bytes, dict[str, str] | None]]) -> None:
    js = nc.jetstream()
    futs = [await js.publish_async(s, p, headers=h) for s, p, h in msgs]
    await asyncio.wait_for(asyncio.gather(*futs), 60)


def publish(url: str, msgs: list[tuple[str, bytes, dict[str, str] | None]]) -> None:
    with_nats(lambda nc: _publish(nc, msgs), url)


def add_stream(url: str, name: str, subjects: list[str], **kw: Any) -> None:
    async def go(nc: Client) -> None:
        await nc.jetstream().add_stream(StreamConfig(name=name, subjects=subjects, **kw))

    with_nats(go, url)


@pytest.fixture(scope="module")
def sp(spark: Any) -> Any:
    register(spark)
    assert jvm_loaded(spark), "the JVM source's jar is not on spark.jars: run `tierflow check`"
    return spark


def read_all(sp: Any, fmt: str, ckpt: Path, options: dict[str, str]) -> list[tuple[Any, ...]]:
    """Every row an availableNow query of `fmt` reads (from its checkpoint on), by sequence."""
    reader = sp.readStream.format(fmt)
    for k, v in options.items():
        reader = reader.option(k, v)
    rows: list[tuple[Any, ...]] = []

    def collect(df: Any, batch_id: int) -> None:
        rows.extend(tuple(r) for r in df.collect())

    q = (
        reader.load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180)
        if q.exception() is not None:
            raise RuntimeError(str(q.exception()))
    finally:
        q.stop()
    return sorted(tuple(bytes(v) if isinstance(v, bytearray) else v for v in r) for r in rows)


def both(sp: Any, tmp: Path, **options: str) -> tuple[list[Any], list[Any]]:
    return (
        read_all(sp, JVM_FORMAT, tmp / "jvm", options),
        read_all(sp, PYTHON_FORMAT, tmp / "py", options),
    )


@pytest.fixture(scope="module")
def server(nats_factory: NatsFactory) -> Any:
    return nats_factory(sync_interval="2m", max_payload=64 * 1024)


MALFORMED = [
    b'{"a" 1}',
    b"[1,2,]",
    b'{"a":1,}',
    b'"\\ud800"',
    b'"\\udc00"',
    b'{"a":"\\q"}',
    b"nulx",
    b'{"a":1} x',
    b"-01",
    b'{"t":"\xe2\x9c"}',  # a character cut short inside
    b'{"t":"\xe2\x9c',  # ... and at the end
    b'"\xed\xa0\x80"',  # a surrogate in UTF-8
    b"\xf0\x90\x80",
    b"[" * 600 + b"]" * 600,
    b"[" * 3000,
]


@pytest.fixture(scope="module")
def odd(server: Any) -> list[tuple[str, bytes, dict[str, str] | None]]:
    """A stranger's stream: ids on some events, none on others, the same id on two
    subjects, ids with spaces around them and another header first, malformed JSON of every
    kind (nested past the depth limit too), bytes that are not UTF-8 (cut short, a
    surrogate), an empty payload, multi-byte text, and events at the server's max_payload,
    far above the pull's byte cap the reads set."""
    url = server.url
    add_stream(url, "odd", ["in.>"])
    # payload and headers within the limit together (the id header takes about 30 bytes)
    big = json.dumps({"pad": "x" * (64 * 1024 - 100)}).encode()
    msgs: list[tuple[str, bytes, dict[str, str] | None]] = []
    for i in range(3000):
        subject = f"in.{'abc'[i % 3]}"
        fields = {"i": i, "k": f"k{i % 5}", "t": "zürich ✓"}
        payload = json.dumps(fields, ensure_ascii=False).encode()
        headers: dict[str, str] | None = {"Nats-Msg-Id": f"id-{i}"} if i % 4 else None
        if i % 97 == 0:
            payload = b"{not json"
        if i % 101 == 0:
            payload = b"\xff\xfe\x00bad"
        if i % 211 == 0:
            payload = b""
        if i % 199 == 3:
            payload = MALFORMED[(i // 199) % len(MALFORMED)]
        if i % 113 == 0:
            headers = {"Other": "1", "Nats-Msg-Id": f"  spaced-{i}\t"}
        if i % 500 == 7:
            payload = big
        msgs.append((subject, payload, headers))
    msgs.append(("in.a", b'{"same":1}', {"Nats-Msg-Id": "shared"}))
    msgs.append(("in.b", b'{"same":2}', {"Nats-Msg-Id": "shared-too"}))
    publish(url, msgs)
    return msgs


def test_rows_equal_the_python_sources_for_every_shape_of_event(
    sp: Any, server: Any, odd: list[Any], tmp_path: Path
) -> None:
    base = {"url": server.url, "stream": "odd", "fetchMaxBytes": "4096", "fetchBatch": "700"}
    jvm, py = both(sp, tmp_path / "all", **base, maxEventsPerTrigger="900", partitionSize="400")
    assert len(jvm) == len(odd)
    assert jvm == py  # every column, the words of every error too
    by_seq = {r[0]: dict(zip(COLUMNS, r, strict=True)) for r in jvm}
    assert by_seq[114]["msg_id"] == "spaced-113"
    assert by_seq[5]["msg_id"] is None  # no header at all
    assert by_seq[8]["data"].startswith('{"pad"')  # an event at max_payload came through
    bad = by_seq[102]
    assert not bad["valid"] and bad["data"] is None and bad["raw"] == b"\xff\xfe\x00bad"
    assert bad["error"] == (
        "payload is not UTF-8: 'utf-8' codec can't decode byte 0xff in position 0: "
        "invalid start byte"
    )
    assert by_seq[98]["error"] == ("payload is not JSON: JSON is malformed: expected '\"' (byte 1)")
    assert by_seq[98]["raw"] == b"{not json"
    reasons = {r["error"] for r in by_seq.values() if r["error"]}
    assert any("nested deeper than 512 levels" in e for e in reasons)
    assert any("unexpected end of data" in e for e in reasons)
    assert by_seq[2]["data"].endswith('"t": "z\u00fcrich \u2713"}')


def mutants(seed: int, count: int) -> list[bytes]:
    """Payloads a byte or a few away from JSON, or not UTF-8: inserted, replaced, deleted
    and cut, from an alphabet of JSON's own bytes and the ones UTF-8 gets wrong."""
    rng = random.Random(seed)
    docs = [
        b'{"a":1,"b":[1,2.5e-3,{"c":"x\\u00e9\\ud83d\\ude00"}],"d":null,"e":true,"f":false}',
        b'{"t":"z\xc3\xbcrich \xe2\x9c\x93 \xf0\x9f\x98\x80"}',
        b'[[[[1]]], -0.5E+10, "\\"\\\\\\/\\b\\f\\n\\r\\t"]',
    ]
    alphabet = b'{}[]:,"\\ -+.eE019afnlrstu\t\r\n\x00\x1f\x7f'
    alphabet += b"\x80\xbf\xc0\xc2\xe0\xed\xa0\xf0\xf4\x90\xff"
    out = []
    for _ in range(count):
        p = bytearray(rng.choice(docs))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(p) + 1)
            kind = rng.randrange(4)
            if kind == 0 and p:
                del p[min(i, len(p) - 1)]
            elif kind == 1:
                p[i:i] = bytes([rng.choice(alphabet)])
            elif kind == 2 and p:
                p[min(i, len(p) - 1)] = rng.choice(alphabet)
            else:
                del p[i:]
        out.append(bytes(p))
    return out


def test_the_payload_check_words_every_fault_as_the_python_source_does(sp: Any) -> None:
    """The check a task runs on each payload, against `check_payload` over thousands of
    near-JSON payloads: the same verdict and the same words (msgspec's for JSON, CPython's
    for UTF-8), so a dead-letter reason does not depend on which source read the event; and
    the same U+FFFD where text is kept without validation."""
    probe = sp.sparkContext._jvm.io.tierflow.jetstream.RangeProbe
    cases = [*mutants(11, 4000), *MALFORMED, b"", b" ", b"[" * 512 + b"]" * 512]
    differ = []
    for payload in cases:
        for validate in ("json", "utf8"):
            want = check_payload(payload, validate)[1]
            got = probe.payloadError(bytearray(payload), validate)
            if got != want:
                differ.append((payload, validate, want, got))
        text = payload.decode("utf-8", "replace")  # the row's text with validate=none
        if probe.asText(bytearray(payload)) != text:
            differ.append((payload, "none", text, probe.asText(bytearray(payload))))
    assert not differ, differ[:5]
    assert sum(check_payload(p, "json")[1] is None for p in cases) > 100  # some stayed JSON


@pytest.mark.parametrize(
    "options",
    [
        {"subject": "in.a,in.c", "validate": "utf8"},
        {"subject": "in.b", "invalidOnly": "true"},
        {"validate": "none", "startingOffset": "1500"},
    ],
    ids=["two-subjects-utf8", "invalid-only", "no-validation-from-1500"],
)
def test_filters_validation_and_start_read_as_the_python_source_does(
    sp: Any, server: Any, odd: list[Any], tmp_path: Path, options: dict[str, str]
) -> None:
    jvm, py = both(sp, tmp_path, url=server.url, stream="odd", **options)
    assert jvm == py and jvm
    if "subject" in options:
        assert {r[1] for r in jvm} <= set(options["subject"].split(","))
    if options.get("invalidOnly"):
        assert not any(r[5] for r in jvm)


def test_a_checkpoint_moves_between_the_sources_without_gap_or_repeat(
    sp: Any, server: Any, tmp_path: Path
) -> None:
    add_stream(server.url, "handoff", ["handoff"])
    publish(server.url, [("handoff", b'{"n":%d}' % i, None) for i in range(1000)])
    ckpt = tmp_path / "ck"
    opts = {"url": server.url, "stream": "handoff", "maxEventsPerTrigger": "300"}
    first = read_all(sp, PYTHON_FORMAT, ckpt, opts)
    publish(server.url, [("handoff", b'{"n":%d}' % i, None) for i in range(1000, 1700)])
    second = read_all(sp, JVM_FORMAT, ckpt, opts)
    publish(server.url, [("handoff", b'{"n":%d}' % i, None) for i in range(1700, 2000)])
    third = read_all(sp, PYTHON_FORMAT, ckpt, opts)
    assert [r[0] for r in first + second + third] == list(range(1, 2001))


def test_aged_out_and_missing_streams_fail_with_the_python_sources_words(
    sp: Any, server: Any, tmp_path: Path
) -> None:
    add_stream(server.url, "short", ["short"], max_msgs=100)
    publish(server.url, [("short", b"{}", None) for _ in range(50)])
    ckpt = tmp_path / "ck"
    opts = {"url": server.url, "stream": "short"}
    assert len(read_all(sp, JVM_FORMAT, ckpt, opts)) == 50
    publish(server.url, [("short", b"{}", None) for _ in range(300)])
    with pytest.raises(Exception, match=r"'short': start sequence 51 has aged out.*is 251"):
        read_all(sp, JVM_FORMAT, ckpt, opts)
    rows = read_all(sp, JVM_FORMAT, ckpt, {**opts, "onAgedOut": "skip"})
    assert [r[0] for r in rows] == list(range(251, 351))
    with pytest.raises(Exception, match="stream 'nosuch' does not exist"):
        read_all(sp, JVM_FORMAT, tmp_path / "none", {**opts, "stream": "nosuch"})


def test_tls_with_a_client_certificate_a_password_and_a_jetstream_domain(
    sp: Any, nats_factory: NatsFactory, tmp_path: Path
) -> None:
    """Mutual TLS and a user: the handshake and CONNECT as nats-py makes them; a domain
    makes the server send deliveries' reply subjects in their longer form."""
    certs = make_dev_certs(tmp_path / "certs", [])
    server = nats_factory(
        user="reader",
        password="s3cret pass",
        tls_cert=str(certs.cert),
        tls_key=str(certs.key),
        tls_ca=str(certs.ca),
        tls_verify=True,
        js_domain="hub",
    )
    conn = {
        "user": "reader",
        "password": "s3cret pass",
        "tls_ca": str(certs.ca),
        "tls_cert": str(certs.client_cert),
        "tls_key": str(certs.client_key),
    }
    ep = NatsEndpoint(url=server.url, **conn)

    async def go(nc: Client) -> None:
        await nc.jetstream().add_stream(StreamConfig(name="secure", subjects=["sec.*"]))
        await _publish(nc, [(f"sec.{i % 2}", b'{"i":%d}' % i, None) for i in range(2500)])

    async def run() -> None:
        nc = await ep.connect()
        try:
            await go(nc)
        finally:
            await nc.close()

    asyncio.run(run())
    options = {**ep.to_options(), "stream": "secure"}
    jvm, py = both(sp, tmp_path, **options)
    assert len(jvm) == 2500 and jvm == py
    wrong = {**options, "password": "wrong"}
    with pytest.raises(Exception, match="(?i)authorization"):
        read_all(sp, JVM_FORMAT, tmp_path / "wrong", wrong)


def test_a_token_server_is_read_with_its_token_and_refuses_a_wrong_one(
    sp: Any, nats_factory: NatsFactory, tmp_path: Path
) -> None:
    """Token auth, the third way a stranger's server asks who connects: the JVM source's
    CONNECT carries `auth_token` as nats-py's does."""
    server = nats_factory(extra_conf=['authorization { token: "t0k en/=" }'])
    ep = NatsEndpoint(url=server.url, token="t0k en/=")

    async def run() -> None:
        nc = await ep.connect()
        try:
            await nc.jetstream().add_stream(StreamConfig(name="tok", subjects=["tok"]))
            await _publish(nc, [("tok", b'{"i":%d}' % i, None) for i in range(1200)])
        finally:
            await nc.close()

    asyncio.run(run())
    options = {**ep.to_options(), "stream": "tok"}
    assert speaks(ep)
    jvm, py = both(sp, tmp_path, **options)
    assert len(jvm) == 1200 and jvm == py
    with pytest.raises(Exception, match="(?i)authorization"):
        read_all(sp, JVM_FORMAT, tmp_path / "wrong", {**options, "token": "nope"})
    with pytest.raises(Exception, match="(?i)authorization"):
        anonymous = {k: v for k, v in options.items() if k != "token"}
        read_all(sp, JVM_FORMAT, tmp_path / "none", anonymous)


def test_jobs_read_through_the_jvm_source_unless_the_session_says_python(
    sp: Any, server: Any
) -> None:
    ep = NatsEndpoint(url=server.url)
    assert stream_format(sp, ep) == JVM_FORMAT
    assert stream_format(sp, NatsEndpoint(url=server.url, creds="/x.creds")) == PYTHON_FORMAT
    sp.conf.set(CHOICE_KEY, "python")
    try:
        assert stream_format(sp, ep) == PYTHON_FORMAT
    finally:
        sp.conf.unset(CHOICE_KEY)


def test_a_lost_consumer_is_replaced_without_gap_or_repeat(sp: Any, server: Any) -> None:
    """The reader's consumer deleted mid-range (a server restart loses in-memory consumers):
    the pulls answered "consumer deleted" (or not at all) bring a new consumer from the next
    sequence, and the range reads on with nothing missed or repeated."""
    add_stream(server.url, "lost", ["lost"])
    publish(server.url, [("lost", b'{"n":%d}' % i, None) for i in range(5000)])
    jvm = sp.sparkContext._jvm
    options = {"url": server.url, "stream": "lost", "fetchBatch": "200", "timeout": "2"}
    probe = jvm.io.tierflow.jetstream.RangeProbe(options, 1, 5001)

    seqs: list[int] = []
    try:
        for _ in range(6000):  # bounded: the range holds 5000
            seq = probe.next()
            if seq < 0:
                break
            seqs.append(seq)
            if len(seqs) == 1500:
                assert delete_consumers(server.url, "lost") == 1
        consumers = probe.consumers()
    finally:
        probe.close()
    assert seqs == list(range(1, 5001))
    assert consumers >= 2


def test_a_range_ending_in_deleted_or_other_subjects_ends_with_one_consumer(
    sp: Any, server: Any
) -> None:
    """Nothing pending before the range's end is its end when the stream's leader agrees:
    the last sequences deleted, or a filter whose subject has no more events in the range.
    The reader asks the leader once and starts no second consumer."""
    add_stream(server.url, "gaps", ["gaps.*"])
    publish(server.url, [(f"gaps.{'ab'[i % 5 == 0]}", b'{"i":%d}' % i, None) for i in range(600)])

    async def delete(nc: Client) -> None:
        js = nc.jetstream()
        for seq in [*range(100, 110), *range(590, 601)]:
            await js.delete_msg("gaps", seq)

    with_nats(delete, server.url)
    jvm = sp.sparkContext._jvm

    def read(end: int, **extra: str) -> tuple[list[int], int]:
        probe = jvm.io.tierflow.jetstream.RangeProbe(
            {"url": server.url, "stream": "gaps", "fetchBatch": "64", **extra}, 1, end
        )
        seqs: list[int] = []
        try:
            for _ in range(end + 1):  # bounded: the range holds fewer
                seq = probe.next()
                if seq < 0:
                    break
                seqs.append(seq)
            return seqs, probe.consumers()
        finally:
            probe.close()

    kept = [s for s in range(1, 601) if not (100 <= s < 110 or s >= 590)]
    assert read(601) == (kept, 1)
    only_b = [s for s in kept if (s - 1) % 5 == 0]
    assert read(601, subject="gaps.b") == (only_b, 1)


FIELDS = "n BIGINT, i INT, d DOUBLE, b BOOLEAN, s STRING, `Two Words` STRING"
FIELD_VALUES = [
    "0",
    "-0",
    "7",
    "-12",
    "2147483647",
    "2147483648",
    "-2147483649",
    "999999999999999999",
    "1234567890123456",
    "9007199254740993",
    "9223372036854775807",
    "9223372036854775808",
    "1.5",
    "-0.0",
    "1e3",
    "2E-2",
    "1.0",
    "0.1",
    "0.30000000000000004",
    "1E+2",
    "1e400",
    "-1e400",
    "4.9e-324",
    "2.2250738585072014E-308",
    "1.7976931348623157e308",
    "123456789012345678901234567890",
    '"x"',
    '""',
    '"a\\u00e9"',
    '"say \\"hi\\""',
    '"z\u00fcrich \u2713"',
    '"12"',
    '"NaN"',
    "true",
    "false",
    "null",
    '{"a": 1}',
    '[1, "x"]',
    "[]",
]
KEYS = ["n", "i", "d", "b", "s", "Two Words", "N", "two words", "other", "o}{"]


def field_events(seed: int, count: int) -> list[bytes]:
    """JSON events over `FIELDS`: the plain ones the source reads itself and every shape it
    leaves to Spark (a value of another kind, an escape, a repeated key, a key in another
    case, an unknown key with brackets inside, spacing, an event that is not an object),
    and three that are not JSON."""
    rng = random.Random(seed)
    out = [b"[1]", b"5", b'"s"', b"{}", b' {\n "n" : 1 ,\t"s":"x" } ', b'{"n":1,"n":2}']
    out += [b'{"n": 1', b'{"s": "\xff"}', b"{broken"]  # malformed: no fields at all
    for _ in range(count):
        keys = rng.sample(KEYS[:6], rng.randint(0, 6))
        if rng.random() < 0.3:
            keys.append(rng.choice(KEYS[6:]))
        if rng.random() < 0.1 and keys:
            keys.append(rng.choice(keys))
        plain = rng.random() < 0.5  # each value of its field's own kind
        members = []
        for k in keys:
            if plain and k in ("n", "i"):
                v = str(rng.randint(-(10**6), 10**6))
            elif plain and k == "d":
                v = rng.choice(["0", "-3", "123456789012345", "null", "0.5", "-2.25e3"])
            elif plain and k == "b":
                v = rng.choice(["true", "false"])
            elif plain and k in ("s", "Two Words"):
                v = json.dumps(rng.choice(["", "x", "mixed Case", "caf\u00e9"]), ensure_ascii=False)
            else:
                v = rng.choice(FIELD_VALUES)
            members.append(f"{json.dumps(k)}{rng.choice([':', ': ', ' : '])}{v}")
        out.append(("{" + rng.choice([",", ", "]).join(members) + "}").encode())
    return out


def test_fields_the_source_reads_equal_spark_from_json_for_every_event(
    sp: Any, server: Any, tmp_path: Path
) -> None:
    """With `fields`, the source reads the plain events' fields into columns of their own
    (`_tf_parsed`), and a sql job takes them instead of `from_json`: for every event, what
    the job gets equals what Spark's `from_json` makes of it, to the sign of a zero."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import _parse_datatype_string

    from jobs.jvm_source import PARSED
    from jobs.sql_jobs import event_fields

    events = field_events(seed=5, count=3000)
    add_stream(server.url, "fields", ["fields.x"])
    publish(server.url, [("fields.x", e, None) for e in events])
    schema = _parse_datatype_string(FIELDS)
    rows: list[tuple[Any, ...]] = []

    def collect(df: Any, batch_id: int) -> None:
        mine = event_fields(df, schema)
        spark_reads = F.from_json("data", schema)
        rows.extend(
            (r.seq, r.parsed, repr(r.mine), repr(r.spark), r.data)
            for r in df.select(
                "seq",
                F.col(PARSED).alias("parsed"),
                mine.alias("mine"),
                spark_reads.alias("spark"),
                "data",
            ).collect()
        )

    q = (
        sp.readStream.format(JVM_FORMAT)
        .option("url", server.url)
        .option("stream", "fields")
        .option("fields", FIELDS)
        .load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180) and q.exception() is None, q.exception()
    finally:
        q.stop()
    assert len(rows) == len(events)
    differ = [(data, mine, spark) for _, _, mine, spark, data in rows if mine != spark]
    assert differ == []
    parsed = sum(1 for r in rows if r[1])
    # both ways are taken, often: the source's reading, and Spark's for the rest
    assert len(rows) * 0.3 < parsed < len(rows) * 0.8, parsed


@pytest.mark.parametrize(
    ("options", "columns"),
    [
        ({"fields": "n BIGINT, s STRING"}, ["_tf_parsed", "_tf_f0", "_tf_f1"]),
        ({"fields": "n BIGINT, p DECIMAL(5,2)"}, []),  # a type it leaves to from_json
        ({"fields": "n BIGINT", "validate": "none"}, []),  # unchecked bytes: from_json
        ({"fields": "n BIGINT", "invalidOnly": "true"}, []),
        ({"fields": "not a ddl ("}, []),
        ({}, []),
    ],
)
def test_the_source_adds_field_columns_only_where_it_reads_them(
    sp: Any, server: Any, options: dict[str, str], columns: list[str]
) -> None:
    reader = sp.readStream.format(JVM_FORMAT).option("url", server.url).option("stream", "odd")
    for k, v in options.items():
        reader = reader.option(k, v)
    assert reader.load().columns == [*COLUMNS, *columns]
