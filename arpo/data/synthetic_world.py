"""The fictional world behind the synthetic benchmark: entities, their near-namesake distractors, documents.

Why fictional: a tiny model knows nothing, and a real model must not know the answers either, so every
correct answer has to come through the tools. The world is a seeded knowledge base of countries, cities,
people and companies with linked attributes; each entity becomes one document of the search corpus.

Distractors (:func:`add_distractors`) are twins with near-identical names and their own attributes
("Trivex" / "Trivex Labs", "Kora" / "New Kora", "Mira Dolan" / "Tora Dolan"). A twin shares a name token
with its original, so BM25 ranks the two documents side by side and a model has to read which one it got.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

_ONSETS = ["b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "t", "tr", "v", "z", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "io", "ou"]
_CODAS = ["", "", "n", "l", "r", "s", "x", "th", "m", "nd"]
_OCCUPATIONS = ["painter", "engineer", "botanist", "composer", "physician", "architect", "poet", "chemist"]
_CURRENCIES = ["drelk", "mora", "quint", "sable", "tallow", "vesk"]
# Affixes for twin names: real words that no document otherwise contains (and no BM25 stopword), so the only
# thing that separates a twin's page from its original's in a query is the affix itself.
_COMPANY_SUFFIXES = ["Labs", "Group", "Works"]
_CITY_PREFIXES = ["New", "Port", "Old"]
_COUNTRY_PREFIXES = ["North", "South", "Upper"]


@dataclass
class World:
    """The fictional knowledge base: entity name -> attribute dict, per entity type."""

    countries: dict[str, dict[str, Any]]
    cities: dict[str, dict[str, Any]]
    people: dict[str, dict[str, Any]]
    companies: dict[str, dict[str, Any]]
    #: original entity name -> its near-namesake distractor (same entity type, own attributes)
    twins: dict[str, str] = field(default_factory=dict)
    #: towns sharing a name, one page per group (:mod:`arpo.data.synthetic_namesakes`; the ``pick`` kind)
    namesakes: list[Any] = field(default_factory=list)

    def counterpart(self, name: str) -> str | None:
        """The other member of ``name``'s twin pair, or None when it has none."""
        if name in self.twins:
            return self.twins[name]
        return next((orig for orig, twin in self.twins.items() if twin == name), None)


def _name(rng: random.Random, used: set[str], syllables: tuple[int, int] = (2, 3)) -> str:
    while True:
        n = rng.randint(*syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))
        word = word.capitalize()
        if word not in used and 4 <= len(word) <= 12:
            used.add(word)
            return word


def build_world(seed: int, num_countries: int, cities_per_country: int, num_people: int,
                num_companies: int) -> World:
    rng = random.Random(seed)
    used: set[str] = set()
    countries: dict[str, dict[str, Any]] = {}
    cities: dict[str, dict[str, Any]] = {}
    for _ in range(num_countries):
        c = _name(rng, used)
        city_names = [_name(rng, used) for _ in range(cities_per_country)]
        for city in city_names:
            cities[city] = {"country": c, "population": rng.randint(20, 900) * 1000}
        countries[c] = {
            "capital": city_names[0],
            "founded": rng.randint(1100, 1950),
            "population": rng.randint(5, 900) * 10000,
            "currency": rng.choice(_CURRENCIES),
        }
    city_list = sorted(cities)
    people: dict[str, dict[str, Any]] = {}
    for _ in range(num_people):
        p = f"{_name(rng, used, (1, 2))} {_name(rng, used)}"
        people[p] = {
            "born": rng.randint(1900, 2000),
            "birthplace": rng.choice(city_list),
            "occupation": rng.choice(_OCCUPATIONS),
        }
    person_list = sorted(people)
    companies: dict[str, dict[str, Any]] = {}
    for _ in range(num_companies):
        co = _name(rng, used)
        founder = rng.choice(person_list)
        companies[co] = {
            "founder": founder,
            "headquarters": rng.choice(city_list),
            "founded": people[founder]["born"] + rng.randint(20, 50),
            "employees": rng.randint(12, 9000),
        }
    for c, info in cities.items():
        info["mayor"] = rng.choice(person_list)
    return World(countries, cities, people, companies)


