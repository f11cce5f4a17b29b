"""The order make test hands modules to its workers: the costliest first.

pytest-xdist (`--dist loadfile`) gives each worker a whole module at a time, in the order
it is given them; by default it sorts them by how many tests they hold, which puts the
modules of one long end-to-end test last, where one of them runs alone while the other
worker has nothing left. Longest first (the classic greedy schedule) leaves only short
modules for the end. The costs are the seconds each module took in a measured run,
kept in tests/module_seconds.json; a module not in it counts as the costliest, so a
new one is not left for the end. Stale figures cost only time, never a result.

Regenerate after a run of `make test PYTEST_ARGS=--junitxml=/tmp/junit.xml`:
`.venv/bin/python -m tests.ordering /tmp/junit.xml`
"""

from __future__ import annotations

import json
import math
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

COSTS = Path(__file__).with_name("module_seconds.json")

T = TypeVar("T")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def costliest_first(
    items: Sequence[T], module: Callable[[T], str], costs: Mapping[str, float]
) -> list[T]:
    """`items` regrouped by `module(item)`, modules by cost (unknown first); ties, and the
    order within a module, as collected."""
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(module(item), []).append(item)
    order = sorted(groups, key=lambda m: -costs.get(m, math.inf))
    return [item for m in order for item in groups[m]]


def load_costs(path: Path = COSTS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def costs_from_junit(xml_text: str) -> dict[str, float]:
    """Seconds per module from a junit XML report (setup, call and teardown: its `time`)."""
    out: dict[str, float] = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        # classname is dotted: tests.test_x, or tests.test_x.TestClass for a class's tests
        parts = case.get("classname", "").split(".")
        ends = [i for i, part in enumerate(parts) if part.startswith("test_")]
        if not ends:
            continue
        path = "/".join(parts[: ends[0] + 1]) + ".py"
        out[path] = out.get(path, 0.0) + float(case.get("time", 0) or 0)
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    costs = costs_from_junit(Path(argv[0]).read_text())
    COSTS.write_text(json.dumps(costs, indent=1) + "\n")
    print(f"wrote {COSTS} ({len(costs)} modules, {sum(costs.values()):.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
