"""The book's Meetup RSVP pipeline: its queries, its synthetic RSVPs and its page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

# the Meetup page, served by the gateways at /demo/ (`[gateway.views]`)
VIEW_DIR = Path(__file__).with_name("view")
VIEW = "demo"


def with_view(cfg: Any) -> Any:
    """`cfg` with the Meetup page among its gateway views (unless it names its own)."""
    if VIEW in cfg.gateway.views:
        return cfg
    views = {**cfg.gateway.views, VIEW: str(VIEW_DIR)}
    return msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, views=views))
