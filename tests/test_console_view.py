"""The console's view (cluster/console/view.py) and what a token sees of it
(actors/access/console.py): pure functions of a status snapshot and stream figures."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from actors.access.console import visible_view
from cluster.console.view import (
    BEHIND_LAG,
    BEHIND_PENDING,
    TIERS,
    console_view,
    job_health,
    role_health,
    stream_record,
)

pytestmark = pytest.mark.unit


def replica(name: str, **figures: Any) -> dict[str, Any]:
    return {"name": name, "node": "n1", **figures}


@pytest.mark.parametrize(
    ("role", "rows", "rates", "state", "words"),
    [
        ("collector", [replica("c0")], {"accepted": 10.0, "overloaded": 0.0}, "ok", ""),
        ("collector", [replica("c0")], {"overloaded": 2.5}, "behind", "2.5 503s"),
        (
            "bridge",
            [replica("b0"), {"name": "b1", "error": "GetTimeoutError"}],
            {},
            "down",
            "1 of 2 not answering (b1)",
        ),
        ("bridge", [replica("b0")], {"failed": 1.0}, "behind", "failed publishes"),
        ("logger", [replica("l0", pending=BEHIND_PENDING + 1)], {}, "behind", "not in JetStream"),
        ("logger", [replica("l0", pending=BEHIND_PENDING)], {}, "ok", ""),
        ("gateway", [replica("g0")], {"lag_warnings": 1.0}, "behind", "lag warnings"),
        ("gateway", [], {}, "down", "no replica"),
    ],
)
def test_role_health_names_the_number_that_says_why(
    role: str, rows: list[dict[str, Any]], rates: dict[str, float], state: str, words: str
) -> None:
    got_state, why = role_health(role, rows, rates)
    assert got_state == state and words in why


def test_a_job_is_behind_only_while_its_lag_is_large_and_not_shrinking() -> None:
    running = {"state": "running", "lag": BEHIND_LAG + 10}
    assert job_health(running, None)[0] == "behind"
    assert job_health(running, BEHIND_LAG + 5)[0] == "behind"  # growing
    assert job_health(running, BEHIND_LAG + 500) == ("ok", "")  # catching up
    assert job_health({"state": "running", "lag": 3}, None) == ("ok", "")
    state, why = job_health({"state": "failed", "error": "boom"}, None)
    assert state == "down" and "boom" in why


def info(name: str, last: int, **config: Any) -> Any:
    cfg = {
        "name": name,
        "subjects": [f"raw.{name}"],
        "max_age": 0,
        "max_bytes": -1,
        "max_msgs": -1,
        "max_msgs_per_subject": -1,
        "num_replicas": 1,
        **config,
    }
    state = SimpleNamespace(
        messages=last, bytes=last * 100, first_seq=1, last_seq=last, consumer_count=2
    )
    return SimpleNamespace(config=SimpleNamespace(**cfg), state=state)


STATUS = {
    "uptime_s": 30,
    "services": {"nats": {"healthy": True}, "ray": {"nodes": [{"alive": True}]}},
    "children": [{"name": "bridge-0", "restarts": 2}],
    "roles": {
        "collector": {"replicas": [replica("c0")], "rates": {"accepted": 50.0}, "nodes": ["n1"]},
        "logger": {"replicas": [replica("l0", pending=3)], "load": 3},
        "bridge": {"replicas": [replica("b0")], "rates": {"published": 50.0}},
        "gateway": {"replicas": [replica("g0")], "rates": {"events_sent": 9.0}},
    },
    "analysis": {
        "state": "running",
        "queries": [
            {
                "name": "top",
                "kind": "topn",
                "stream": "orders",
                "state": "running",
                "lag": 4,
                "processed_rows_per_s": 40.0,
                "late_events": 1,
            },
            {
                "name": "joined",
                "kind": "sql",
                "stream": "orders,clicks",
                "state": "running",
                "lag": 0,
            },
            {"name": "deadletter_orders", "kind": "deadletter", "stream": "orders"},
        ],
        "dead_letters": {"orders": 2, "clicks": 5},
    },
}


def test_the_view_has_every_tier_in_flow_order_with_rates_between_views() -> None:
    first = console_view(STATUS, [stream_record(info("orders", 100))], None, now=100.0)
    assert [t["tier"] for t in first["tiers"]] == list(TIERS)
    assert first["streams"][0]["rate"] is None  # no view before: no rate yet
    second = console_view(
        STATUS,
        [
            stream_record(info("orders", 300)),
            stream_record(info("results", 10)),
            stream_record(info("buffer", 900)),  # the stream pattern's, not stored events
        ],
        first,
        now=102.0,
    )
    orders = next(s for s in second["streams"] if s["name"] == "orders")
    assert orders["rate"] == 100.0 and orders["dead_letters"] == 2
    tiers = {t["tier"]: t for t in second["tiers"]}
    assert tiers["jetstream"]["rates"]["stored"] == 100.0  # results are not a user stream
    assert tiers["bridge"]["restarts"] == 2 and tiers["collector"]["state"] == "ok"
    assert tiers["analysis"]["late_events"] == 1
    assert [j["name"] for j in second["jobs"]] == ["joined", "top"]  # no dead-letter scans
    assert second["jobs"][0]["streams"] == ["orders", "clicks"]
    assert second["dead_letters"] == 7


def test_a_failed_job_turns_the_analysis_tier_down_with_its_name() -> None:
    status = {
        **STATUS,
        "analysis": {
            **STATUS["analysis"],
            "queries": [
                {
                    "name": "top",
                    "kind": "topn",
                    "stream": "orders",
                    "state": "failed",
                    "error": "oom",
                }
            ],
        },
    }
    tiers = {t["tier"]: t for t in console_view(status, [], None, 1.0)["tiers"]}
    assert tiers["analysis"]["state"] == "down" and "top: failed: oom" in tiers["analysis"]["why"]


def test_limits_compaction_and_archive_come_from_the_stream_and_its_config() -> None:
    cfg = SimpleNamespace(
        compact=SimpleNamespace(key="id", keep=1), archive=SimpleNamespace(partitioning="hour")
    )
    rec = stream_record(info("users", 5, max_age=3600, max_msgs_per_subject=1), cfg)
    assert rec["limits"] == {
        "max_age_s": 3600,
        "max_bytes": None,
        "max_msgs": None,
        "max_msgs_per_subject": 1,
    }
    assert rec["compact"] == {"key": "id", "keep": 1}
    assert rec["archive"] == {"partitioning": "hour"}


def test_a_token_sees_only_its_streams_and_the_jobs_reading_nothing_else() -> None:
    view = console_view(
        STATUS, [stream_record(info("orders", 9)), stream_record(info("clicks", 9))], None, 1.0
    )
    seen = visible_view(view, lambda name: name == "orders")
    assert [s["name"] for s in seen["streams"]] == ["orders"]
    assert [j["name"] for j in seen["jobs"]] == ["top"]  # `joined` also reads clicks
    assert seen["dead_letters"] == 2
    assert len(seen["tiers"]) == len(TIERS)


def test_a_view_takes_no_path_of_the_gateway_and_is_a_plain_name(tmp_path: Any) -> None:
    from runtime.config import ConfigError, load

    def cfg(views: dict[str, str]) -> Any:
        return load(environ={}, overrides={"state_dir": str(tmp_path), "gateway": {"views": views}})

    assert cfg({"demo": "/somewhere"}).gateway.views == {"demo": "/somewhere"}
    for bad in ("v1", "static", "Demo", "../x", "a/b", ""):
        with pytest.raises(ConfigError, match="view name"):
            cfg({bad: "/somewhere"})


def test_jetstream_is_behind_on_a_far_copy_or_archive_and_down_on_a_silent_copy() -> None:
    from cluster.console.view import jetstream_health

    up = {"services": {"nats": {"healthy": True}}}
    assert jetstream_health(up, [], []) == ("ok", "")
    assert jetstream_health({"services": {"nats": {"healthy": False}}}, [], [])[0] == "down"
    far = [{"stream": "orders", "site": "b", "lag": BEHIND_LAG + 1, "up": True}]
    state, why = jetstream_health(up, [], far)
    assert state == "behind" and "orders on b" in why
    silent = [{"stream": "orders", "site": "b", "lag": None, "up": False}]
    assert jetstream_health(up, [], silent)[0] == "down"
    archive = [{"name": "orders", "archive": {"partitioning": "day", "lag": BEHIND_LAG + 1}}]
    assert "archive of orders" in jetstream_health(up, archive, [])[1]


def test_a_streams_archive_lag_and_copies_come_from_its_queries_and_sites() -> None:
    cfg = SimpleNamespace(compact=None, archive=SimpleNamespace(partitioning="day"))
    status = {
        **STATUS,
        "analysis": {
            **STATUS["analysis"],
            "queries": [
                {"name": "archive_orders", "kind": "archive", "stream": "orders", "lag": 42}
            ],
        },
        "replication": [{"stream": "orders", "site": "b", "from": "a", "lag": 7, "up": True}],
    }
    view = console_view(status, [stream_record(info("orders", 100), cfg)], None, 1.0)
    (orders,) = view["streams"]
    assert orders["archive"] == {"partitioning": "day", "lag": 42}
    assert orders["copies"] == [{"site": "b", "from": "a", "lag": 7, "up": True}]
    assert view["jobs"] == []  # an archive is no job
    tiers = {t["tier"]: t for t in view["tiers"]}
    assert tiers["jetstream"]["archive_lag"] == 42 and tiers["jetstream"]["replication_lag"] == 7


def test_an_audit_is_ok_unless_an_id_is_stored_twice_in_one_stream() -> None:
    from collections import Counter

    from cluster.audit import judge_audit

    same_id_two_streams = {"a": Counter({"x": 1, "y": 1}), "b": Counter({"x": 1})}
    ok = judge_audit(same_id_two_streams, {"a": 2})
    assert ok["verdict"] == "ok" and ok["why"] == ""
    assert ok["streams"]["a"] == {
        "events": 4,
        "without_id": 2,
        "ids_stored_twice": 0,
        "examples": [],
    }
    bad = judge_audit({"a": Counter({"x": 2, "y": 1})}, {})
    assert bad["verdict"] == "duplicates" and "a" in bad["why"]
    assert bad["streams"]["a"]["examples"] == ["x"]


def test_nothing_below_the_operating_layer_nor_the_launcher_names_the_demo() -> None:
    """The demo is a config and its generator (cluster/demo): the runtime, the actors and
    the launcher deploy what a config describes and know no demo."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*(root / "runtime").rglob("*.py"), *(root / "actors").rglob("*.*")]
    files.append(root / "cluster" / "launcher.py")
    naming = [
        str(p.relative_to(root))
        for p in files
        if p.is_file()
        and p.suffix in (".py", ".js", ".html", ".css")
        and any(w in p.read_text(errors="replace").lower() for w in ("meetup", "rsvp"))
    ]
    assert naming == []
