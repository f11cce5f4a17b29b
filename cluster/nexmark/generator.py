"""The Nexmark event model: persons, auctions and bids of an online auction.

It follows the generator of the Apache Beam and `nexmark/nexmark` suites
(`NexmarkGenerator`, `GeneratorConfig` defaults), so query answers mean what they mean
there:

- event n is a person, an auction or a bid by n mod 50: 1 person, then 3 auctions, then 46
  bids (proportions 1:3:46);
- ids count up from 1000 in their own kind; an auction's seller is one of the last 1,000
  persons (ids may lead by up to 10, persons about to exist), and a bid's auction one of the
  last 100 auctions (leading by up to 10); as in `nexmark/nexmark` (hotSellersRatio 4,
  hotBiddersRatio 4, hotAuctionRatio 2), three quarters of the sellers and bidders and half
  of the bids' auctions are "hot": the newest multiple of 100 among the ids so far;
- prices are log-uniform from 1 to 10^6 (cents), categories 10..14, auctions last 1-20 s of
  event time (`expires`);
- event n's time is `base_ms + n * 1000 / rate` (a configurable rate of event time), and the
  events are emitted shuffled within groups of `disorder` (so an event's time is behind the
  newest seen by less than `disorder / rate` seconds: the out-of-orderness a watermark
  must allow).

Every event is a pure function of (seed, n) (`random.Random` seeded per event, as Beam's
generator seeds per event id), so any range of the stream can be regenerated, and the
oracle (tests/nexmark_oracle.py) sees exactly what was published.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Generator",
    "Kind",
    "STREAMS",
    "event_kind",
]

Kind = Literal["person", "auction", "bid"]
STREAMS: tuple[Kind, ...] = ("person", "auction", "bid")

PERSON_PROPORTION, AUCTION_PROPORTION, BID_PROPORTION = 1, 3, 46
TOTAL = PERSON_PROPORTION + AUCTION_PROPORTION + BID_PROPORTION
FIRST_PERSON_ID = FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID, NUM_CATEGORIES = 10, 5
NUM_ACTIVE_PEOPLE, NUM_IN_FLIGHT_AUCTIONS = 1000, 100
PERSON_ID_LEAD = AUCTION_ID_LEAD = 10
HOT_SELLER_RATIO, HOT_BIDDER_RATIO, HOT_AUCTION_RATIO = 4, 4, 2
HOT_STEP = 100  # hot ids are the multiples of this among the ids so far

US_STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
US_CITIES = (
    "Phoenix",
    "Los Angeles",
    "San Francisco",
    "Boise",
    "Portland",
    "Bend",
    "Redmond",
    "Seattle",
    "Kent",
    "Cheyenne",
)
FIRST_NAMES = ("Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah", "Deiter")
LAST_NAMES = (
    "Shultz",
    "Abrams",
    "Spencer",
    "White",
    "Bartels",
    "Walton",
    "Smith",
    "Jones",
    "Noris",
)
CHANNELS = ("Google", "Facebook", "Baidu", "Apple")


def event_kind(n: int) -> Kind:
    rem = n % TOTAL
    if rem < PERSON_PROPORTION:
        return "person"
    if rem < PERSON_PROPORTION + AUCTION_PROPORTION:
        return "auction"
    return "bid"


def _last_person(n: int) -> int:
    """The base-0 id of the newest person at or before event n."""
    epoch, offset = divmod(n, TOTAL)
    if offset >= PERSON_PROPORTION:
        offset = PERSON_PROPORTION - 1
    return epoch * PERSON_PROPORTION + offset


def _last_auction(n: int) -> int:
    """The base-0 id of the newest auction at or before event n (-1 before the first)."""
    epoch, offset = divmod(n, TOTAL)
    if offset < PERSON_PROPORTION:
        epoch -= 1
        offset = AUCTION_PROPORTION - 1
    elif offset >= PERSON_PROPORTION + AUCTION_PROPORTION:
        offset = AUCTION_PROPORTION - 1
    else:
        offset -= PERSON_PROPORTION
    return epoch * AUCTION_PROPORTION + offset


def _recent_person(rng: random.Random, n: int) -> int:
    people = _last_person(n) + 1
    active = min(people, NUM_ACTIVE_PEOPLE)
    return people - active + rng.randrange(active + PERSON_ID_LEAD)


def _recent_auction(rng: random.Random, n: int) -> int:
    last = max(0, _last_auction(n))
    low = max(0, last - NUM_IN_FLIGHT_AUCTIONS)
    return low + rng.randrange(last - low + 1 + AUCTION_ID_LEAD)


def _hot(rng: random.Random, ratio: int) -> bool:
    return rng.randrange(ratio) > 0


@dataclass(frozen=True)
class Generator:
    """Nexmark events from `first` on: `rate` events per second of event time from
    `base_ms`, emitted shuffled within groups of `disorder` (1: in order)."""

    seed: int = 0
    rate: int = 10_000
    base_ms: int = 1_700_000_000_000
    disorder: int = 1

    def time_ms(self, n: int) -> int:
        return self.base_ms + n * 1000 // self.rate

    def event(self, n: int) -> tuple[Kind, dict[str, Any]]:
        """Event n: its kind and its fields (times in epoch ms)."""
        rng = random.Random(self.seed * 1_000_003 + n)
        kind = event_kind(n)
        t = self.time_ms(n)
        if kind == "person":
            pid = _last_person(n) + FIRST_PERSON_ID
            return kind, {
                "id": pid,
                "name": f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
                "emailAddress": f"{rng.choice(LAST_NAMES).lower()}@example.com",
                "creditCard": " ".join(f"{rng.randrange(10_000):04d}" for _ in range(4)),
                "city": rng.choice(US_CITIES),
                "state": rng.choice(US_STATES),
                "dateTime": t,
                "extra": "",
            }
        if kind == "auction":
            newest = _last_person(n)
            if _hot(rng, HOT_SELLER_RATIO):
                seller = newest // HOT_STEP * HOT_STEP
            else:
                seller = _recent_person(rng, n)
            initial = _price(rng)
            return kind, {
                "id": _last_auction(n) + FIRST_AUCTION_ID,
                "itemName": f"item-{rng.randrange(1_000_000)}",
                "description": "",
                "initialBid": initial,
                "reserve": initial + _price(rng),
                "dateTime": t,
                "expires": t + 1000 + rng.randrange(19_000),
                "seller": seller + FIRST_PERSON_ID,
                "category": FIRST_CATEGORY_ID + rng.randrange(NUM_CATEGORIES),
                "extra": "",
            }
        newest = max(0, _last_auction(n))
        if _hot(rng, HOT_AUCTION_RATIO):
            auction = newest // HOT_STEP * HOT_STEP
        else:
            auction = _recent_auction(rng, n)
        people = _last_person(n)
        if _hot(rng, HOT_BIDDER_RATIO):
            bidder = people // HOT_STEP * HOT_STEP + 1
        else:
            bidder = _recent_person(rng, n)
        channel = rng.randrange(len(CHANNELS) + 1)
        name = CHANNELS[channel] if channel < len(CHANNELS) else f"channel-{rng.randrange(1000)}"
        return kind, {
            "auction": auction + FIRST_AUCTION_ID,
            "bidder": bidder + FIRST_PERSON_ID,
            "price": _price(rng),
            "channel": name,
            "url": f"https://www.nexmark.com/{_word(rng)}/{_word(rng)}/{_word(rng)}/item.htm"
            f"?query=1&channel_id={channel}",
            "dateTime": t,
            "extra": "",
        }

    def order(self, first: int, count: int) -> list[int]:
        """The event numbers of [first, first + count) in the order they are emitted."""
        out: list[int] = []
        g = max(1, self.disorder)
        for start in range(first, first + count, g):
            group = list(range(start, min(start + g, first + count)))
            if g > 1:
                random.Random(self.seed * 7_919 + start).shuffle(group)
            out.extend(group)
        return out

    def events(self, first: int, count: int) -> Iterator[tuple[int, Kind, dict[str, Any]]]:
        """(n, kind, fields) of events [first, first + count), in emission order."""
        for n in self.order(first, count):
            kind, fields = self.event(n)
            yield n, kind, fields


def _price(rng: random.Random) -> int:
    return round(10.0 ** (rng.random() * 6.0) * 100.0)


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(3, 8)))
