"""The one way a config, a job spec or a supervisor spec names code: ``"package.module:attr"``.

Stream logic hooks (`runtime/data/logic.py`), custom jobs' functions (`jobs/plans.py`) and actor
starts in supervision specs all resolve through `load_hook`, so a user writes one form and
gets one error: a `ConfigError` that names the key holding the reference and what is wrong
with it. The module is imported by its full name; nothing is guessed (no package prefix
added, no "the only public function"). Importing is the only side effect.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from runtime.errors import ConfigError

__all__ = ["is_hook", "load_hook", "resolve"]

_HOOK_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_hook(ref: str) -> bool:
    """Whether `ref` has the ``module:attr`` form (says nothing about whether it imports)."""
    return bool(_HOOK_RE.match(ref.strip()))


def resolve(ref: str, key: str) -> Any:
    """The object `ref` names; ConfigError naming `key` when it is malformed, its module
    does not import or the module lacks the attribute."""
    ref = ref.strip()
    if not is_hook(ref):
        raise ConfigError(f"{key}: expected 'module:function', got {ref!r}")
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        raise ConfigError(f"{key}: cannot import {module_name!r}: {err}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{key}: {module_name!r} has no attribute {attr!r}") from None
    return obj


def load_hook(ref: str, key: str) -> Callable[..., Any]:
    """`resolve`, and it must be callable."""
    obj = resolve(ref, key)
    if not callable(obj):
        raise ConfigError(f"{key}: {ref.strip()!r} is not callable")
    return obj
