"""The foundation's error for a bad configuration value.

Its own module so the compilers the config validates with (`runtime.query`,
`runtime.logic`) can raise it without importing the config they are part of.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and the expected form."""
