"""The error tree (runtime/errors.py): one root for everything tierflow raises on purpose.

Every module of the product packages is imported (with `pkgutil`, so a new module is
checked without being listed here) and every exception class it declares is checked:
public ones subclass `TierflowError`, no two public ones share a name unless one is the
other's subclass (a user who catches `SourceError` must get the one the name promises),
and none is an AssertionError (a test's failure, not something product code raises).
Imports only: no engine, no process.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections import defaultdict
from types import ModuleType

import pytest

from tests import layers

pytestmark = pytest.mark.unit


def _modules() -> tuple[list[ModuleType], dict[str, str]]:
    """Every importable module of the product packages, and those skipped: name -> why.

    Skipped: `__main__` modules (importing one runs the CLI) and a module that imports a
    third-party package not installed here (an optional extra, such as the bench's); a
    missing tierflow module is a failure, not a skip."""
    modules: list[ModuleType] = []
    skipped: dict[str, str] = {}
    for package in layers.PACKAGES:
        root = importlib.import_module(package)
        modules.append(root)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.rsplit(".", 1)[-1] == "__main__":
                skipped[info.name] = "a __main__ module runs its program when imported"
                continue
            try:
                modules.append(importlib.import_module(info.name))
            except ModuleNotFoundError as err:
                missing = (err.name or "").split(".")[0]
                if not missing or missing in layers.PACKAGES:
                    raise
                skipped[info.name] = f"optional dependency {err.name!r} is not installed"
    return modules, skipped


def _declared() -> list[type[BaseException]]:
    """Every exception class a product module declares (not the ones it imports)."""
    modules, _ = _modules()
    found: dict[str, type[BaseException]] = {}
    for module in modules:
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                found[_qualified(obj)] = obj
    return list(found.values())


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _public(classes: list[type[BaseException]]) -> list[type[BaseException]]:
    return [c for c in classes if not c.__name__.startswith("_")]


@pytest.fixture(scope="module")
def declared() -> list[type[BaseException]]:
    classes = _declared()
    assert len(classes) > 30, "the walk found too few exception classes: is it broken?"
    return classes


def test_every_public_error_is_a_tierflow_error(declared: list[type[BaseException]]) -> None:
    from runtime.errors import TierflowError

    public = {_qualified(c): c for c in _public(declared)}
    outside = {name for name, c in public.items() if not issubclass(c, TierflowError)}
    assert outside == set(), "subclass runtime.errors.TierflowError"


def test_no_two_public_errors_share_a_name(declared: list[type[BaseException]]) -> None:
    by_name: dict[str, list[type[BaseException]]] = defaultdict(list)
    for cls in _public(declared):
        by_name[cls.__name__].append(cls)
    clashes = [
        sorted(_qualified(c) for c in group)
        for group in by_name.values()
        if any(
            not (issubclass(a, b) or issubclass(b, a)) for a in group for b in group if a is not b
        )
    ]
    assert clashes == []


def test_no_product_error_is_an_assertion_error(declared: list[type[BaseException]]) -> None:
    assert [_qualified(c) for c in declared if issubclass(c, AssertionError)] == []


def test_one_except_catches_each_idea_and_the_old_bases_still_hold() -> None:
    from actors.collection.buffer import LeaderFenced
    from jobs.sink import LeaseFenced, SinkError
    from runtime.errors import ConfigError, FencedError, JobError, TierflowError
    from runtime.state.replication import EpochFenced
    from runtime.state.replication import FencedError as ReplicationFencedError
    from runtime.waiting import WaitTimeout

    assert ReplicationFencedError is FencedError  # the name its callers import from there
    for fenced in (EpochFenced, LeaderFenced, LeaseFenced):
        assert issubclass(fenced, FencedError)
    assert issubclass(LeaseFenced, SinkError)  # a fenced sink still fails its batch
    assert issubclass(LeaderFenced, RuntimeError)
    assert issubclass(WaitTimeout, TimeoutError)
    assert issubclass(ConfigError, ValueError) and issubclass(JobError, ValueError)
    assert issubclass(FencedError, TierflowError)
    assert str(EpochFenced(3, 1)) == "fenced: epoch 1 is older than accepted epoch 3"
