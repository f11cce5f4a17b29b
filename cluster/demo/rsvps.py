"""Synthetic Meetup RSVPs: the stand-in for the retired Meetup RSVP WebSocket stream.

Every RSVP has exactly the schema of the book's sample (`shared/data/meetup_rsvp_sample.json`):
the same keys in the same order and nesting, the same value types. The world behind it is
shaped like the real stream's: a vocabulary of a few hundred topic names whose popularity is
Zipf-distributed, groups with a fixed list of 1-15 topics in real cities, groups that get
RSVPs Zipf-wise (a few big groups, a long tail), members with names and photos, events with
venues, `mtime` strictly increasing and `rsvp_id` unique.

Guarantee: the sequence is a pure function of the constructor arguments. Two generators built
with the same arguments yield identical RSVPs; nothing reads the global `random` state or the
clock (`start_ms` defaults to a fixed instant, the sample's `mtime`).

    >>> gen = RsvpGenerator(seed=7)
    >>> rsvp = gen.next()
    >>> sorted(rsvp) == sorted(RsvpGenerator(seed=7).next())
    True
"""

from __future__ import annotations

import itertools
import random
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

# The sample RSVP's mtime (2016-09-06): the default start, so that runs are reproducible.
DEFAULT_START_MS = 1473159126069

# fmt: off
# Popular Meetup topics, most popular first: the order is the Zipf rank.
CORE_TOPICS: tuple[str, ...] = (
    "Social", "Software Development", "Hiking", "New In Town", "Fun Times", "Dining Out",
    "Social Networking", "Outdoor Adventures", "Professional Networking", "Web Development",
    "Adventure", "Fitness", "Nightlife", "Entrepreneurship", "Singles", "Self-Improvement",
    "Startup Businesses", "Travel", "Live Music", "Exploring the City", "Dinner and Drinks",
    "Expat", "Cultural Activities", "Wine", "Yoga", "Meditation", "Spirituality", "Photography",
    "Film", "Book Club", "Arts", "Dance", "Language & Culture", "Technology", "Data Science",
    "Machine Learning", "Artificial Intelligence", "Big Data", "Cloud Computing",
    "Mobile Development", "Open Source", "Small Business", "Charity Work", "Local Businesses",
    "Healthy Living", "Personal Development", "Career Network", "Leadership Development",
    "Public Speaking", "Investing", "Real Estate", "Personal Finance", "Marketing",
    "Social Media Marketing", "Women's Social", "Women Entrepreneurs", "Moms", "Parents",
    "Dog Lovers", "Board Games", "Video Games", "Tabletop Gaming", "Running", "Cycling",
    "Mountain Biking", "Rock Climbing", "Camping", "Kayaking", "Sailing", "Scuba Diving",
    "Skiing", "Snowboarding", "Tennis", "Soccer", "Volleyball", "Basketball", "Golf",
    "Martial Arts", "Nutrition", "Vegan", "Vegetarian", "Cooking", "Craft Beer", "Coffee",
    "Theater", "Comedy", "Improv", "Writing", "Poetry", "Painting", "Drawing", "Crafts",
    "Knitting", "Gardening", "Sustainability", "Environment", "Politics", "Philosophy", "Science",
    "Astronomy", "History", "LGBTQ", "Mindfulness", "Alternative Health", "Holistic Health",
    "Life Coaching", "Law of Attraction", "Music", "Jazz", "Karaoke", "Salsa", "Swing Dance",
    "Ballroom Dancing", "Wine Tasting", "Brunch", "Happy Hour", "Blockchain", "Cryptocurrency",
    "Python", "JavaScript", "Java", "DevOps", "Cybersecurity", "UX Design", "Product Management",
    "Agile Project Management", "Game Development", "Internet of Things", "Virtual Reality",
    "Robotics", "3D Printing", "Makers", "Volunteering", "Animal Rescue", "Pets", "Beach",
    "Road Trips", "Backpacking", "Walking", "Urban Exploration", "Architecture", "Museums",
    "Classical Music", "Singing", "Songwriting", "Guitar", "Anime", "Science Fiction",
    "Fantasy", "Trivia", "Pub Quiz", "Chess", "Poker", "Bridge", "Speed Dating", "Divorce Support",
    "Mental Health", "Support Groups", "Buddhism", "Christian", "Interfaith", "Atheists",
    "Parenting", "Stay-at-Home Moms", "Retirement", "Seniors", "Young Professionals",
)

