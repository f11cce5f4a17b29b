"""A stranger's configuration: its own stream, generic jobs, tokens (and mutual TLS).

A file that defines its own `[streams.X]` keeps the system streams (`results`,
`deadletter`): without them every analysis job would fail in the sink. These tests load
such a file, then run `tierflow up` with it and read every job's answer through the
gateway, compared with an exact recomputation in plain Python.
"""

from __future__ import annotations

import json
import os
import random
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from jobs.event_time import iso_ms
from runtime import runstate
from runtime.config import ConfigError, load, validate
from runtime.waiting import wait_until

TIERFLOW = str(Path(sys.executable).with_name("tierflow"))
PRODUCER = "flights-producer-tok"
CONSUMER = "flights-consumer-tok"
N_EVENTS = 2000
TOP_N = 5
# the windowed job's event time: 40 ms apart from a start inside a slide (80 s of events),
# so every event is in three windows of 60 s sliding every 20 s, counted by 20 s panes
T0_MS = 1_767_225_607_000  # 2026-01-01T00:00:07Z
STEP_MS, LENGTH_MS, SLIDE_MS, WINDOW_N = 40, 60_000, 20_000, 3

# --------------------------------------------------------------------------- config only


@pytest.mark.unit
def test_own_stream_keeps_the_system_streams() -> None:
    cfg = validate({"streams": {"flights": {"subjects": ["raw.flights"]}}})
    assert cfg.streams["flights"].subjects == ["raw.flights"]
    assert cfg.streams["results"].subjects == ["results.>"]
    assert cfg.streams["deadletter"].subjects == ["deadletter.>"]
    assert "meetup" not in cfg.streams  # the Meetup default is only for a file with no streams


