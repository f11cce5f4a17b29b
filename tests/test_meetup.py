"""The synthetic RSVP generator: the book's schema exactly, deterministic, Zipf-shaped."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cluster.demo.rsvps import RsvpGenerator, slug, topic_vocabulary

pytestmark = pytest.mark.unit

# The copy kept with the tests, so the schema check never skips.
EMBEDDED_SAMPLE = Path(__file__).parent / "data" / "meetup_rsvp_sample.json"
# The book's file, in shared/ beside the repository (dev and CI).
SHARED_SAMPLE = Path(__file__).parents[1].parent / "shared/data/meetup_rsvp_sample.json"


def shape(value: Any) -> Any:
    """The schema of a JSON value: keys in order, nesting, and leaf type names.

    A list's shape is the set of its elements' shapes, so lists of different lengths with
    the same element schema compare equal; an empty list has an empty shape.
    """
    if isinstance(value, dict):
        return tuple((k, shape(v)) for k, v in value.items())
    if isinstance(value, list):
        return ("list", frozenset(shape(v) for v in value))
    return type(value).__name__


def load_sample(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_embedded_sample_is_the_books_sample() -> None:
    if not SHARED_SAMPLE.exists():
        pytest.skip(f"{SHARED_SAMPLE} absent: only the embedded copy is checked")
    assert load_sample(EMBEDDED_SAMPLE) == load_sample(SHARED_SAMPLE)


@pytest.mark.parametrize(
    "sample_path", [EMBEDDED_SAMPLE, SHARED_SAMPLE], ids=["embedded", "shared"]
)
def test_schema_matches_sample_exactly(sample_path: Path) -> None:
    if not sample_path.exists():
        pytest.skip(f"{sample_path} absent (shared/ is not beside the repository)")
    expected = shape(load_sample(sample_path))
    gen = RsvpGenerator(seed=11)
    for rsvp in gen.take(2000):
        assert shape(rsvp) == expected
        assert rsvp["group"]["group_topics"], "a group has at least one topic"
        # The wire form keeps the types too (e.g. a float latitude stays a float).
        assert shape(msgspec.json.decode(msgspec.json.encode(rsvp))) == expected


def test_value_domains_are_realistic() -> None:
    rsvps = RsvpGenerator(seed=5).take(3000)
    responses = Counter(r["response"] for r in rsvps)
    assert set(responses) <= {"yes", "no"}
    assert responses["yes"] > 3 * responses["no"] > 0
    assert {r["visibility"] for r in rsvps} <= {"public", "members"}
    topics_of_group: dict[int, list[dict[str, str]]] = {}
    for r in rsvps:
        group, event = r["group"], r["event"]
        assert 1 <= len(group["group_topics"]) <= 15
        names = [t["topic_name"] for t in group["group_topics"]]
        assert len(set(names)) == len(names)
        for t in group["group_topics"]:
            assert t["urlkey"] == slug(t["topic_name"])
        # A group's topic list is fixed: every RSVP for it carries the same list.
        assert (
            topics_of_group.setdefault(group["group_id"], group["group_topics"])
            == (group["group_topics"])
        )
        assert len(group["group_country"]) == 2 and group["group_country"].islower()
        assert -90 <= group["group_lat"] <= 90 and -180 <= group["group_lon"] <= 180
        assert abs(r["venue"]["lat"] - group["group_lat"]) < 0.2
        assert event["event_id"].isdigit()
        assert event["event_url"] == (
            f"http://www.meetup.com/{group['group_urlname']}/events/{event['event_id']}/"
        )
        assert event["time"] > r["mtime"]
        assert r["member"]["member_name"]
        assert r["member"]["photo"].startswith("http://photos")


def test_same_seed_same_sequence_other_seed_differs() -> None:
    a, b = RsvpGenerator(seed=42), RsvpGenerator(seed=42)
    first = a.take(500)
    assert first == b.take(500)
    assert first == [next(it) for it in [iter(RsvpGenerator(seed=42))] for _ in range(500)]
    other = RsvpGenerator(seed=43).take(500)
    assert sum(x != y for x, y in zip(first, other, strict=True)) > 450


def test_returned_dicts_are_independent() -> None:
    gen = RsvpGenerator(seed=1, groups=1)  # one group: every RSVP shares its topics
    first = gen.next()
    first["group"]["group_topics"].clear()
    assert gen.next()["group"]["group_topics"]


def test_topics_are_zipf_skewed() -> None:
    gen = RsvpGenerator(seed=2024)
    counts = Counter(t["topic_name"] for r in gen.take(20_000) for t in r["group"]["group_topics"])
    per_topic = [counts.get(name, 0) for _, name in gen.topics]
    top, median = max(per_topic), statistics.median(per_topic)
    assert top / max(median, 1) > 10, (top, median)
    assert counts.most_common(1)[0][0] in {name for _, name in gen.topics[:10]}


def test_ids_unique_and_mtime_increasing() -> None:
    rsvps = RsvpGenerator(seed=9, start_ms=1_700_000_000_000).take(20_000)
    ids = [r["rsvp_id"] for r in rsvps]
    assert len(set(ids)) == len(ids)
    mtimes = [r["mtime"] for r in rsvps]
    assert mtimes[0] > 1_700_000_000_000
    assert all(b > a for a, b in zip(mtimes, mtimes[1:], strict=False))


def test_vocabulary_unique_and_sized() -> None:
    for n in (1, 400, 900):
        vocab = topic_vocabulary(n)
        assert len(vocab) == n
        assert len({k for k, _ in vocab}) == n
        assert len({name for _, name in vocab}) == n
    assert topic_vocabulary(3) == [
        ("social", "Social"),
        ("software-development", "Software Development"),
        ("hiking", "Hiking"),
    ]
    assert len(RsvpGenerator(seed=0, topics=25).topics) == 25
    with pytest.raises(ValueError):
        topic_vocabulary(0)


def test_to_ndjson_writes_the_next_events(tmp_path: Path) -> None:
    gen = RsvpGenerator(seed=3)
    head = gen.take(2)
    path = gen.to_ndjson(tmp_path / "rsvps.ndjson", 100)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 100
    expected = RsvpGenerator(seed=3).take(102)
    assert head == expected[:2]
    assert [json.loads(line) for line in lines] == expected[2:]
