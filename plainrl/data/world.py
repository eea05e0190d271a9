"""A procedural world of fictional people, companies, cities and countries, its text
corpus, and 1-hop / 2-hop questions about it: the ``search`` task (Search-R1 style).

Every name is made up from syllables, so no fact can be answered from a model's memory:
it must be looked up in the corpus (``plainrl.rollout.envs.search`` indexes it with BM25).
A world is a pure function of its seed and sizes; the task's rows name the world they ask
about (the ``world`` column), so the search tool rebuilds the same corpus from the row.
Training rows and held-out rows are drawn from different seeds
(:func:`plainrl.data.tasks.make_task_split`), so they ask about different worlds: no
held-out entity or fact occurs in training.

Facts (one short document each)::

    born:     "<person> was born in <city>."
    works:    "<person> works for <company>."
    based:    "<company> is based in <city>."
    founder:  "<company> was founded by <person>."
    country:  "<city> is a city in <country>."

Questions: 1-hop ask one fact ("Where was Lema Ruma born?" -> the city); 2-hop chain
two ("In which country was Lema Ruma born?" -> born, then country). The method follows
Search-R1 (Jin et al. 2025, arXiv:2503.09516) with a synthetic corpus in place of Wikipedia.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["QUESTION_KINDS", "World", "make_world", "search_task", "world_question"]

# plain consonant-vowel syllables: short names of few tokens, which a small model copies
# from a search result more reliably than long ones
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "s", "l", "m")


@dataclass(frozen=True)
class World:
    """One fictional world.

    Attributes:
        seed: the seed it was generated from.
        people, companies, cities, countries: entity names (a person is "First Last"; the
            others one word); all distinct, and no word of one name is another name.
        born, works: person -> city / company.
        based, founder: company -> city / person.
        country: city -> country.
        documents: the corpus, one fact per document (see the module docstring).
    """

    seed: int
    people: tuple[str, ...]
    companies: tuple[str, ...]
    cities: tuple[str, ...]
    countries: tuple[str, ...]
    born: dict[str, str]
    works: dict[str, str]
    based: dict[str, str]
    founder: dict[str, str]
    country: dict[str, str]
    documents: tuple[str, ...]


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


def _check_size(key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"data.task_args.{key}: expected an integer >= {low}, got {value!r}")
    return value


@functools.lru_cache(maxsize=16)
def make_world(seed: int, num_people: int = 200, num_companies: int = 40, num_cities: int = 30,
               num_countries: int = 8) -> World:
    """The world of ``seed`` (the same arguments always give the same world; cached per process,
    so callers must not change it).

    Args:
        seed: seed of the ``random.Random`` everything is drawn from.
        num_people, num_companies, num_cities, num_countries: entity counts (people >= 1,
            others >= 1). Every company has a founder among the people, every person a
            birthplace and an employer, every city a country.
    Returns:
        The :class:`World`; ``documents`` has ``2 * num_people + 2 * num_companies + num_cities``
        facts, in a seeded shuffled order.
    Raises:
        ValueError: a size that is not a positive integer (naming ``data.task_args.<key>``).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"make_world: seed must be an integer, got {seed!r}")
    for key, value in (("num_people", num_people), ("num_companies", num_companies), ("num_cities", num_cities),
                       ("num_countries", num_countries)):
        _check_size(key, value, 1)
    rng = random.Random(seed)
    used: set[str] = set()

    def fresh(syllables: int, suffix: str = "") -> str:
        for _ in range(10_000):
            w = _word(rng, syllables)
            w += ("n" if suffix and w[-1] in _VOWELS else "") + suffix  # "Besinia", not "Besiia"
            if w not in used:
                used.add(w)
                return w
        raise ValueError("make_world: ran out of distinct names; lower the entity counts")

    # a small pool of first names shared by many people makes BM25 rank by the surname
    first_names = [fresh(2) for _ in range(max(4, num_people // 10))]
    people = tuple(f"{rng.choice(first_names)} {fresh(2)}" for _ in range(num_people))
    countries = tuple(fresh(2, "ia") for _ in range(num_countries))
    cities = tuple(fresh(2) for _ in range(num_cities))
    companies = tuple(fresh(3) for _ in range(num_companies))  # longer: a company reads unlike a person or place
    born = {p: rng.choice(cities) for p in people}
    works = {p: rng.choice(companies) for p in people}
    based = {c: rng.choice(cities) for c in companies}
    founder = {c: rng.choice(people) for c in companies}
    country = {c: rng.choice(countries) for c in cities}
    docs = ([f"{p} was born in {c}." for p, c in born.items()]
            + [f"{p} works for {c}." for p, c in works.items()]
            + [f"{c} is based in {t}." for c, t in based.items()]
            + [f"{c} was founded by {p}." for c, p in founder.items()]
            + [f"{t} is a city in {n}." for t, n in country.items()])
    rng.shuffle(docs)
    return World(seed, people, companies, cities, countries, born, works, based, founder, country, tuple(docs))


# kind -> (hops, subject pool, question template, path of relations from the subject to the answer)
QUESTION_KINDS: dict[str, tuple[int, str, str, tuple[str, ...]]] = {
    "born": (1, "people", "Where was {} born?", ("born",)),
    "works": (1, "people", "Which company does {} work for?", ("works",)),
    "based": (1, "companies", "In which city is {} based?", ("based",)),
    "founder": (1, "companies", "Who founded {}?", ("founder",)),
    "country": (1, "cities", "In which country is {}?", ("country",)),
    "born_country": (2, "people", "In which country was {} born?", ("born", "country")),
    "works_city": (2, "people", "In which city is the company that {} works for based?", ("works", "based")),
    "works_founder": (2, "people", "Who founded the company that {} works for?", ("works", "founder")),
    "based_country": (2, "companies", "In which country is {} based?", ("based", "country")),
}


def world_question(world: World, kind: str, subject: str) -> tuple[str, str]:
    """The question of ``kind`` (a key of :data:`QUESTION_KINDS`) about ``subject`` and its answer.

    Raises:
        KeyError: an unknown kind, or a subject that is not in the kind's pool.
    """
    _, _, template, path = QUESTION_KINDS[kind]
    value = subject
    for relation in path:
        value = getattr(world, relation)[value]
    return template.format(subject), value


def search_task(
    n: int,
    *,
    seed: int,
    two_hop: float = 0.2,
    num_people: int = 200,
    num_companies: int = 40,
    num_cities: int = 30,
    num_countries: int = 8,
) -> list[dict]:
    """Questions about the fictional world of ``seed``, answered by searching its corpus.

    Each row picks 2 hops with probability ``two_hop`` (else 1), then a question kind of
    that many hops and a subject uniformly.

    Args:
        n: number of rows.
        seed: the world's seed and the question draw's (same arguments, same rows).
        two_hop: fraction of 2-hop questions, in [0, 1] (a curriculum: mostly 1-hop
            questions let a small model learn to search before it must chain searches).
        num_people, num_companies, num_cities, num_countries: the world's size (:func:`make_world`).
    Returns:
        ``n`` rows ``{"prompt": question, "answer": one name, "task": "search", "hops": 1 or 2,
        "kind": a key of QUESTION_KINDS, "world": {"seed", "num_people", ...}}``; ``world``
        is what :func:`make_world` takes to rebuild the corpus.
    Raises:
        ValueError: a bad argument, naming ``data.task_args.<key>``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"search: n (number of rows) must be an integer >= 0, got {n!r}")
    if isinstance(two_hop, bool) or not isinstance(two_hop, (int, float)) or not 0.0 <= two_hop <= 1.0:
        raise ValueError(f"data.task_args.two_hop: expected a fraction in [0, 1], got {two_hop!r}")
    spec = {"seed": seed, "num_people": num_people, "num_companies": num_companies, "num_cities": num_cities,
            "num_countries": num_countries}
    world = make_world(**spec)
    kinds = {h: [k for k, v in QUESTION_KINDS.items() if v[0] == h] for h in (1, 2)}
    # the question draw has its own stream, so a world's facts do not depend on n or two_hop
    rng = random.Random(f"search-questions-{seed}")
    rows = []
    for _ in range(n):
        hops = 2 if rng.random() < two_hop else 1
        kind = rng.choice(kinds[hops])
        subject = rng.choice(getattr(world, QUESTION_KINDS[kind][1]))
        question, answer = world_question(world, kind, subject)
        rows.append({"prompt": question, "answer": answer, "task": "search", "hops": hops, "kind": kind,
                     "world": dict(spec)})
    return rows
