"""tests/layers.py: the import check `make lint` runs fails on an upward import or a cycle."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import layers

pytestmark = pytest.mark.unit


def _tree(root: Path, files: dict[str, str]) -> Path:
    for pkg in layers.PACKAGES:
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent != root and not (path.parent / "__init__.py").exists():
            (path.parent / "__init__.py").write_text("")
        path.write_text(text)
    return root


def test_the_repository_passes() -> None:
    assert layers.check() == []


def test_an_upward_import_fails_even_when_function_local(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "runtime/base.py": "def f():\n    from actors.queue.logger import x\n",
            "actors/queue/logger.py": "x = 1\n",
        },
    )
    (err,) = layers.check(root)
    assert "runtime.base:2 imports actors.queue.logger" in err


def test_a_sideways_tier_import_fails(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "actors/access/gateway.py": "from jobs.sink import y\n",
            "jobs/sink.py": "y = 1\n",
        },
    )
    (err,) = layers.check(root)
    assert "actors.access may not import jobs" in err


def test_a_cycle_inside_one_floor_fails(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "runtime/a.py": "from runtime import b\n",
            "runtime/b.py": "from runtime.c import z\n",
            "runtime/c.py": "def g():\n    import runtime.a\nz = 1\n",
        },
    )
    assert layers.check(root) == ["import cycle: runtime.a -> runtime.b -> runtime.c"]


def test_type_checking_imports_are_not_edges(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "runtime/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from cluster.cli import app\n",
            "cluster/cli.py": "from runtime.a import TYPE_CHECKING\napp = 1\n",
        },
    )
    assert layers.check(root) == []


def test_a_foundation_subsystem_importing_one_above_it_fails(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "runtime/data/events.py": "from runtime.nats.server import s\n",
            "runtime/nats/server.py": "from runtime.data.events import e\ns = 1\n",
        },
    )
    errors = layers.check(root)
    assert any("runtime.data may not import runtime.nats" in e for e in errors), errors
    assert not any("runtime.nats may not" in e for e in errors), errors  # downward is fine