@pytest.mark.unit
def test_system_stream_may_be_tuned_with_its_own_subjects() -> None:
    cfg = validate(
        {"streams": {"f": {}, "results": {"subjects": ["results.>"], "duplicate_window_s": 900}}}
    )
    assert cfg.streams["results"].duplicate_window_s == 900
    # named without subjects, a system stream keeps its own (not raw.<name>)
    cfg = validate({"streams": {"f": {}, "deadletter": {"max_age_s": 60}}})
    assert cfg.streams["deadletter"].subjects == ["deadletter.>"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("streams", "key"),
    [
        ({"results": {"subjects": ["raw.results"]}}, "streams.results"),
        ({"deadletter": {"subjects": ["raw.deadletter"]}}, "streams.deadletter"),
        ({"buffer": {"subjects": ["buf.x"]}}, "streams.buffer"),
        ({"mine": {"subjects": ["results.mine"]}}, "streams.mine.subjects"),
        ({"mine": {"subjects": ["raw.a", "deadletter.*"]}}, "streams.mine.subjects"),
        ({"everything": {"subjects": [">"]}}, "streams.everything.subjects"),
        ({"kvs": {"subjects": ["$KV.results.x"]}}, "streams.kvs.subjects"),
    ],
)
def test_user_stream_may_not_take_a_system_name_or_subject(streams: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: .*(reserved|system)"):
        validate({"streams": streams})


# --------------------------------------------------------------------------- end to end


def flights(n: int = N_EVENTS, seed: int = 7) -> list[dict[str, Any]]:
    """Deterministic flights with fields of their own (no Meetup shape)."""
    rng = random.Random(seed)
    airports = ["JFK", "LAX", "ORD", "ATL", "DFW", "DEN", "SFO", "SEA", "BOS", "MIA"]
    weights = [30, 25, 20, 12, 9, 7, 5, 4, 2, 1]  # distinct counts at the top: no ties
    carriers = ["AA", "DL", "UA", "WN", "B6", "AS"]
    out = []
    for i in range(n):
        out.append(
            {
                "id": f"fl-{i}",
                "flight": f"FL{i:05d}",
                "origin": rng.choices(airports, weights)[0],
                "carrier": rng.choice(carriers),
                "tail": f"N{rng.randrange(80):03d}",
                "delay_min": rng.randrange(-10, 180),
                "response": "yes" if rng.random() < 0.7 else "no",  # on time?
                "ts": T0_MS + i * STEP_MS,
            }
        )
    return out


def expected(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every job's exact answer, by its gateway KV key."""
    origins = Counter(e["origin"] for e in events)
    ranked = sorted(origins.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_N]
    carriers = Counter(e["carrier"] for e in events)
    answers = Counter(e["response"] for e in events)
    out: dict[str, dict[str, Any]] = {
        "flights_top_origin.all": {
            "key": "all",
            "top": [{"item": k, "count": c, "error": 0} for k, c in ranked],
            "events": len(events),
        },
        "flights_tails.all": {"distinct": len({e["tail"] for e in events})},
        "flights_on_time.all": {
            "key": "all",
            "yes": answers["yes"],
            "no": answers["no"],
            "ratio": answers["yes"] / answers["no"],
        },
        "flights_sample.all": {"seen": len(events)},
    }
    for carrier, c in carriers.items():
        out[f"flights_by_carrier.{carrier}"] = {"key": carrier, "carrier": carrier, "count": c}
    return out


def expected_windows(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The sliding-window top-N's exact answer, by window start (ISO, as the job keys it)."""
    windows: dict[int, Counter[str]] = {}
    for e in events:
        t = e["ts"]
        for start in range(t - t % SLIDE_MS, t - LENGTH_MS, -SLIDE_MS):
            windows.setdefault(start, Counter())[e["origin"]] += 1
    out = {}
    for start, counts in windows.items():
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:WINDOW_N]
        key = iso_ms(start)
        out[key] = {
            "key": key,
            "window_start": key,
            "window_end": iso_ms(start + LENGTH_MS),
            "top": [{"item": k, "count": c, "error": 0} for k, c in ranked],
        }
    return out


def windows_of(got: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The windowed job's rows read from the results bucket, by their `key`."""
    return {
        v["key"]: v
        for k, v in got.items()
        if k.startswith("flights_origin_window.") and isinstance(v, dict) and "key" in v
    }


JOBS = """
[[jobs]]
name = "flights_top_origin"
kind = "topn"
stream = "flights"
field = "origin"
n = 5

[[jobs]]
name = "flights_origin_window"
kind = "topn"
stream = "flights"
field = "origin"
n = 3
time_field = "ts"
window = { length = "60s", slide = "20s", watermark = "10m" }

[[jobs]]
name = "flights_tails"
kind = "distinct"
stream = "flights"
field = "tail"

[[jobs]]
name = "flights_by_carrier"
kind = "count"
stream = "flights"
by = ["carrier"]

[[jobs]]
name = "flights_sample"
kind = "sample"
stream = "flights"
field = "flight"
n = 10
seed = 3

[[jobs]]
name = "flights_on_time"
kind = "custom"
stream = "flights"
function = "cluster.demo.meetup:responses"
"""


def write_config(tmp_path: Path, mtls: bool, standby: bool = False) -> Path:
    state = tmp_path / "state"
    text = (
        f'state_dir = "{state}"\n'
        "[ray]\nnum_cpus = 2\n"
        "[roles.collector]\nport = 0\n"
        "[roles.gateway]\nport = 0\n"
        "[roles.logger]\nk = 1\n"
        f'[spark]\nmaster = "local[2]"\nstandby = {str(standby).lower()}\n'
        f'[auth]\nproducer_tokens = ["{PRODUCER}"]\nconsumer_tokens = ["{CONSUMER}"]\n'
        '[streams.flights]\nsubjects = ["raw.flights"]\n'
    )
    if mtls:
        from runtime.certs import make_dev_certs

        make_dev_certs(state / "certs")
        text += "[tls]\nenabled = true\nverify_clients = true\n"
    path = tmp_path / "tierflow.toml"
    path.write_text(text + JOBS)
    return path


def run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TIERFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def analysis_status(path: Path, env: dict[str, str]) -> dict[str, Any]:
    """`tierflow status --json`'s analysis part: the active driver's pid and takeover."""
    out = run(["status", "--json", "--config", str(path)], env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout).get("analysis") or {}


def kill_active_driver(path: Path, env: dict[str, str]) -> None:
    """SIGKILL the active analysis driver (a process of the runtime this test started) and
    wait until the standby says it took the queries over."""
    active = wait_until(
        lambda: (a := analysis_status(path, env)).get("state") == "running" and a.get("pid") and a,
        timeout=120,
        interval=1,
        what="the active analysis driver",
    )
    os.kill(active["pid"], signal.SIGKILL)
    took = wait_until(
        lambda: (
            (a := analysis_status(path, env)).get("pid") not in (None, active["pid"])
            and a.get("took_over")
            and a
        ),
        timeout=180,
        interval=1,
        what="the standby's takeover",
    )
    assert took["took_over"]["at"] > 0, took


def http(
    url: str, token: str, ctx: ssl.SSLContext | None, body: bytes | None = None
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    if body is not None:
        headers["Content-Type"] = "application/x-ndjson"
    req = urllib.request.Request(url, data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=60, context=ctx) as resp:
        return json.loads(resp.read())


def matches(got: dict[str, Any], want: dict[str, dict[str, Any]]) -> bool:
    return all(k in got and want[k].items() <= got[k].items() for k in want)


LONG_ONLY = pytest.mark.skipif(
    "'long' not in (config.getoption('markexpr') or '')",
    reason="make test-long: tokens-and-mutual-tls, which make test runs, has the tokens too",
)


@pytest.mark.parametrize(
    "mtls",
    [pytest.param(False, marks=[pytest.mark.long, LONG_ONLY]), True],
    ids=["tokens", "tokens-and-mutual-tls"],
)
def test_up_with_own_stream_and_generic_jobs_gives_exact_answers(
    tmp_path: Path, mtls: bool
) -> None:
    """`tierflow up` with a file that defines only its own stream, one generic job of each
    kind, exact answers read through the gateway (with client verification on in the TLS case).

    With mutual TLS the analysis driver also runs as a warm pair (`spark.standby`): the
    active one is SIGKILLed after the first half of the events is answered, and the
    standby, with the same tokens and certificates, takes over and answers the rest."""
    path = write_config(tmp_path, mtls, standby=mtls)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")}
    cfg = load(path, environ=env)
    ctx = None
    if mtls:
        from runtime.tls import client_ssl_context

        ctx = client_ssl_context(cfg)
    events = flights()
    want = expected(events)
    want_windows = expected_windows(events)
    assert len(want_windows) == 7  # 80 s of events from :07: windows starting -40 s .. +80 s
    up = run(["up", "--detach", "--config", str(path), "--timeout", "240"], env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = runstate.read_state(cfg)
        assert state is not None
        collector, gateway = state["collector"]["url"], state["gateway"]["url"]

        def send(part: list[dict[str, Any]]) -> int:
            accepted = 0
            for i in range(0, len(part), 500):
                body = "\n".join(json.dumps(e) for e in part[i : i + 500]).encode()
                reply = http(f"{collector}/v1/streams/flights/events", PRODUCER, ctx, body)
                accepted += reply["accepted"]
            return accepted

        got: dict[str, Any] = {}
        polls = [0]

        def read_results() -> dict[str, Any]:
            body = http(f"{gateway}/v1/kv/results", CONSUMER, ctx)
            got.clear()
            got.update({e["key"]: e["value"] for e in body["entries"]})
            return got

        half = len(events) // 2 if mtls else len(events)
        assert send(events[:half]) == half
        if mtls:
            first = expected(events[:half])
            wait_until(
                lambda: matches(read_results(), first),
                timeout=600,
                interval=1,
                what="the first half's exact answers",
            )
            kill_active_driver(path, env)
        assert send(events[half:]) == len(events) - half

        def answered() -> bool:
            polls[0] += 1
            if polls[0] % 15 == 0:  # fail fast, with the reason, once a job keeps failing
                listed = run(["jobs", "list", "--json", "--config", str(path)], env)
                failing = {
                    r["name"]: (r.get("error") or "")[-800:]
                    for r in json.loads(listed.stdout or "[]")
                    if (r.get("restarts") or 0) >= 2
                }
                assert not failing, f"jobs keep failing: {failing}"
            read_results()
            return matches(got, want) and matches(windows_of(got), want_windows)

        def why() -> str:
            listed = run(["jobs", "list", "--json", "--config", str(path)], env)
            return f"results {got}; jobs {listed.stdout[-3000:]} {listed.stderr[-1000:]}"

        try:
            wait_until(answered, timeout=600, interval=2, what="every job's exact answer")
        except Exception as err:
            raise AssertionError(f"{err}: {why()}") from None
        for key, row in want.items():
            assert row.items() <= got[key].items(), key
        tails = got["flights_tails.all"]
        assert tails["lower"] <= want["flights_tails.all"]["distinct"] <= tails["upper"]
        sample = got["flights_sample.all"]["sample"]
        assert len(sample) == 10 and set(sample) <= {e["flight"] for e in events}
        # one result per carrier, nothing else under the count job
        carriers = {k for k in got if k.startswith("flights_by_carrier.")}
        assert carriers == {k for k in want if k.startswith("flights_by_carrier.")}
        # a sliding window top-N under the same credentials: every window once, exact
        windows = windows_of(got)
        assert set(windows) == set(want_windows)
        for key, row in want_windows.items():
            assert row.items() <= windows[key].items(), key
        listed = run(["jobs", "list", "--json", "--config", str(path)], env)
        assert listed.returncode == 0, listed.stderr
        rows = {r["name"]: r for r in json.loads(listed.stdout)}
        names = [n for n in rows if n.startswith(("flights_", "deadletter_flights"))]
        assert len(names) == 7, sorted(rows)  # six jobs and the stream's dead-letter query
        for name in names:  # no batch ever failed (the flights bug: "no response from stream")
            row = rows[name]
            error = (row["error"] or "")[:3000]
            assert (row["state"], row["restarts"], error) == ("running", 0, ""), (name, error)
    finally:
        down = run(["down", "--config", str(path)], env)
    assert down.returncode == 0, down.stdout + down.stderr
