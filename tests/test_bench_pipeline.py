"""The e2e bench's slot profile (Spark's event log -> per query, slot wait against run) and
its split of the top-N latency into trigger wait, batch and delivery."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.pipeline import event_log_conf, lag_growth, latency_parts, slot_waits


def _job(job: int, pool: str, at: int, end: int, stages: dict[int, tuple[int, list[int]]]) -> list:
    """A job's events: stages {id: (submitted, [task launch times])}, each task running
    100 ms with 10 ms of CPU."""
    out: list[dict] = [
        {
            "Event": "SparkListenerJobStart",
            "Job ID": job,
            "Submission Time": at,
            "Stage IDs": list(stages),
            "Properties": {"spark.scheduler.pool": pool},
        }
    ]
    for stage, (submitted, launches) in stages.items():
        out.append(
            {
                "Event": "SparkListenerStageSubmitted",
                "Stage Info": {"Stage ID": stage, "Submission Time": submitted},
            }
        )
        for launch in launches:
            out.append(
                {
                    "Event": "SparkListenerTaskEnd",
                    "Stage ID": stage,
                    "Task Info": {"Launch Time": launch},
                    "Task Metrics": {"Executor Run Time": 100, "Executor CPU Time": 10_000_000},
                }
            )
    out.append({"Event": "SparkListenerJobEnd", "Job ID": job, "Completion Time": end})
    return out


def test_slot_waits_per_query(tmp_path: Path) -> None:
    events = [
        # before `since`: not counted
        *_job(0, "query-topn", 500, 900, {0: (500, [600])}),
        # waited 300 ms for its first stage's slot and 50 for its second's
        *_job(1, "query-topn", 2000, 2600, {1: (2000, [2300, 2400]), 2: (2450, [2500])}),
        *_job(2, "query-panel", 2000, 5000, {3: (2000, [2000])}),
    ]
    log = tmp_path / "app-1.inprogress"
    log.write_text("\n".join(json.dumps(e) for e in events) + '\n{"Event": "SparkListenerJo')
    got = slot_waits(tmp_path, since=1.0)
    assert got == {
        "topn": {
            "jobs": 1,
            "wall": 600,
            "slot_wait": 350,
            "run": 300,
            "cpu": 30.0,
            "slot_wait_max": 350,
        },
        "panel": {
            "jobs": 1,
            "wall": 3000,
            "slot_wait": 0,
            "run": 100,
            "cpu": 10.0,
            "slot_wait_max": 0,
        },
    }


def test_event_log_conf_writes_one_plain_file(tmp_path: Path) -> None:
    where, conf = event_log_conf(tmp_path, "bench-x")
    assert where.is_dir() and where.parent == tmp_path
    assert conf["spark.eventLog.dir"] == where.resolve().as_uri()
    assert conf["spark.eventLog.compress"] == "false"
    assert conf["spark.eventLog.rolling.enabled"] == "false"


def test_latency_parts_match_each_accept_to_the_batch_behind_its_update() -> None:
    batches = [(10.0, 10.8), (10.8, 11.5), (11.5, 12.1)]  # back to back
    frames = [(10.85, 100), (11.55, 300), (12.12, 350)]
    accepted = [(10.2, 100), (10.5, 300), (10.9, 350), (12.5, 400)]
    got = latency_parts(accepted, frames, batches)
    # 10.2: its update (10.85) is batch 1's, ended 10.8 -> waited -0.2 s (accepted mid-batch
    # yet counted: the batch read its offsets after the accept), ran 0.8, delivered 50 ms
    # 10.5 and 10.9: updates 11.55 and 12.12, batches 2 and 3 (ended nearest; batch 3 had
    # started before the 11.55 frame but ends later); 12.5: no update counts it
    assert [round(x) for x in got["wait"]] == [-200, 300, 600]
    assert [round(x) for x in got["batch"]] == [800, 700, 600]
    assert [round(x) for x in got["deliver"]] == [50, 50, 20]


def _accepted(rate: int, seconds: float) -> list[tuple[float, int]]:
    """(time, events accepted so far), a batch of rate/10 every 0.1 s."""
    return [(i / 10, (i + 1) * rate // 10) for i in range(int(seconds * 10))]


@pytest.mark.unit
def test_lag_growth_is_flat_when_the_top_n_keeps_up_and_the_shortfall_when_not() -> None:
    acc = _accepted(5000, 12)
    # keeping up: each update counts what was accepted 0.8 s before it (a steady lag)
    steady = [(t, acc[int((t - 0.8) * 10)][1]) for t in (1.5, 2.9, 4.4, 5.8, 7.1, 8.7, 10.2)]
    assert abs(lag_growth(acc, steady, 1.0, 11.9) or 0) < 50
    # behind: the updates count 4,000 events/s of the 5,000 offered
    behind = [(t, int(4000 * t)) for t in (1.5, 2.9, 4.4, 5.8, 7.1, 8.7, 10.2)]
    assert lag_growth(acc, behind, 1.0, 11.9) == pytest.approx(1000, rel=0.05)
    # too few updates inside the window to say
    assert lag_growth(acc, steady[:2], 1.0, 11.9) is None
    assert lag_growth(acc, steady, 20.0, 30.0) is None