# Word families combined into the long tail of the vocabulary.
_TECH = (
    "Python", "JavaScript", "Java", "Go", "Rust", "Ruby", "PHP", "C#", ".NET", "Scala",
    "Kotlin", "Swift", "React", "Angular", "Node.js", "Docker", "Kubernetes", "AWS", "Azure",
    "Linux", "Data Analytics", "Data Visualization", "Deep Learning", "Cybersecurity",
    "UX Design", "Game Development", "Android", "iOS", "Elixir", "Haskell",
)
_TECH_FORMS = ("{} Developers", "{} Users", "{} Beginners", "{} Workshops")
_ACTIVITIES = (
    "Hiking", "Running", "Cycling", "Yoga", "Photography", "Dance", "Tennis", "Climbing",
    "Swimming", "Kayaking", "Camping", "Cooking", "Painting", "Writing", "Board Games", "Chess",
    "Meditation", "Salsa", "Golf", "Skiing",
)
_ACTIVITY_FORMS = ("Beginner {}", "Weekend {}", "Women's {}", "Family {}", "{} for Singles")
_LANGUAGES = (
    "Spanish", "French", "German", "Italian", "Japanese", "Mandarin", "Portuguese", "Russian",
    "Arabic", "Korean", "Dutch", "Swedish", "Hindi", "Polish", "Turkish", "Greek", "Hebrew",
)
_LANGUAGE_FORMS = ("{} Language", "{} Conversation", "{} Culture", "Learning {}")
_AUDIENCES = (
    "Women", "Moms", "Dads", "Seniors", "Students", "Young Professionals", "Expats",
    "Retirees", "Couples", "Veterans", "Singles 30s", "Singles 40s",
)
_AUDIENCE_FORMS = ("{} Social", "{} Networking", "{} Fitness", "{} Book Club")

# (name, country code as the Meetup API wrote it, lat, lon), biggest Meetup cities first.
CITIES: tuple[tuple[str, str, float, float], ...] = (
    ("New York", "us", 40.75, -73.99), ("London", "gb", 51.51, -0.13),
    ("San Francisco", "us", 37.77, -122.42), ("Los Angeles", "us", 34.05, -118.24),
    ("Chicago", "us", 41.88, -87.63), ("Toronto", "ca", 43.65, -79.38),
    ("Berlin", "de", 52.52, 13.4), ("Paris", "fr", 48.86, 2.35),
    ("Amsterdam", "nl", 52.37, 4.89), ("Sydney", "au", -33.87, 151.21),
    ("Seattle", "us", 47.61, -122.33), ("Boston", "us", 42.36, -71.06),
    ("Austin", "us", 30.27, -97.74), ("Washington", "us", 38.91, -77.04),
    ("Melbourne", "au", -37.81, 144.96), ("Atlanta", "us", 33.75, -84.39),
    ("Denver", "us", 39.74, -104.99), ("Dallas", "us", 32.78, -96.8),
    ("Houston", "us", 29.76, -95.37), ("Philadelphia", "us", 39.95, -75.17),
    ("San Diego", "us", 32.72, -117.16), ("Miami", "us", 25.76, -80.19),
    ("Portland", "us", 45.52, -122.68), ("Phoenix", "us", 33.45, -112.07),
    ("Minneapolis", "us", 44.98, -93.27), ("Vancouver", "ca", 49.28, -123.12),
    ("Montréal", "ca", 45.5, -73.57), ("Madrid", "es", 40.42, -3.7),
    ("Barcelona", "es", 41.39, 2.17), ("München", "de", 48.14, 11.58),
    ("Hamburg", "de", 53.55, 9.99), ("Frankfurt", "de", 50.11, 8.68),
    ("Dublin", "ie", 53.35, -6.26), ("Edinburgh", "gb", 55.95, -3.19),
    ("Manchester", "gb", 53.48, -2.24), ("Stockholm", "se", 59.33, 18.07),
    ("Copenhagen", "dk", 55.68, 12.57), ("Oslo", "no", 59.91, 10.75),
    ("Helsinki", "fi", 60.17, 24.94), ("Zürich", "ch", 47.38, 8.54),
    ("Vienna", "at", 48.21, 16.37), ("Prague", "cz", 50.08, 14.44),
    ("Warsaw", "pl", 52.23, 21.01), ("Rome", "it", 41.9, 12.5),
    ("Milan", "it", 45.46, 9.19), ("Lisbon", "pt", 38.72, -9.14),
    ("Brussels", "be", 50.85, 4.35), ("Tel Aviv", "il", 32.09, 34.78),
    ("Bangalore", "in", 12.97, 77.59), ("Mumbai", "in", 19.08, 72.88),
    ("Singapore", "sg", 1.35, 103.82), ("Tokyo", "jp", 35.68, 139.69),
    ("Hong Kong", "hk", 22.32, 114.17), ("Seoul", "kr", 37.57, 126.98),
    ("Auckland", "nz", -36.85, 174.76), ("São Paulo", "br", -23.55, -46.63),
    ("Mexico City", "mx", 19.43, -99.13), ("Buenos Aires", "ar", -34.6, -58.38),
    ("Cape Town", "za", -33.92, 18.42), ("Johannesburg", "za", -26.2, 28.05),
    ("Dubai", "ae", 25.2, 55.27), ("Istanbul", "tr", 41.01, 28.98),
    ("Nairobi", "ke", -1.29, 36.82), ("Bangkok", "th", 13.76, 100.5),
)

