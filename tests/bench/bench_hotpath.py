"""The collector's per-event CPU, in-process: body -> events with ids -> stream logic.

No servers: it times exactly the Python a collector runs per request before group commit
(`parse_events`, else `parse_body` + `assign_ids` where that is all the code has), then
`StreamLogic.apply`, on NDJSON batches of 100 Meetup RSVPs (`cluster.demo.rsvps`, topics cut
to two so an event is about 500 B). Four cases: with and without producer ids, with and
without logic. The same bodies also go through the dict-based path (`parse_body` +
`assign_ids`, what the collector ran before `parse_events`) in the same run, for the ratio.

Prints events/s and µs/event of CPU time (median of the rounds; the wall clock too, in the
JSON), writes reports/bench_hotpath.json.
Asserts no speed. Run alone:
`.venv/bin/python -m pytest -q -s -p no:cacheprovider -o python_files='bench_*.py'
tests/bench/bench_hotpath.py`
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

from actors.collection import parsing
from cluster.demo.rsvps import RsvpGenerator
from runtime.data.events import Event
from runtime.data.logic import LogicConfig, StreamLogic, compile_logic
from tests.bench.common import write_report

BATCH = 100
BATCHES = int(os.environ.get("TIERFLOW_BENCH_HOTPATH_BATCHES", "50"))
ROUNDS = int(os.environ.get("TIERFLOW_BENCH_HOTPATH_ROUNDS", "7"))
NDJSON = "application/x-ndjson"
LIMITS = {"max_events": 1000, "max_event_bytes": 1 << 20}
# what a Meetup stream would run: every event kept, so every case carries the same events
LOGIC = LogicConfig(
    validate={"response": "str", "guests": "int", "group.group_city": "str"},
    enrich=["received_at", "collector"],
    filter="guests >= 0",
    route="raw.meetup.{group.group_country}",
)
CASES = [(ids, logic) for ids in (True, False) for logic in (False, True)]

Parse = Callable[[bytes], list[Event]]


def bodies(with_ids: bool) -> list[bytes]:
    gen = RsvpGenerator(seed=11)
    encode = msgspec.json.encode
    out = []
    for _ in range(BATCHES):
        lines = []
        for rsvp in gen.take(BATCH):
            rsvp["group"]["group_topics"] = rsvp["group"]["group_topics"][:1]
            if with_ids:
                rsvp = {"id": f"rsvp-{rsvp['rsvp_id']}", **rsvp}
            lines.append(encode(rsvp))
        out.append(b"\n".join(lines) + b"\n")
    return out


def hot_parse() -> tuple[str, Parse]:
    """The collector's path in this checkout (the bench also runs on older code)."""
    parse_events = getattr(parsing, "parse_events", None)
    if parse_events is not None:
        return "parse_events", lambda body: parse_events(
            NDJSON, body, "meetup", "raw.meetup", 1, **LIMITS
        )
    return "parse_body+assign_ids", dict_parse


def dict_parse(body: bytes) -> list[Event]:
    items = parsing.parse_body(NDJSON, body, **LIMITS)
    return parsing.assign_ids(items, "meetup", "raw.meetup", 1)


def measure(parse: Parse, logic: StreamLogic, batches: list[bytes]) -> dict[str, Any]:
    """Per event, median over the rounds: CPU time of this thread (what the collector's
    GIL would hold; steadier than the wall clock on a shared machine) and wall time."""
    n = BATCH * len(batches)
    parse_us: list[float] = []
    apply_us: list[float] = []
    wall_us: list[float] = []
    cpu = time.thread_time
    for _ in range(ROUNDS):
        w0, c0 = time.perf_counter(), cpu()
        parsed = [parse(body) for body in batches]
        c1 = cpu()
        for events in parsed:
            logic.apply(events)
        c2, w2 = cpu(), time.perf_counter()
        parse_us.append((c1 - c0) / n * 1e6)
        apply_us.append((c2 - c1) / n * 1e6)
        wall_us.append((w2 - w0) / n * 1e6)
    totals = [p + a for p, a in zip(parse_us, apply_us, strict=True)]
    total = statistics.median(totals)
    return {
        "parse_us": round(statistics.median(parse_us), 3),
        "apply_us": round(statistics.median(apply_us), 3),
        "total_us": round(total, 3),
        "best_total_us": round(min(totals), 3),
        "wall_us": round(statistics.median(wall_us), 3),
        "events_per_s": round(1e6 / total),
    }


def test_bench_hotpath() -> None:
    started = time.perf_counter()
    path, parse = hot_parse()
    no_logic = compile_logic("meetup", LogicConfig(), "raw.meetup", collector="bench")
    with_logic = compile_logic("meetup", LOGIC, "raw.meetup", collector="bench")
    cases: dict[str, Any] = {}
    dict_path: dict[str, Any] = {}
    sizes: dict[str, float] = {}
    for with_ids, logic in CASES:
        name = f"{'ids' if with_ids else 'no_ids'}_{'logic' if logic else 'no_logic'}"
        batches = bodies(with_ids)
        sizes["ids" if with_ids else "no_ids"] = round(
            sum(len(b) for b in batches) / (BATCH * len(batches)), 1
        )
        lg = with_logic if logic else no_logic
        assert len(lg.apply(parse(batches[0])).kept) == BATCH  # the logic keeps every event
        cases[name] = measure(parse, lg, batches)
        dict_path[name] = measure(dict_parse, lg, batches)
        cases[name]["vs_dict_path"] = round(
            dict_path[name]["total_us"] / cases[name]["total_us"], 2
        )
    print(f"\nhot path: {path}; {BATCHES} NDJSON batches of {BATCH}; bytes/event {sizes}")
    print(
        f"{'case (CPU)':<18}{'parse µs':>10}{'apply µs':>10}{'total µs':>10}{'events/s':>11}"
        f"{'dict path µs':>14}{'ratio':>7}{'wall µs':>9}"
    )
    for name, row in cases.items():
        print(
            f"{name:<18}{row['parse_us']:>10.2f}{row['apply_us']:>10.2f}{row['total_us']:>10.2f}"
            f"{row['events_per_s']:>11,}{dict_path[name]['total_us']:>14.2f}"
            f"{row['vs_dict_path']:>7.2f}{row['wall_us']:>9.2f}"
        )
    write_report(
        "hotpath",
        {
            "path": path,
            "batch_events": BATCH,
            "batches": BATCHES,
            "rounds": ROUNDS,
            "event_bytes": sizes,
            "logic": msgspec.to_builtins(LOGIC),
            "cases": cases,
            "dict_path": dict_path,
            "wall_s": round(time.perf_counter() - started, 1),
        },
    )