def add_distractors(world: World, seed: int, fraction: float) -> World:
    """Give ``fraction`` of each entity type a near-namesake twin with freshly drawn attributes (in place).

    A separate RNG stream: the original entities, and so every question about them, stay what
    :func:`build_world` made, and ``fraction=0`` leaves the world untouched."""
    if fraction <= 0:
        return world
    rng = random.Random(f"{seed}-distractors")
    used = {word for kind in (world.countries, world.cities, world.people, world.companies) for name in kind
            for word in name.split()}

    def pick(names: dict[str, Any]) -> list[str]:
        return rng.sample(sorted(names), round(fraction * len(names)))

    def twin_name(orig: str, affixes: list[str], prefix: bool) -> str:
        # unique: originals are unique single words, each gets one twin, and the affixes differ per type
        affix = rng.choice(affixes)
        return f"{affix} {orig}" if prefix else f"{orig} {affix}"

    # People twins share the surname: "Mira Dolan" / "Tora Dolan". References to cities are filled in below,
    # once the twin cities exist, so a twin can be born in a twin city.
    new_people = []
    for p in pick(world.people):
        twin = f"{_name(rng, used, (1, 2))} {p.split(' ', 1)[1]}"
        world.people[twin] = {"born": rng.randint(1900, 2000), "occupation": rng.choice(_OCCUPATIONS)}
        world.twins[p] = twin
        new_people.append(twin)
    new_cities = []
    for c in pick(world.countries):
        twin = twin_name(c, _COUNTRY_PREFIXES, prefix=True)
        capital = _name(rng, used)  # a twin country needs a capital of its own
        world.cities[capital] = {"country": twin, "population": rng.randint(20, 900) * 1000}
        world.countries[twin] = {"capital": capital, "founded": rng.randint(1100, 1950),
                                 "population": rng.randint(5, 900) * 10000, "currency": rng.choice(_CURRENCIES)}
        world.twins[c] = twin
        new_cities.append(capital)
    country_list = sorted(world.countries)
    for city in pick({k: v for k, v in world.cities.items() if k not in new_cities}):
        twin = twin_name(city, _CITY_PREFIXES, prefix=True)
        world.cities[twin] = {"country": rng.choice(country_list), "population": rng.randint(20, 900) * 1000}
        world.twins[city] = twin
        new_cities.append(twin)
    city_list, person_list = sorted(world.cities), sorted(world.people)
    for p in new_people:
        world.people[p]["birthplace"] = rng.choice(city_list)
    for city in new_cities:
        world.cities[city]["mayor"] = rng.choice(person_list)
    for co in pick(world.companies):
        twin = twin_name(co, _COMPANY_SUFFIXES, prefix=False)
        founder = rng.choice(person_list)
        world.companies[twin] = {"founder": founder, "headquarters": rng.choice(city_list),
                                 "founded": world.people[founder]["born"] + rng.randint(20, 50),
                                 "employees": rng.randint(12, 9000)}
        world.twins[co] = twin
    return world


# One document per entity: encyclopedic sentences, each naming its entity ({n}) and one attribute.
_DOC_TEMPLATES = {
    "countries": ("{n} is a country. The capital of {n} is {capital}. {n} was founded in {founded}. The population "
                  "of {n} is {population}. The currency of {n} is the {currency}."),
    "cities": "{n} is a city in {country}. The mayor of {n} is {mayor}. The population of {n} is {population}.",
    "people": "{n} is a {occupation}. {n} was born in {born}. {n} was born in the city of {birthplace}.",
    "companies": ("{n} is a company. {n} was founded by {founder}. {n} was founded in {founded}. The headquarters "
                  "of {n} is in {headquarters}. {n} has {employees} employees."),
}


def world_documents(world: World) -> list[dict[str, str]]:
    """One search document per entity, written as plain encyclopedic sentences."""
    docs = [{"title": name, "text": template.format(n=name, **attrs)}
            for table, template in _DOC_TEMPLATES.items() for name, attrs in sorted(getattr(world, table).items())]
    docs += [group.document() for group in world.namesakes]  # last: the other pages keep their ids
    for i, d in enumerate(docs):
        d["id"] = f"doc{i}"
        d["url"] = f"synthetic://{d['title'].replace(' ', '_')}"
    return docs


def sentences(text: str) -> list[str]:
    """The sentences of a document or of a plan step's finding (names and numbers hold no period)."""
    return [s.strip() for s in re.findall(r"[^.]*\.", text)]


def fact_index(docs: list[dict[str, str]]) -> dict[str, tuple[str, int]]:
    """Every document sentence -> (the page the search tool shows for it, where the sentence ends in that page).

    The page is ``"title: text"``, the search tool's layout with titles on (its default); the end offset says
    whether a page cut at the tool's ``result_length`` still holds the sentence. Every sentence names its
    entity, so each is unique in the corpus."""
    index: dict[str, tuple[str, int]] = {}
    for d in docs:
        page = f"{d['title']}: {d['text']}"
        end = len(d["title"]) + 2
        for sent in sentences(d["text"]):
            end = page.index(sent, end) + len(sent)
            index[sent] = (page, end)
    return index
