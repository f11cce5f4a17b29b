"""The chaos report: what was sent, acknowledged, lost, altered, duplicated, refused, and
how faults went. Ids in it are `stream/id` (the same id on two streams is two events).

The numbers are computed here from plain data (the ack timeline, the fault records, the
verdicts), so they are unit-tested without a pipeline; `write` saves JSON and the rich
table's text under `reports/`.
"""

from __future__ import annotations

import io
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from cluster.tables import Column, build

MIN_WINDOW_S = 2.0


@dataclass
class FaultReport:
    label: str
    started_s: float
    ended_s: float
    recovered_s: float | None  # since the fault began, until its target was healthy
    throughput_eps: float  # events acknowledged per second from start to recovery
    detail: str = ""
    error: str = ""


@dataclass
class DeliveryCheck:
    """Gateway clients resuming by cursor: every matching stored event exactly once."""

    expected: int = 0
    received: int = 0
    missing: list[str] = field(default_factory=list)
    duplicated: dict[str, int] = field(default_factory=dict)
    reconnects: int = 0

    @property
    def ok(self) -> bool:
        return not self.missing and not self.duplicated


@dataclass
class ScenarioReport:
    scenario: str
    seed: int
    events: int  # valid events the producers had to deliver (all streams)
    rate_eps: float  # the paced rate the load ran at
    sent: int  # events sent, retries included
    acknowledged: int
    stored: int
    lost: list[str] = field(default_factory=list)  # stream/id acknowledged, not stored
    duplicated: dict[str, int] = field(default_factory=dict)  # stream/id stored n > 1 times
    altered: list[str] = field(default_factory=list)  # stream/id stored with other bytes
    duplicated_payloads: dict[str, list[str]] = field(default_factory=dict)  # under 2+ ids
    refused_stored: list[str] = field(default_factory=list)  # answered 4xx, stored anyway
    expected_refused: int = 0  # invalid/oversized events sent that must be refused
    wrongly_accepted: list[str] = field(default_factory=list)  # of those, acknowledged
    wrongly_refused: list[str] = field(default_factory=list)  # valid events answered 4xx
    adopted_ids: int = 0  # events without id resent under the ids an error answer gave
    retried: dict[int, int] = field(default_factory=dict)  # resent requests by status
    ws_requests: int = 0  # requests sent as producer WebSocket frames
    blind_duplicates: int = 0  # copies explained by a resend after no answer (no id)
    streams: dict[str, str] = field(default_factory=dict)  # per-stream verdict lines
    unacknowledged_stored: int = 0
    refused: int = 0  # 503s the producer retried
    rejected: dict[int, int] = field(default_factory=dict)  # other answers, not retried
    gateway: DeliveryCheck | None = None
    analysis_mismatches: list[str] | None = None  # None: no analysis in this scenario
    faults: list[FaultReport] = field(default_factory=list)
    throughput_eps: float = 0.0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    error: str = ""
    # the site-loss scenarios: their own report (cluster.chaos.site_loss.SiteLossReport
    # .to_dict(): figures and the per-copy verdict); None for the others
    site: dict[str, Any] | None = None

    def add_verdicts(self, verdicts: Iterable[Any]) -> None:
        """Fold `cluster.verify.StreamVerdict`s (one per stream) into the report."""
        for v in verdicts:
            s = v.stream
            self.stored += v.stored
            self.lost += [f"{s}/{i}" for i in v.lost]
            self.altered += [f"{s}/{i}" for i in v.altered]
            self.duplicated.update({f"{s}/{i}": n for i, n in v.duplicated.items()})
            self.duplicated_payloads.update(
                {f"{s}/{h}": [f"{s}/{i}" for i in ids] for h, ids in v.duplicated_payloads.items()}
            )
            self.refused_stored += [f"{s}/{i}" for i in v.refused_stored]
            self.unacknowledged_stored += v.unexpected
            self.blind_duplicates += v.blind_duplicates
            self.streams[s] = str(v)

    @property
    def ok(self) -> bool:
        """Zero acknowledged loss, nothing altered or duplicated (by id or by payload),
        every invalid/oversized event refused and absent, every valid one acknowledged,
        clients and analysis exact, every fault applied and healed."""
        return (
            not self.error
            and not self.lost
            and not self.duplicated
            and not self.altered
            and not self.duplicated_payloads
            and not self.refused_stored
            and not self.wrongly_accepted
            and not self.wrongly_refused
            and self.acknowledged == self.events
            and (self.gateway is None or self.gateway.ok)
            and not self.analysis_mismatches
            and not any(f.error for f in self.faults)
            and (self.site is None or bool(self.site.get("ok")))
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["lost_count"] = len(self.lost)
        d["lost"] = self.lost[:20]
        d["duplicated_count"] = len(self.duplicated)
        d["duplicated"] = dict(list(self.duplicated.items())[:20])
        for name in ("altered", "refused_stored", "wrongly_accepted", "wrongly_refused"):
            d[f"{name}_count"] = len(d[name])
            d[name] = d[name][:20]
        d["duplicated_payloads_count"] = len(self.duplicated_payloads)
        d["duplicated_payloads"] = dict(list(self.duplicated_payloads.items())[:20])
        return d


def from_site_loss(name: str, seed: int, rate: float, rep: Any, elapsed_s: float) -> ScenarioReport:
    """A site-loss run (`cluster.chaos.site_loss.SiteLossReport`) as a scenario row: ids
    are `site/id` (per copy), the fault is the kill of site A with the time to the first
    acknowledgement on B as its recovery; every figure stays in `site`."""
    checks = rep.checks
    out = ScenarioReport(
        scenario=name,
        seed=seed,
        events=rep.events,
        rate_eps=round(rate, 1),
        sent=rep.events + rep.resent,
        acknowledged=rep.acked,
        stored=checks[0].stored if checks else 0,
        lost=[f"{c.site}/{i}" for c in checks for i in c.lost],
        duplicated={f"{c.site}/{i}": 2 for c in checks for i in c.duplicated},
        altered=[f"{c.site}/{i}" for c in checks for i in c.hash_mismatch],
        unacknowledged_stored=sum(len(c.unknown) for c in checks),
        error=rep.error,
        elapsed_s=round(elapsed_s, 1),
        site=rep.to_dict(),
    )
    unknown = [f"{c.site}/{i}" for c in checks for i in c.unknown]
    if unknown:
        out.notes.append(f"stored, never sent: {unknown[:10]}")
    if rep.killed_at is not None:
        start = rep.kill_after_s or 0.0
        out.faults.append(
            FaultReport(
                label=f"kill site-a x{len(rep.killed_pids)}",
                started_s=round(start, 2),
                ended_s=round(start, 2),
                recovered_s=rep.kill_to_first_ack_s,
                throughput_eps=0.0,
                detail=f"first ack on B {rep.kill_to_first_ack_s} s after the kill; "
                f"{rep.missing_on_b_during_outage} acked events not on B while A was down; "
                f"caught up {rep.catch_up_s} s after A returned "
                f"({rep.kicks} copies moved off the source retry backoff)",
                error="" if rep.kill_to_first_ack_s is not None else "no ack on B after the kill",
            )
        )
    out.notes.append(out.faults[0].detail if out.faults else "site A was never killed")
    return out


# --------------------------------------------------------------------------- pure numbers


def rate_between(timeline: Sequence[tuple[float, int]], start: float, end: float) -> float:
    """Events acknowledged per second in [start, end] from (time, count) ack records."""
    if end <= start:
        return 0.0
    n = sum(c for t, c in timeline if start <= t <= end)
    return round(n / (end - start), 1)


def delivery_check(
    expected: Iterable[str], received: Sequence[str], reconnects: int = 0
) -> DeliveryCheck:
    """Compare what a client should have got (matching stored ids) with what it got."""
    want = set(expected)
    counts = Counter(received)
    return DeliveryCheck(
        expected=len(want),
        received=len(received),
        missing=sorted(i for i in want if counts[i] == 0),
        duplicated={i: n for i, n in counts.items() if n > 1},
        reconnects=reconnects,
    )


def fault_reports(
    records: Iterable[Any], timeline: Sequence[tuple[float, int]]
) -> list[FaultReport]:
    """One row per injected fault; throughput over the fault's start..recovery window
    (at least `MIN_WINDOW_S`, so that batch granularity does not read as a stall)."""
    out = []
    for r in records:
        end = r.started_s + (r.recovered_s if r.recovered_s is not None else 0.0)
        end = max(end, r.ended_s, r.started_s + MIN_WINDOW_S)
        out.append(
            FaultReport(
                label=r.label,
                started_s=round(r.started_s, 2),
                ended_s=round(r.ended_s, 2),
                recovered_s=r.recovered_s,
                throughput_eps=rate_between(timeline, r.started_s, end),
                detail=r.detail,
                error=r.error,
            )
        )
    return out


# --------------------------------------------------------------------------- rendering


# The narrow view (80 columns) keeps the verdict and what it rests on; --wide and the
# report's .txt file show every column.
COLUMNS = (
    Column("scenario"),
    Column("seed", justify="right", wide_only=True),
    Column("sent", justify="right", wide_only=True),
    Column("acked", justify="right"),
    Column("lost", justify="right"),
    Column("dup", justify="right"),
    Column("refused", justify="right", wide_only=True),
    Column("gateway", wide_only=True),
    Column("analysis", justify="right", wide_only=True),
    Column("faults", "faults (recovery s)", flex=True, wide_only=True),
    Column("eps", "eps in faults / overall", justify="right", wide_only=True),
    Column("verdict", flex=True),
)


def rows(reports: Sequence[ScenarioReport]) -> list[dict[str, str]]:
    """One row of cells per scenario (what `table` shows)."""
    out = []
    for r in reports:
        gw = "-" if r.gateway is None else f"{r.gateway.received}/{r.gateway.expected}"
        if r.gateway is not None and not r.gateway.ok:
            gw += f" miss {len(r.gateway.missing)} dup {len(r.gateway.duplicated)}"
        an = (
            "-"
            if r.analysis_mismatches is None
            else ("exact" if not r.analysis_mismatches else "DIFF")
        )
        faults = "; ".join(f"{f.label} ({'ERR' if f.error else f.recovered_s})" for f in r.faults)
        during = [f.throughput_eps for f in r.faults]
        out.append(
            {
                "scenario": r.scenario,
                "seed": str(r.seed),
                "sent": str(r.sent),
                "acked": f"{r.acknowledged}/{r.events}",
                "lost": str(len(r.lost) + len(r.altered)),
                "dup": str(len(r.duplicated) + len(r.duplicated_payloads)),
                "refused": _refusals(r),
                "gateway": gw,
                "analysis": an,
                "faults": faults,
                "eps": f"{min(during) if during else 0:.0f}/{r.throughput_eps:.0f}",
                "verdict": "PASS" if r.ok else f"FAIL{': ' + r.error[:60] if r.error else ''}",
            }
        )
    return out


def table(reports: Sequence[ScenarioReport], *, wide: bool = True, width: int = 80) -> Table:
    """The summary as a rich Table, one row per scenario: every column (wide), or the
    verdict columns fitted to `width`."""
    return build(COLUMNS, rows(reports), wide=wide, width=width, title="tierflow chaos")


def _refusals(r: ScenarioReport) -> str:
    """Refused as expected / expected, with what went wrong about refusals."""
    wrong = len(r.wrongly_accepted) + len(r.refused_stored)
    right = r.expected_refused - len(r.wrongly_accepted)
    out = f"{right}/{r.expected_refused}"
    if wrong or r.wrongly_refused:
        out += f" BAD {wrong}+{len(r.wrongly_refused)}"
    return out


def render_text(reports: Sequence[ScenarioReport], width: int = 200) -> str:
    """The wide table as plain text (the report's .txt file): at least `width` columns,
    more when the table needs them, so no cell is cut."""
    t = table(reports)
    probe = Console(width=width, file=io.StringIO())
    need = probe.measure(t, options=probe.options.update(max_width=1 << 20)).maximum
    console = Console(width=max(width, need), record=True, file=io.StringIO())
    console.print(t)
    return console.export_text()


def write(reports: Sequence[ScenarioReport], directory: str | Path = "reports") -> Path:
    """Save `chaos-<time>.json` (every number) and `.txt` (the table); returns the JSON."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out / f"chaos-{stamp}.json"
    body = {"ok": all(r.ok for r in reports), "scenarios": [r.to_dict() for r in reports]}
    path.write_bytes(msgspec.json.format(msgspec.json.encode(body)))
    path.with_suffix(".txt").write_text(render_text(reports))
    return path