FIRST_NAMES: tuple[str, ...] = (
    "Stefan", "Anna", "James", "Maria", "John", "Sarah", "Michael", "Laura", "David", "Emma",
    "Daniel", "Sophie", "Chris", "Julia", "Alex", "Lisa", "Mark", "Elena", "Paul", "Nina",
    "Peter", "Olivia", "Tom", "Hannah", "Robert", "Jessica", "Kevin", "Emily", "Brian", "Rachel",
    "Jason", "Megan", "Matt", "Amanda", "Ryan", "Jennifer", "Andrew", "Nicole", "Eric", "Karen",
    "Mohammed", "Fatima", "Ahmed", "Aisha", "Wei", "Mei", "Hiroshi", "Yuki", "Raj", "Priya",
    "Arjun", "Ananya", "Carlos", "Lucia", "Diego", "Sofia", "Pedro", "Ana", "Luca", "Giulia",
    "Pierre", "Camille", "Lars", "Ingrid", "Jan", "Eva", "Piotr", "Kasia", "Ivan", "Olga",
    "Kwame", "Amara", "Tariq", "Leila", "Sven", "Freya", "Mateo", "Valentina", "Noah", "Mia",
    "Liam", "Ava", "Ethan", "Chloe", "Lucas", "Zoe", "Omar", "Yasmin", "Sam", "Jo", "Kim",
    "Pat", "Dana", "Robin", "Taylor", "Jordan", "Morgan", "Casey", "Jamie", "Riley",
)
LAST_NAMES: tuple[str, ...] = (
    "Smith", "Johnson", "Williams", "Brown", "Jones", "Garcia", "Miller", "Davis", "Martinez",
    "Lopez", "Wilson", "Anderson", "Taylor", "Thomas", "Moore", "Martin", "Lee", "Walker",
    "Hall", "Young", "King", "Wright", "Scott", "Green", "Baker", "Adams", "Nelson", "Hill",
    "Müller", "Schmidt", "Schneider", "Fischer", "de Vries", "Jansen", "van Dijk", "Bakker",
    "Dubois", "Moreau", "Laurent", "Rossi", "Russo", "Ferrari", "Fernández", "González",
    "Rodríguez", "Silva", "Santos", "Kowalski", "Nowak", "Ivanov", "Petrov", "Andersson",
    "Nielsen", "Hansen", "Virtanen", "Tanaka", "Suzuki", "Sato", "Kim", "Park", "Chen", "Wang",
    "Li", "Zhang", "Singh", "Patel", "Sharma", "Kumar", "Khan", "Ali", "Hassan", "Cohen",
    "Levi", "Okafor", "Mensah", "Murphy", "O'Brien", "Kelly",
)
_VENUE_PLACES = (
    "Public Library", "Community Center", "Coffee House", "Brewing Co.", "Tavern", "Pub",
    "Park", "Co-working Space", "Studio", "Bistro", "Wine Bar", "Climbing Gym", "Yoga Studio",
    "Innovation Hub", "Books", "Kitchen", "Taproom", "Conference Center", "Gallery", "Café",
)
_VENUE_PREFIXES = (
    "Central", "Riverside", "Old Town", "Harbor", "Union", "Market Street", "Main Street",
    "The Red Lion", "Green Street", "Parkside", "Northside", "Downtown", "Westside", "Eastside",
    "Lakeside", "Hilltop", "Station", "Bridge", "Garden", "Corner",
)
_GROUP_NAME_FORMS = (
    "{city} {topic} Meetup", "{city} {topic} Group", "{topic} in {city}",
    "{city} {topic} Enthusiasts", "The {city} {topic} Club", "{city} {topic} & {topic2}",
    "{topic} Lovers of {city}", "{city} {topic} Society", "{city} {topic} Community",
    "{abbr} {topic} Collective",
)
_EVENT_NAME_FORMS = (
    "{topic} Meetup", "Monthly {topic} Night", "{weekday} {topic}", "Intro to {topic}",
    "{topic} Workshop", "{topic} Social", "{topic} Happy Hour", "{topic} & Drinks",
    "{abbr} Explores: {topic}", "{topic} Q&A", "{topic} Hangout", "{weekday} {topic} Session",
)
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# fmt: on

