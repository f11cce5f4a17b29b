"""The bench report shows the Spark benches' warm-up apart from what they measure, and reads
the pipeline goals from the measured rows, never from a warm-up."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench.report import analysis_section, demo_section, e2e_section, goal_rows

pytestmark = pytest.mark.unit


def _phase(rate: float, topn_p99: float, raw_p99: float = 50.0) -> dict[str, Any]:
    return {
        "rate": rate,
        "seconds": 45.0,
        "accepted_rate": rate,
        "shown_rate": rate,
        "lag_growth_per_s": 0.0,
        "topn": {"p50_ms": topn_p99 / 2, "p99_ms": topn_p99},
        "raw": {"p50_ms": raw_p99 / 2, "p99_ms": raw_p99},
    }


def _e2e(warmup: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "k": 1,
        "trigger_s": 0.5,
        "seconds": 12.0,
        "warmup": warmup,
        "rates": [_phase(1000, 1_400.0), _phase(5000, 2_900.0)],
    }


def _goal(reports: dict[str, Any], figure: str) -> list[str]:
    (row,) = [r for r in goal_rows(reports) if r[0].startswith(figure)]
    return row


def test_the_e2e_warm_up_is_its_own_row_and_the_goal_is_the_measured_rate() -> None:
    lines = e2e_section(_e2e(_phase(1000, 4_900.0)))
    rows = [line for line in lines if line.startswith("| 1,000")]
    assert rows[0].startswith("| 1,000 (warm-up) |") and "4,900" in rows[0]
    assert rows[1].startswith("| 1,000 |") and "1,400" in rows[1]
    assert any(line.startswith("Warm-up: the first 45 s") for line in lines)
    goal = _goal({"e2e": _e2e(_phase(1000, 4_900.0))}, "e2e top-N p99 at 1,000/s")
    assert goal[1] == "1,400 ms" and goal[3] == "yes"


def test_a_run_without_warm_up_shows_no_warm_up_row_nor_note() -> None:
    lines = e2e_section(_e2e(None))
    assert not any("warm-up" in line.lower() for line in lines)


def test_the_demo_shows_its_warm_up_and_its_goal_is_the_measured_phase() -> None:
    demo = {"jobs": 5, **_phase(200, 1_900.0), "seconds": 20.0, "warmup": _phase(200, 5_700.0)}
    lines = demo_section(demo)
    assert any(line.startswith("| warm-up | 200 |") and "5,700" in line for line in lines)
    assert any(line.startswith("| measured | 200 |") and "1,900" in line for line in lines)
    goal = _goal({"demo": demo}, "make demo")
    assert goal[1] == "1,900 ms" and goal[3] == "yes"


def test_the_analysis_section_names_the_warm_pairs_ratios() -> None:
    def run(events_per_s: float) -> dict[str, Any]:
        return {"events_per_s": events_per_s, "processing_events_per_s": events_per_s}

    d = {
        "events": 40_000,
        "batch": 5_000,
        "master": "local[2]",
        "jetstream": {**run(8_000), "p50_ms": 500, "p99_ms": 700},
        "files": {**run(10_000), "p50_ms": 400, "p99_ms": 600},
        "warm_pairs": [{"jetstream": run(7_000), "files": run(10_000)}],
    }
    lines = analysis_section(d)
    assert any("unmeasured pairs" in line and "files: 0.70." in line for line in lines)
    (top,) = [line for line in lines if line.startswith("| top-N, jetstream |")]
    assert top.endswith("| 0.80 |")


def _nexmark_query(js: int, files: int, equal: bool, flink: int | None) -> dict[str, Any]:
    return {
        "jetstream": {"events_per_s": js},
        "files": {"events_per_s": files},
        "exactly_once": {"events_per_s": js // 2},
        "ratio": round(js / files, 2),
        "per_core": js // 2,
        "flink_per_core": flink,
        "rows": 10,
        "equal": equal,
    }


def test_the_nexmark_goals_name_the_worst_query_and_any_answer_that_differs() -> None:
    from tests.bench.report import nexmark_goal_rows, nexmark_section

    report = {
        "events": 1000,
        "event_rate": 10_000,
        "disorder": 100,
        "cores": 2,
        "max_per_trigger": 100,
        "queries": {
            "q0": _nexmark_query(180_000, 200_000, True, 155_000),
            "q5": _nexmark_query(7_000, 10_000, False, 22_000),
        },
        "latency": {"q7": {"rate": 10_000, "sent": 5, "results": 3, "p50_ms": 1, "p99_ms": 2}},
        "not_run": {"q4": "why"},
    }
    rows = {r[0]: r for r in nexmark_goal_rows({"nexmark": report})}
    worst = rows["SQL job over JetStream / same query over files, worst query"]
    assert worst[1] == "0.70 (q5)" and worst[3] == "**no**"
    assert rows["q0 events/s per core / Flink 1.13's"][1:] == ["0.58 (90,000)", ">= 0.5", "yes"]
    assert rows["answers vs the DuckDB oracle, 1,000 events"][1] == "1 of 2 equal"
    text = "\n".join(nexmark_section(report))
    assert "**differ**" in text and "Not run: q4" in text and "q7 at 10,000 events/s" in text
    assert "CPU per event" not in text  # no run measured its CPU
    report["queries"]["q0"]["jetstream"]["cpu_us_per_event"] = {"jvm": 6.5, "workers": 4.25}
    report["queries"]["q0"]["jetstream"]["busy_cores"] = 1.9
    lines = nexmark_section(report)
    (cpu,) = [line for line in lines if line.startswith("| q0 | jetstream |")]
    assert cpu == "| q0 | jetstream | 6.5 | 4.2 | - | - | 10.8 | 1.9 |"


def test_the_console_section_shows_paint_full_view_and_update_times() -> None:
    from tests.bench.report import console_section

    lines = console_section(
        {
            "streams": 50,
            "jobs": 100,
            "rounds": 40,
            "first_paint_ms": 244.2,
            "first_contentful_paint_ms": 250.0,
            "full_view_ms": 611.5,
            "update_p50_ms": 39.44,
            "update_p99_ms": 72.1,
        }
    )
    assert lines[0].startswith("### Operations console (50 streams, 100 jobs")
    assert lines[-1] == "| 244 | 250 | 612 | 39.4 | 72.1 |"
