"""Synthetic tool-use benchmark: questions that need search, Python, or both, over a fictional world.

The world (:mod:`arpo.data.synthetic_world`) is a seeded knowledge base of countries, cities, people and
companies; each entity is one document of the search corpus. Question kinds (``data_source`` =
``synthetic/<kind>``; builders in :mod:`arpo.data.synthetic_questions`):

* ``search``  — 1-hop ("What is the capital of Zorvia?") or 2-hop ("In which city was the founder of
  Trivex born?") lookups;
* ``python``  — arithmetic beyond a small model's head ("What is 4821 * 37?");
* ``both``    — a looked-up number fed into arithmetic ("How many years passed between the founding of
  Trivex and 2024?");
* ``chain``   — three dependent lookups ("What is the currency of the country where Mira Dolan was born?");
* ``compare`` — two looked-up numbers combined in Python ("How many more employees does Trivex have than
  Trivex Labs?"); the answer is in no document;
* ``chain_math`` — a 2-hop lookup whose number goes into Python ("What is the birth year of the founder of
  Trivex multiplied by 7?");
* ``pick`` — one of ``synthetic.candidates`` towns sharing a name, picked from a search page by its country, its
  population fed into Python ("What is the population of the town of Kora in Zorvia multiplied by 7?"): ARPO's
  premise by construction, the decision right after a tool result (:mod:`arpo.data.synthetic_namesakes`,
  ``synthetic=premise``).

The first three are easy for a pretrained model after a short SFT; the last three (and near-namesake
distractor entities, ``synthetic.world.distractor_fraction``) leave it headroom for RL. Every row stores its
gold tool plan in ``extra_info.plan`` (JSON), which the cold-start SFT turns into demonstrations by executing
the real tools. Output: verl-format parquet (``train``/``val``/``test``, and ``test_easy`` with only the easy
kinds when ``synthetic.sizes.test_easy`` > 0) and the knowledge base as a JSONL search corpus
(``corpus.jsonl``).

Run: ``python -m arpo.data.synthetic [synthetic=hard] [synthetic.out_dir=...] [synthetic.seed=...]``.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path
from typing import Any, Mapping, NoReturn

import pandas as pd

from arpo.data.synthetic_namesakes import build_namesakes, check_candidates
from arpo.data.synthetic_questions import EASY_KINDS, HARD_KINDS, KINDS, PREMISE_KINDS, make_question
from arpo.data.synthetic_world import World, add_distractors, build_world, fact_index, sentences, world_documents

__all__ = ["EASY_KINDS", "HARD_KINDS", "KINDS", "SYSTEM_PROMPT", "World", "build_world", "generate",
           "generate_from_config", "make_rows", "make_world", "world_documents"]

logger = logging.getLogger(__name__)

#: The ARPO system prompt, condensed from the released training set's (same tags, same answer format; that one
#: also has a ``\x08oxed`` typo from an unescaped backslash). Short on purpose: on a 2-core CPU every prompt
#: token is paid for in every rollout and every update.
SYSTEM_PROMPT = (
    "You are a helpful assistant that solves the question step by step with the help of the search tool and "
    "the python interpreter tool. Reason inside <think> </think>. To search, write <search> query </search>; "
    "to calculate, write <python> code </python>; each tool result is returned inside <result> </result>. "
    "End with <answer> The final answer is \\boxed{answer here} </answer>, the exact answer inside \\boxed{}."
)

_SPLITS = ("train", "val", "test", "test_easy")
_DEFAULT_SIZES = {"train": 2000, "val": 64, "test": 128}
_DEFAULT_MIX = {"search": 0.4, "python": 0.3, "both": 0.3}
# synthetic.world.* -> default (for callers that pass only part of it)
_WORLD_DEFAULTS: dict[str, Any] = {"num_countries": 24, "cities_per_country": 3, "num_people": 120,
                                   "num_companies": 60, "distractor_fraction": 0.0, "page_chars": 0,
                                   "namesake_groups": 0}


def _config_error(message: str) -> NoReturn:
    from arpo.config import ConfigError  # local import: keeps this module importable without hydra

    raise ConfigError(message)


def _check_config(sizes: Mapping[str, int], mix: Mapping[str, float], two_hop_fraction: float,
                  world: Mapping[str, Any], candidates: Any = 1) -> None:
    """One line naming the bad ``synthetic.*`` key and the fix, before anything is written."""
    for key, table, allowed in (("sizes", sizes, _SPLITS), ("mix", mix, KINDS), ("world", world, _WORLD_DEFAULTS)):
        for k in table:
            if k not in allowed:
                _config_error(f"synthetic.{key}.{k}: unknown key; use one of {', '.join(allowed)}")
    for split in ("train", "val", "test"):
        if split not in sizes:
            _config_error(f"synthetic.sizes.{split} is missing; give the number of {split} rows")
    for k, n in sizes.items():
        if not _is_int(n) or n < 0:
            _config_error(f"synthetic.sizes.{k}={n!r}: must be an integer >= 0")
    for k, w in mix.items():
        if not _is_number(w) or w < 0:
            _config_error(f"synthetic.mix.{k}={w!r}: a kind's weight must be a number >= 0")
    if sum(mix.values()) <= 0:
        _config_error(f"synthetic.mix={dict(mix)} is invalid: give at least one of {', '.join(KINDS)} a weight > 0")
    if not _is_number(two_hop_fraction) or not 0 <= two_hop_fraction <= 1:
        _config_error(f"synthetic.two_hop_fraction={two_hop_fraction!r}: must be a number in [0, 1]")
    for k, v in world.items():
        if k == "distractor_fraction":
            ok, need = _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"
        else:
            low = 0 if k in ("page_chars", "namesake_groups") else 1
            ok, need = _is_int(v) and v >= low, f"an integer >= {low}"
        if not ok:
            _config_error(f"synthetic.world.{k}={v!r}: must be {need}")
    try:
        check_candidates(candidates)
    except ValueError as e:
        _config_error(str(e))
    if mix.get("pick", 0) > 0 and not world.get("namesake_groups"):
        _config_error("synthetic.mix.pick > 0 needs namesake towns: set synthetic.world.namesake_groups > 0")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def make_world(seed: int, world: Mapping[str, Any] | None = None, candidates: Any = 1) -> World:
    """The world ``generate`` writes for ``synthetic.world`` and ``synthetic.candidates`` (missing keys take their
    defaults)."""
    w = {**_WORLD_DEFAULTS, **(world or {})}
    base = build_world(seed, w["num_countries"], w["cities_per_country"], w["num_people"], w["num_companies"])
    world_ = add_distractors(base, seed, w["distractor_fraction"])
    if w["namesake_groups"]:
        try:
            world_.namesakes = build_namesakes(world_, seed, w["namesake_groups"], candidates)
        except ValueError as e:
            _config_error(str(e))
    return world_


def _usable(kind: str, answer: str, plan: list[dict], facts: Mapping[str, tuple[str, int]],
            page_chars: int) -> bool:
    """Whether a drawn question is answerable from what the search tool shows, and (hard computed kinds) not
    copyable from it. ``page_chars`` > 0: every fact a search step needs must end within that many characters
    of its page, or the tool's cut page would hide it. A number computed from found ones (``compare``,
    ``chain_math``) must not stand in any page the plan reads, or one result would give the answer away."""
    computed = kind in ("compare", "chain_math", "pick")
    if not page_chars and not computed:
        return True
    pages = []
    for step in plan:
        if step["tool"] != "search":
            continue
        for sent in sentences(step["finding"]):
            page, end = facts.get(sent, ("", -1))
            if end < 0 or (page_chars and end > page_chars):
                return False
            pages.append(page)
    return not (computed and any(re.search(rf"\b{re.escape(answer)}\b", page) for page in pages))


def make_rows(world: World, n: int, mix: Mapping[str, float], split: str, seed: int, two_hop_fraction: float,
              agent_name: str, exclude: set[str] | None = None,
              facts: Mapping[str, tuple[str, int]] | None = None, page_chars: int = 0) -> list[dict]:
    """``n`` distinct verl rows of the kinds in ``mix`` (by weight), none of whose questions is in ``exclude``;
    ``facts`` (:func:`fact_index` of the corpus) and ``page_chars`` screen them (see :func:`_usable`)."""
    rng = random.Random(f"{seed}-{split}")
    # zero-weight kinds are dropped: listing a kind at 0 then draws exactly what leaving it out draws
    kinds = [k for k in mix if mix[k] > 0]
    weights = [mix[k] for k in kinds]
    facts = facts if facts is not None else fact_index(world_documents(world))
    rows, seen = [], set(exclude or ())
    attempts, kind = 0, ""
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            _config_error(f"could not draw {n} distinct {split} questions: grow the world (synthetic.world.*)"
                          + (" or raise synthetic.world.page_chars" if page_chars else ""))
        kind = kind or rng.choices(kinds, weights)[0]
        q, a, plan, hops = make_question(world, kind, rng, two_hop_fraction)
        if not _usable(kind, a, plan, facts, page_chars):
            continue  # redrawn in the same kind: the screen must not shift the mix to kinds it rarely rejects
        kind, drawn = "", kind
        if q in seen:
            # A hard kind is redrawn in its kind, so that its smaller pool of distinct questions does not shrink
            # its share of the mix; an easy kind draws a fresh kind, the rule the default preset's files follow.
            kind = drawn if drawn in HARD_KINDS + PREMISE_KINDS else ""
            continue
        seen.add(q)
        rows.append({
            "data_source": f"synthetic/{drawn}",
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
            "ability": drawn,
            "reward_model": {"ground_truth": a, "style": "rule"},
            "extra_info": {"index": len(rows), "split": split, "question": q, "kind": drawn, "hops": hops,
                           "plan": json.dumps(plan)},
            "agent_name": agent_name,
        })
    return rows


def generate(out_dir: str | Path, seed: int = 0, sizes: Mapping[str, int] | None = None,
             mix: Mapping[str, float] | None = None, two_hop_fraction: float = 0.3,
             world_sizes: Mapping[str, Any] | None = None, agent_name: str = "tool_agent",
             candidates: Any = 1) -> dict[str, Path]:
    """Write ``{train,val,test}.parquet`` (+ ``test_easy.parquet`` when ``sizes["test_easy"]`` > 0) and
    ``corpus.jsonl`` under ``out_dir``; return their paths. ``world_sizes`` is ``synthetic.world``,
    ``candidates`` ``synthetic.candidates`` (towns per namesake group: an int or a list to draw from)."""
    sizes = dict(sizes or _DEFAULT_SIZES)
    mix = dict(mix or _DEFAULT_MIX)
    world_cfg = {**_WORLD_DEFAULTS, **(world_sizes or {})}
    _check_config(sizes, mix, two_hop_fraction, world_cfg, candidates)
    world = make_world(seed, world_cfg, candidates)
    docs = world_documents(world)
    facts = fact_index(docs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    corpus_path = out / "corpus.jsonl"
    with corpus_path.open("w") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    paths["corpus"] = corpus_path
    # The easy held-out split keeps the mix's proportions among the easy kinds (equal when it has none).
    easy_mix = {k: w for k, w in mix.items() if k in EASY_KINDS and w > 0} or dict.fromkeys(EASY_KINDS, 1.0)
    # Held-out splits never repeat a training question; test_easy comes last so it repeats none at all.
    taken: set[str] = set()
    for split in ("test", "val", "train", "test_easy"):
        if split == "test_easy" and not sizes.get(split):
            continue
        rows = make_rows(world, sizes[split], easy_mix if split == "test_easy" else mix, split, seed,
                         two_hop_fraction, agent_name, exclude=taken, facts=facts, page_chars=world_cfg["page_chars"])
        taken.update(r["extra_info"]["question"] for r in rows)
        path = out / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(path, index=False)
        paths[split] = path
    logger.info("synthetic benchmark written to %s (%s)", out, {k: sizes[k] for k in sizes})
    return paths


def generate_from_config(s: Any, out_dir: str | Path | None = None) -> dict[str, Path]:
    """:func:`generate` with every key of a ``synthetic`` config section (into ``out_dir``, default its own)."""
    return generate(out_dir if out_dir is not None else s.out_dir, seed=s.seed, sizes=dict(s.sizes), mix=dict(s.mix),
                    two_hop_fraction=s.two_hop_fraction, world_sizes=dict(s.world), agent_name=s.agent_name,
                    candidates=s.get("candidates", 1))


def main() -> None:
    from arpo.reference.cli_help import exit_if_help
    from arpo.config import load_config  # local import: keeps this module importable without hydra

    exit_if_help("synthetic_data", "python -m arpo.data.synthetic", __doc__)
    cfg = load_config("synthetic_data")
    paths = generate_from_config(cfg.synthetic)
    for k, p in paths.items():
        print(f"{k}: {p}")


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