_TOPIC_ZIPF_S = 1.0  # topic draws for group topic lists
_GROUP_ZIPF_S = 1.0  # which group an RSVP is for
_CITY_ZIPF_S = 0.9  # which city a group is in
_MEMBER_ZIPF_S = 0.6  # which member answers (a mild skew: regulars and a long tail)
_MEAN_GAP_MS = 200.0  # about 5 RSVPs/s, the order of the real stream's rate


def slug(name: str) -> str:
    """Meetup-style urlkey: ASCII lower-case words joined by '-' ("Dining Out" -> "dining-out")."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    ascii_name = ascii_name.replace("'", "")
    ascii_name = ascii_name.replace("&", " and ").replace("#", "sharp").replace("+", "plus")
    return re.sub(r"[^a-z0-9]+", "-", ascii_name.lower()).strip("-")


def urlname(name: str) -> str:
    """Meetup-style group urlname: ASCII words joined by '-', case kept ("AMS-Connected")."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return "-".join(re.findall(r"[A-Za-z0-9]+", ascii_name))


def topic_vocabulary(n: int) -> list[tuple[str, str]]:
    """The first `n` topics as (urlkey, topic_name), most popular first; independent of seed.

    Names and urlkeys are unique. Past the real-looking names (about 560), numbered
    "Special Interest N" topics fill the rest so any `n` works.
    """
    if n < 1:
        raise ValueError(f"topics must be >= 1, got {n}")
    families = [
        [form.format(word) for word in words for form in forms]
        for words, forms in (
            (_TECH, _TECH_FORMS),
            (_ACTIVITIES, _ACTIVITY_FORMS),
            (_LANGUAGES, _LANGUAGE_FORMS),
            (_AUDIENCES, _AUDIENCE_FORMS),
        )
    ]
    tail = (name for group in itertools.zip_longest(*families) for name in group if name)
    numbered = (f"Special Interest {i}" for i in itertools.count(1))
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for name in itertools.chain(CORE_TOPICS, tail, numbered):
        key = slug(name)
        if key in seen or not key:
            continue
        seen.add(key)
        out.append((key, name))
        if len(out) == n:
            return out
    raise AssertionError("unreachable: the numbered topics are endless")


def zipf_cum_weights(n: int, s: float) -> list[float]:
    """Cumulative weights of ranks 1..n with weight 1/rank**s, for `Random.choices`."""
    return list(itertools.accumulate(1.0 / (rank**s) for rank in range(1, n + 1)))


@dataclass(frozen=True)
class _Venue:
    venue_id: int
    name: str
    lat: float
    lon: float


@dataclass
class _Event:
    event_id: str
    name: str
    time: int
    venue: _Venue


@dataclass
class _Group:
    group_id: int
    name: str
    urlname: str
    city: tuple[str, str, float, float]
    topics: list[tuple[str, str]]
    venues: list[_Venue]
    events: list[_Event] = field(default_factory=list)


