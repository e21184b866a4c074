"""Question builders of the synthetic benchmark: (question, answer, gold tool plan) over a :class:`World`.

A plan step is ``{"tool": "search" | "python", "content": query or code, "finding": what the result says}``;
a search finding is the document's own sentence, so the cold-start SFT (:mod:`arpo.sft`) can run the plan with
the real tools and the result holds the finding. Every lookup goes through one table of facts
(:data:`_FACTS`), so each fact is asked and found with the same query and sentence in every kind.
"""

from __future__ import annotations

import random
from typing import Any

from arpo.data.synthetic_namesakes import pick_question
from arpo.data.synthetic_world import World

#: Kinds a small model can learn quickly: one or two lookups, arithmetic, one lookup fed into arithmetic.
EASY_KINDS = ("search", "python", "both")
#: Kinds that need several tool calls whose results depend on each other (headroom for RL on a real model).
HARD_KINDS = ("chain", "compare", "chain_math")
#: Kinds whose decisive step comes right after a tool result (ARPO's premise by construction): ``pick`` chooses
#: one of ``synthetic.candidates`` namesake towns from a search page (:mod:`arpo.data.synthetic_namesakes`)
PREMISE_KINDS = ("pick",)
KINDS = EASY_KINDS + HARD_KINDS + PREMISE_KINDS

# fact -> (entity table, attribute, search query, finding: the document sentence that states it)
_FACTS: dict[str, tuple[str, str, str, str]] = {
    "capital": ("countries", "capital", "capital of {e}", "The capital of {e} is {v}."),
    "currency": ("countries", "currency", "currency of {e}", "The currency of {e} is the {v}."),
    "country_founded": ("countries", "founded", "{e} founded", "{e} was founded in {v}."),
    "country_population": ("countries", "population", "population of {e}", "The population of {e} is {v}."),
    "country": ("cities", "country", "{e} country", "{e} is a city in {v}."),
    "mayor": ("cities", "mayor", "mayor of {e}", "The mayor of {e} is {v}."),
    "city_population": ("cities", "population", "population of {e}", "The population of {e} is {v}."),
    "birth_city": ("people", "birthplace", "{e} birthplace", "{e} was born in the city of {v}."),
    "birthplace": ("people", "birthplace", "{e} born", "{e} was born in the city of {v}."),
    "born": ("people", "born", "{e} born", "{e} was born in {v}."),
    "occupation": ("people", "occupation", "{e} occupation", "{e} is a {v}."),
    "founder": ("companies", "founder", "founder of {e}", "{e} was founded by {v}."),
    "company_founded": ("companies", "founded", "{e} founded", "{e} was founded in {v}."),
    "headquarters": ("companies", "headquarters", "headquarters of {e}", "The headquarters of {e} is in {v}."),
    "employees": ("companies", "employees", "{e} employees", "{e} has {v} employees."),
}

# Lookup questions: (question about entity {e}, the facts followed from {e}; the last one is the answer).
_ONE_HOP = [
    ("What is the capital of {e}?", ("capital",)),
    ("In which city was {e} born?", ("birth_city",)),
    ("Who founded {e}?", ("founder",)),
    ("In which country is the city of {e}?", ("country",)),
    ("What is the currency of {e}?", ("currency",)),
]
_TWO_HOP = [
    ("In which city was the founder of {e} born?", ("founder", "birthplace")),
    ("What is the occupation of the mayor of {e}?", ("mayor", "occupation")),
    ("In which country is the headquarters of {e}?", ("headquarters", "country")),
]
_CHAINS = [
    ("What is the currency of the country where {e} was born?", ("birthplace", "country", "currency")),
    ("In which country was the founder of {e} born?", ("founder", "birthplace", "country")),
    ("What is the occupation of the mayor of the capital of {e}?", ("capital", "mayor", "occupation")),
    ("Who is the mayor of the city where the founder of {e} was born?", ("founder", "birthplace", "mayor")),
    ("What is the capital of the country where {e} has its headquarters?", ("headquarters", "country", "capital")),
    ("In which city was the mayor of the city where {e} has its headquarters born?",
     ("headquarters", "mayor", "birthplace")),
]
# Lookups fed into Python: (question about {e} and a drawn integer {k}, facts, expression of the found value
# {v} and {k}, the range {k} is drawn from).
_BOTH = [
    ("How many years passed between the founding of {e} and the year {k}?", ("company_founded",), "{k} - {v}",
     (2020, 2030)),
    ("What is the population of {e} multiplied by {k}?", ("country_population",), "{v} * {k}", (3, 17)),
    ("What is the remainder when the birth year of {e} is divided by {k}?", ("born",), "{v} % {k}", (3, 19)),
]
_CHAIN_MATH = [
    ("What is the birth year of the founder of {e} multiplied by {k}?", ("founder", "born"), "{v} * {k}", (3, 19)),
    ("What is the population of the headquarters city of {e} multiplied by {k}?",
     ("headquarters", "city_population"), "{v} * {k}", (3, 17)),
    ("What is the remainder when the population of the country where the city of {e} lies is divided by {k}?",
     ("country", "country_population"), "{v} % {k}", (7, 97)),
    ("How many years passed between the birth of the mayor of {e} and the year {k}?", ("mayor", "born"),
     "{k} - {v}", (2020, 2030)),
]
# Two entities' values of one fact combined in Python: (question about {a} and {b}, fact, operator). With "-"
# {a} is the entity with the larger value, so every difference is positive and the question reads true.
_COMPARES = [
    ("How many more employees does {a} have than {b}?", "employees", "-"),
    ("How many years after the founding of {b} was {a} founded?", "company_founded", "-"),
    ("How many years older is {b} than {a}?", "born", "-"),
    ("How many more people live in {a} than in {b}?", "country_population", "-"),
    ("How many years after the founding of {b} was {a} founded?", "country_founded", "-"),
    ("What is the combined population of the cities {a} and {b}?", "city_population", "+"),
    ("What is the combined number of employees of {a} and {b}?", "employees", "+"),
]
#: Chance that a compare question pairs an entity with its near-namesake twin, when it has one.
_TWIN_PAIR_PROB = 0.5


