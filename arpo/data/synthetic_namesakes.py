"""Namesake towns: the synthetic benchmark's ``pick`` kind, a task where ARPO's premise holds by construction.

ARPO forks where the model is uncertain right after a tool result. Here the uncertainty is built in and graded:
several towns share a name, one in each of ``K`` countries (``synthetic.candidates``), and one search page lists
them all ("Kora in Zorvia: 340000 people. Kora in Brel: 120000 people. ..."), in a random order. The question
names the town and its country and asks for its population combined with a number, so the agent must search,
pick the entry whose country fits the question, and compute with it in Python:

    Q: What is the population of the town of Kora in Zorvia multiplied by 7?
    <search> Kora </search>           -> the K entries
    <python> print(340000 * 7) </python>   <- the decision: which of the K numbers
    -> 2380000                        -> the answer is copied

Nothing in the prompt tells which number is right (the populations are drawn afresh and appear nowhere else),
the answer stands in no page (it is computed) and a town's name alone does not find it, so the tool is needed;
with ``K = 1`` there is nothing to pick. The decisive tokens are the first ones after the search result; after
the Python result the model only copies. Every entry names its town and country, so each page sentence is
unique in the corpus (:func:`arpo.data.synthetic_world.fact_index`).

The gold plan's Python step keeps the wrong picks (``alternatives``: code, answer and page entry of every other
town), so the cold-start SFT can show some demonstrations picking the wrong entry (``sft.demo.wrong_pick_prob``):
the SFT model then hesitates between the entries, as a cold-started model does where the choice is hard. With
``sft.demo.verbose_think`` the thought after the search result restates the picked entry ("Kora in Zorvia:
340000 people."), so the pick is made at the country, a few tokens after the result, and the number is then
copied from the page.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from arpo.data.synthetic_world import World, _name

#: Python steps of a pick question: (question tail, expression of the picked population {v} and a drawn {k},
#: the range {k} is drawn from)
_OPERATIONS = [
    ("multiplied by {k}", "{v} * {k}", (3, 19)),
    ("divided by {k}, rounded down", "{v} // {k}", (3, 19)),
    ("plus {k}", "{v} + {k}", (1234, 9876)),
    ("minus {k}", "{v} - {k}", (1234, 9876)),
]
_QUESTION = "What is the population of the town of {town} in {country} {operation}?"


@dataclass(frozen=True)
class NamesakeGroup:
    """Towns sharing one name: (country, population) per town, in the order their page lists them."""

    name: str
    towns: tuple[tuple[str, int], ...]

    def entry(self, country: str, population: int) -> str:
        return f"{self.name} in {country}: {population} people."

    def document(self) -> dict[str, str]:
        """The search page of the group: one sentence per town."""
        return {"title": self.name, "text": " ".join(self.entry(c, p) for c, p in self.towns)}


def check_candidates(candidates: int | Sequence[int]) -> list[int]:
    """``synthetic.candidates`` as a list of levels (an int is one level); raises ValueError naming the fix."""
    levels = [candidates] if isinstance(candidates, int) and not isinstance(candidates, bool) else candidates
    try:
        levels = list(levels)
    except TypeError:
        levels = [candidates]
    if not levels or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in levels):
        raise ValueError(f"synthetic.candidates={candidates!r}: give an integer >= 1 (towns sharing a name in "
                         f"each pick question) or a list of them (each namesake group draws one)")
    return levels


def build_namesakes(world: World, seed: int, num_groups: int, candidates: int | Sequence[int]) -> list[NamesakeGroup]:
    """``num_groups`` namesake groups over ``world``'s countries (distractor twins excluded, so entries stay short);
    each group's size is drawn from ``candidates``. A separate RNG stream and fresh names: the rest of the world,
    and every other kind's questions, stay what they were."""
    levels = check_candidates(candidates)
    countries = sorted(c for c in world.countries if c not in world.twins.values())
    if max(levels) > len(countries):
        raise ValueError(f"synthetic.candidates={candidates!r}: at most {len(countries)} towns can share a name "
                         f"(one per country); lower it or raise synthetic.world.num_countries")
    rng = random.Random(f"{seed}-namesakes")
    used = {word for table in (world.countries, world.cities, world.people, world.companies) for name in table
            for word in name.split()}
    groups = []
    for _ in range(num_groups):
        name = _name(rng, used)
        k = rng.choice(levels)
        towns = tuple((c, rng.randint(100, 999) * 1000 + rng.randint(0, 999)) for c in rng.sample(countries, k))
        groups.append(NamesakeGroup(name, towns))
    return groups


def pick_question(groups: Sequence[NamesakeGroup], rng: random.Random) -> tuple[str, str, list[dict]]:
    """(question, answer, gold plan) of one ``pick`` question. The Python step's ``alternatives`` hold the code,
    its result, the answer and the page entry of picking each other town of the group."""
    group = groups[rng.randrange(len(groups))]
    target = rng.randrange(len(group.towns))
    country, population = group.towns[target]
    tail, expr, (lo, hi) = _OPERATIONS[rng.randrange(len(_OPERATIONS))]
    k = rng.randint(lo, hi)

    def python_step(value: int) -> dict:
        e = expr.format(v=value, k=k)
        answer = str(eval(e))  # noqa: S307 - built here from integers only
        return {"tool": "python", "content": f"print({e})", "finding": f"{e} = {answer}.", "answer": answer}

    gold = python_step(population)
    alternatives = [{**python_step(p), "entry": group.entry(c, p)} for i, (c, p) in enumerate(group.towns)
                     if i != target]
    search = {"tool": "search", "content": group.name, "finding": group.entry(country, population)}
    step = {"tool": "python", "content": gold["content"], "finding": gold["finding"],
            "alternatives": [{k: a[k] for k in ("content", "finding", "answer", "entry")} for a in alternatives]}
    question = _QUESTION.format(town=group.name, country=country, operation=tail.format(k=k))
    return question, gold["answer"], [search, step]