class RsvpGenerator:
    """An endless, deterministic stream of realistic Meetup RSVP dicts.

    The world (topics, groups, cities, venues) is built once from the seed; each `next()`
    then draws one RSVP from `random.Random(seed)`. The same arguments give the same
    sequence; nothing is shared between generators, so independent instances may run side
    by side. Returned dicts are fresh objects: mutating one does not affect later RSVPs.
    """

    def __init__(
        self,
        seed: int,
        *,
        topics: int = 400,
        groups: int = 2000,
        members: int = 50000,
        start_ms: int | None = None,
        gap_ms: float = _MEAN_GAP_MS,
    ) -> None:
        """`gap_ms`: about the mean event-time gap between RSVPs (1 ms more); a load sent
        at r per second with `gap_ms` = 1000 / r keeps event time near the clock's pace, so
        an event a fault holds back d seconds arrives about d seconds late, not the
        d * r * 200 ms of event time the default gap would make of it."""
        if groups < 1 or members < 1:
            raise ValueError(f"groups and members must be >= 1, got {groups}, {members}")
        self.seed = seed
        self.topics: list[tuple[str, str]] = topic_vocabulary(topics)
        world = random.Random(f"tierflow-meetup-world:{seed}")
        self._topic_cw = zipf_cum_weights(len(self.topics), _TOPIC_ZIPF_S)
        self._groups = self._build_groups(world, groups)
        self._group_cw = zipf_cum_weights(groups, _GROUP_ZIPF_S)
        self._members = members
        self._member_cw = zipf_cum_weights(members, _MEMBER_ZIPF_S)
        self._member_cache: dict[int, tuple[int, str, str]] = {}
        self._rng = random.Random(seed)
        self._mtime = DEFAULT_START_MS if start_ms is None else start_ms
        self._gap_ms = gap_ms
        self._rsvp_id = world.randrange(1_500_000_000, 1_700_000_000)
        self._event_id = world.randrange(220_000_000, 240_000_000)
        self.produced = 0

    # ------------------------------------------------------------------ the world

    def _draw_topics(self, rng: random.Random, k: int) -> list[tuple[str, str]]:
        """k distinct topics, drawn Zipf-wise; bounded, falls back to rank order."""
        picked: dict[int, None] = {}
        ranks = range(len(self.topics))
        for _ in range(50 * k):
            if len(picked) == k:
                break
            picked.setdefault(rng.choices(ranks, cum_weights=self._topic_cw)[0], None)
        for rank in ranks:  # only reached when the vocabulary is tiny
            if len(picked) == k:
                break
            picked.setdefault(rank, None)
        return [self.topics[rank] for rank in picked]

    def _build_groups(self, rng: random.Random, n: int) -> list[_Group]:
        city_cw = zipf_cum_weights(len(CITIES), _CITY_ZIPF_S)
        group_ids = rng.sample(range(1_000_000, 30_000_000), n)
        venue_ids = iter(rng.sample(range(1_000_000, 26_000_000), 4 * n))
        urlnames: set[str] = set()
        groups = []
        for gid in group_ids:
            city = rng.choices(CITIES, cum_weights=city_cw)[0]
            topics = self._draw_topics(rng, min(len(self.topics), rng.randint(1, 15)))
            main, other = topics[0][1], rng.choice(topics)[1]
            name = rng.choice(_GROUP_NAME_FORMS).format(
                city=city[0], topic=main, topic2=other, abbr=urlname(city[0])[:3].upper()
            )
            base = url = urlname(name)
            for i in itertools.count(2):
                if url not in urlnames:
                    break
                url = f"{base}-{i}"
            urlnames.add(url)
            venues = [self._venue(rng, next(venue_ids), city) for _ in range(rng.randint(1, 4))]
            groups.append(_Group(gid, name, url, city, topics, venues))
        return groups

    @staticmethod
    def _venue(rng: random.Random, venue_id: int, city: tuple[str, str, float, float]) -> _Venue:
        if rng.random() < 0.1:
            name = "Location TBA"
        elif rng.random() < 0.3:
            name = f"{rng.choice(LAST_NAMES)}'s {rng.choice(_VENUE_PLACES)}"
        else:
            name = f"{rng.choice(_VENUE_PREFIXES)} {rng.choice(_VENUE_PLACES)}"
        lat = round(city[2] + rng.uniform(-0.08, 0.08), 6)
        lon = round(city[3] + rng.uniform(-0.12, 0.12), 6)
        return _Venue(venue_id, name, float(lat), float(lon))

    def _member(self, index: int) -> tuple[int, str, str]:
        """(member_id, member_name, photo) of member `index`, the same whenever asked."""
        found = self._member_cache.get(index)
        if found is None:
            r = random.Random(f"tierflow-meetup-member:{self.seed}:{index}")
            member_id = 10_000_000 + index * 5000 + r.randrange(5000)
            first = r.choice(FIRST_NAMES)
            style = r.random()
            if style < 0.4:
                name = first
            elif style < 0.6:
                name = f"{first} {r.choice(LAST_NAMES)[0]}."
            else:
                name = f"{first} {r.choice(LAST_NAMES)}"
            path = "/".join(r.choice("0123456789abcdef") for _ in range(4))
            photo = (
                f"http://photos{r.randint(1, 4)}.meetupstatic.com/photos/member/{path}"
                f"/thumb_{r.randrange(10_000_000, 300_000_000)}.jpeg"
            )
            found = (member_id, name, photo)
            self._member_cache[index] = found
        return found

    def _event(self, group: _Group) -> _Event:
        """An upcoming event of the group: mostly one already announced, sometimes a new one."""
        rng = self._rng
        group.events = [e for e in group.events if e.time > self._mtime]
        if not group.events or rng.random() < 0.12:
            self._event_id += rng.randint(1, 300)
            when = self._mtime + rng.randint(2 * 3600_000, 21 * 86400_000)
            when -= when % (15 * 60_000)
            topic = rng.choice(group.topics)[1]
            name = rng.choice(_EVENT_NAME_FORMS).format(
                topic=topic, weekday=rng.choice(_WEEKDAYS), abbr=group.urlname[:3].upper()
            )
            group.events.append(_Event(str(self._event_id), name, when, rng.choice(group.venues)))
            del group.events[:-3]
        return rng.choice(group.events)

    # ------------------------------------------------------------------ the stream

    def next(self) -> dict[str, Any]:
        """The next RSVP, with the sample's keys, key order, nesting and value types."""
        rng = self._rng
        self._mtime += 1 + int(rng.expovariate(1.0 / self._gap_ms))
        self._rsvp_id += rng.randint(1, 40)
        group = rng.choices(self._groups, cum_weights=self._group_cw)[0]
        event = self._event(group)
        member_id, member_name, photo = self._member(
            rng.choices(range(self._members), cum_weights=self._member_cw)[0]
        )
        response = "yes" if rng.random() < 0.9 else "no"
        guests = rng.choice((1, 1, 1, 2, 3)) if response == "yes" and rng.random() < 0.08 else 0
        city = group.city
        self.produced += 1
        return {
            "venue": {
                "venue_name": event.venue.name,
                "lon": event.venue.lon,
                "lat": event.venue.lat,
                "venue_id": event.venue.venue_id,
            },
            "visibility": "public" if rng.random() < 0.95 else "members",
            "response": response,
            "guests": guests,
            "member": {"member_id": member_id, "photo": photo, "member_name": member_name},
            "rsvp_id": self._rsvp_id,
            "mtime": self._mtime,
            "event": {
                "event_name": event.name,
                "event_id": event.event_id,
                "time": event.time,
                "event_url": f"http://www.meetup.com/{group.urlname}/events/{event.event_id}/",
            },
            "group": {
                "group_topics": [{"urlkey": k, "topic_name": n} for k, n in group.topics],
                "group_city": city[0],
                "group_country": city[1],
                "group_id": group.group_id,
                "group_name": group.name,
                "group_lon": city[3],
                "group_urlname": group.urlname,
                "group_lat": city[2],
            },
        }

    def take(self, n: int) -> list[dict[str, Any]]:
        """The next `n` RSVPs."""
        return [self.next() for _ in range(n)]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        return self.next()

    def to_ndjson(self, path: str | Path, n: int) -> Path:
        """Write the next `n` RSVPs to `path`, one JSON object a line; returns the path."""
        path = Path(path)
        encoder = msgspec.json.Encoder()
        with path.open("wb") as out:
            for _ in range(n):
                out.write(encoder.encode(self.next()) + b"\n")
        return path
