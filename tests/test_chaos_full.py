"""The full chaos suite (`make chaos`): every scenario at N=2000, 500 events/s, seed 1, k=1.

Each scenario must end with zero acknowledged loss and zero duplicates, its clients and
(Spark scenario) its analysis exact. The reports of the run are saved under reports/.
Collected only with `-m chaos` (it takes many minutes).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.chaos import report, scenarios
from cluster.chaos.report import ScenarioReport

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]

EVENTS, RATE, SEED = 2000, 500.0, 1
REPORTS = Path(__file__).resolve().parent.parent / "reports"


@pytest.fixture(autouse=True)
def _only_when_asked(request: pytest.FixtureRequest) -> None:
    if "chaos" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full chaos suite runs with -m chaos (make chaos)")


@pytest.fixture(scope="module")
def collected() -> Iterator[list[ScenarioReport]]:
    reps: list[ScenarioReport] = []
    yield reps
    if reps:
        path = report.write(reps, REPORTS)
        print(f"\nchaos report: {path}\n{path.with_suffix('.txt').read_text()}")


@pytest.mark.parametrize("name", list(scenarios.SCENARIOS))
async def test_scenario(name: str, tmp_path: Path, collected: list[ScenarioReport]) -> None:
    from cluster.chaos.runner import RunOptions, run_scenario

    scn = scenarios.get(name)
    rep = await run_scenario(scn, RunOptions(events=EVENTS, rate=RATE, seed=SEED, workdir=tmp_path))
    collected.append(rep)
    explain = json.dumps(rep.to_dict(), indent=1, default=str)[:4000]
    assert rep.ok, explain
    assert not rep.lost and not rep.duplicated and rep.acknowledged == EVENTS
    assert all(f.recovered_s is not None and not f.error for f in rep.faults), explain
    if scn.gateway:
        assert rep.gateway is not None and rep.gateway.ok
    if scn.analysis:
        assert rep.analysis_mismatches == []
    extra: dict[str, Any] = {"kill-past-intensity": "escalated: True"}
    if name in extra:
        assert extra[name] in rep.faults[0].detail, explain