def lookup(world: World, fact: str, entity: str) -> tuple[Any, dict[str, str]]:
    """(value, plan step) of one fact about ``entity``: the search that finds it and the sentence it finds."""
    table, attr, query, finding = _FACTS[fact]
    value = getattr(world, table)[entity][attr]
    return value, {"tool": "search", "content": query.format(e=entity), "finding": finding.format(e=entity, v=value)}


def _follow(world: World, entity: str, facts: tuple[str, ...]) -> tuple[Any, list[dict[str, str]]]:
    """Follow a chain of facts from ``entity`` (each value is the next fact's entity); (last value, plan)."""
    value: Any = entity
    plan = []
    for fact in facts:
        value, step = lookup(world, fact, value)
        plan.append(step)
    return value, plan


def _compute(expr: str) -> tuple[str, dict[str, str]]:
    """(answer, python plan step) for an integer expression."""
    answer = str(eval(expr))  # noqa: S307 - expr is built by this module from integers only
    return answer, {"tool": "python", "content": f"print({expr})", "finding": f"{expr} = {answer}."}


def _start(world: World, rng: random.Random, facts: tuple[str, ...]) -> str:
    """A random entity of the type the first fact is about."""
    return rng.choice(sorted(getattr(world, _FACTS[facts[0]][0])))


def _lookup_question(world: World, rng: random.Random, templates: list) -> tuple[str, str, list[dict]]:
    question, facts = templates[rng.randrange(len(templates))]
    entity = _start(world, rng, facts)
    answer, plan = _follow(world, entity, facts)
    return question.format(e=entity), str(answer), plan


def _computed_question(world: World, rng: random.Random, templates: list) -> tuple[str, str, list[dict]]:
    question, facts, expr, (lo, hi) = templates[rng.randrange(len(templates))]
    entity = _start(world, rng, facts)
    value, plan = _follow(world, entity, facts)
    k = rng.randint(lo, hi)
    answer, step = _compute(expr.format(v=value, k=k))
    return question.format(e=entity, k=k), answer, plan + [step]


def _compare_question(world: World, rng: random.Random) -> tuple[str, str, list[dict]]:
    question, fact, op = _COMPARES[rng.randrange(len(_COMPARES))]
    names = sorted(getattr(world, _FACTS[fact][0]))
    while True:  # two different entities with different values: a zero difference reads false
        a = rng.choice(names)
        twin = world.counterpart(a)
        b = twin if twin is not None and rng.random() < _TWIN_PAIR_PROB else rng.choice(names)
        (va, step_a), (vb, step_b) = lookup(world, fact, a), lookup(world, fact, b)
        if a != b and va != vb:
            break
    if op == "-" and va < vb:
        (a, va, step_a), (b, vb, step_b) = (b, vb, step_b), (a, va, step_a)
    answer, step = _compute(f"{va} {op} {vb}")
    return question.format(a=a, b=b), answer, [step_a, step_b, step]


def _python_question(rng: random.Random) -> tuple[str, str, list[dict]]:
    choice = rng.randrange(4)
    if choice == 0:
        a, b = rng.randint(100, 9999), rng.randint(12, 999)
        q, expr = f"What is {a} * {b}?", f"{a} * {b}"
    elif choice == 1:
        a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.randint(3, 49)
        q, expr = f"Compute ({a} + {b}) * {c}.", f"({a} + {b}) * {c}"
    elif choice == 2:
        a, b = rng.randint(10000, 99999), rng.randint(7, 97)
        q, expr = f"What is the remainder when {a} is divided by {b}?", f"{a} % {b}"
    else:
        a, b = rng.randint(2, 9), rng.randint(5, 12)
        q, expr = f"What is {a} to the power of {b}?", f"{a} ** {b}"
    ans = str(eval(expr))  # noqa: S307 - expr is built above from integers only
    return q, ans, [{"tool": "python", "content": f"print({expr})", "finding": f"The result is {ans}."}]


def make_question(world: World, kind: str, rng: random.Random, two_hop_fraction: float) -> tuple[str, str, list[dict], int]:
    """(question, answer, gold plan, hops = plan steps) of one ``kind``; ``two_hop_fraction`` of ``search``
    questions chain two lookups."""
    if kind == "search":
        two_hop = rng.random() < two_hop_fraction
        q, a, plan = _lookup_question(world, rng, _TWO_HOP if two_hop else _ONE_HOP)
    elif kind == "python":
        q, a, plan = _python_question(rng)
    elif kind == "both":
        q, a, plan = _computed_question(world, rng, _BOTH)
    elif kind == "chain":
        q, a, plan = _lookup_question(world, rng, _CHAINS)
    elif kind == "compare":
        q, a, plan = _compare_question(world, rng)
    elif kind == "chain_math":
        q, a, plan = _computed_question(world, rng, _CHAIN_MATH)
    elif kind == "pick":
        if not world.namesakes:
            raise ValueError("the pick kind needs namesake towns: set synthetic.world.namesake_groups > 0")
        q, a, plan = pick_question(world.namesakes, rng)
    else:
        raise ValueError(f"unknown question kind {kind!r}; use one of {KINDS}")
    return q, a, plan, len(plan)
