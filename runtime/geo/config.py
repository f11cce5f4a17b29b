"""`[streams.X.replicate]`: which sites hold a copy of stream X (docs/geo.md).

Every site of the group (`site` plus `to`) keeps a full copy that takes writes of its own
and sources the other copies' local writes; message ids are kept, so a retried event is
stored once per copy. Site names are the sites' JetStream domains (`nats up --sites`
names them site-a, site-b, ...).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

SiteName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=64)]


class ReplicateConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """`to`: the other sites holding a copy; `site`: the site the stream is declared on
    (where `nats.url` points in normal operation)."""

    to: list[SiteName]
    site: SiteName = "site-a"

    def __post_init__(self) -> None:
        if not self.to:
            raise msgspec.ValidationError("replicate.to names at least one other site")
        if self.site in self.to or len(set(self.to)) != len(self.to):
            raise msgspec.ValidationError("replicate.to names each other site once, not `site`")

    @property
    def sites(self) -> list[str]:
        """Every site of the group, the declaring one first."""
        return [self.site, *self.to]


__all__ = ["ReplicateConfig", "SiteName"]
