"""JSON paths as a job names them, parsed (pure): ``a.b.c`` walks objects, ``name[]`` explodes
an array, a leading ``$.`` is allowed, and ``_subject``, ``_seq``, ``_ts`` and ``_msg_id`` name
the source's own columns. Here, apart from reading them with Spark (jobs/paths.py), so the
config checks a job's paths where it loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.errors import JobError

__all__ = ["PSEUDO_FIELDS", "Step", "parse_path"]

PSEUDO_FIELDS = {"_subject": "subject", "_seq": "seq", "_ts": "ts", "_msg_id": "msg_id"}


@dataclass(frozen=True)
class Step:
    """One path segment: an object member, exploded when it is an array (``name[]``)."""

    name: str
    explode: bool = False


_SEGMENT = re.compile(r"^([^.\[\]]+)(\[\])?$")


def parse_path(path: str) -> tuple[Step, ...]:
    """``group.group_topics[].topic_name`` -> steps; JobError naming the bad part."""
    text = path.strip()
    if text.startswith("$."):
        text = text[2:]
    if not text:
        raise JobError(f"JSON path {path!r} is empty")
    if text in PSEUDO_FIELDS:
        return (Step(text),)
    steps = []
    for part in text.split("."):
        m = _SEGMENT.match(part)
        if not m:
            raise JobError(
                f"JSON path {path!r}: bad segment {part!r} (use name, or name[] to explode an "
                "array; members are separated by '.')"
            )
        steps.append(Step(m.group(1), bool(m.group(2))))
    return tuple(steps)
