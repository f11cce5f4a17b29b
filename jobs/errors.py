"""The analysis tier's error for a bad job, raised by specs, JSON paths and durations alike."""

from __future__ import annotations

from runtime.errors import TierflowError


class JobError(TierflowError, ValueError):
    """A job spec or a JSON path is invalid; the message names the field and the fix."""
