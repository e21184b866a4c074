"""The premise task (synthetic=premise, the pick kind): each level lists the stated number of namesake towns, the
right one cannot be told from the prompt, the tools are needed (real BM25 search, real Python sandbox), and the
cold-start demonstrations pick a wrong town at the configured rate."""

import collections
import json
import random
import re

import pandas as pd
import pytest

from arpo.config import ConfigError, load_config
from arpo.data.synthetic import generate_from_config, make_world
from arpo.data.synthetic_world import fact_index, world_documents

SIZES = ["synthetic.sizes.train=300", "synthetic.sizes.val=40", "synthetic.sizes.test=40",
         "synthetic.world.namesake_groups=120"]


def _config(tmp_path, level, extra=()):
    return load_config("synthetic_data", ["synthetic=premise", f"synthetic.candidates={level}",
                                          f"synthetic.out_dir={tmp_path}", *SIZES, *extra]).synthetic


@pytest.fixture(scope="module")
def levels(tmp_path_factory):
    """Each level's data and world, and the real benchmark tools over the level-4 corpus."""
    from tools.registry import load_tools

    out = {}
    for level in (1, 2, 4):
        path = tmp_path_factory.mktemp(f"premise_k{level}")
        cfg = _config(path, level)
        paths = generate_from_config(cfg)
        out[level] = {"cfg": cfg, "paths": paths, "world": make_world(cfg.seed, dict(cfg.world), cfg.candidates),
                      "rows": pd.concat([pd.read_parquet(paths[s]) for s in ("train", "val", "test")])}
    tools = load_tools(load_config("sft", ["synthetic=premise", f"synthetic.out_dir={out[4]['paths']['train'].parent}"]).tools)
    out["tools"] = tools
    yield out
    tools.close()


def _page(world, name):
    return next(g for g in world.namesakes if g.name == name)


@pytest.mark.parametrize("level", [1, 2, 4])
def test_each_question_lists_the_levels_number_of_towns(levels, level):
    world, rows = levels[level]["world"], levels[level]["rows"]
    assert set(rows.ability) == {"pick"}
    for row in rows.itertuples():
        search, python = json.loads(row.extra_info["plan"])
        group = _page(world, search["content"])
        assert len(group.towns) == level and len({c for c, _ in group.towns}) == level
        assert len(python["alternatives"]) == level - 1
        assert group.document()["text"].count(f"{group.name} in ") == level


def test_a_mixed_list_draws_every_level(tmp_path):
    cfg = _config(tmp_path, "[1,2,4]")
    world = make_world(cfg.seed, dict(cfg.world), list(cfg.candidates))
    sizes = collections.Counter(len(g.towns) for g in world.namesakes)
    assert set(sizes) == {1, 2, 4} and min(sizes.values()) > 20


def test_the_right_town_is_not_recoverable_from_the_prompt(levels):
    world, rows = levels[4]["world"], levels[4]["rows"]
    positions = collections.Counter()
    for row in rows.itertuples():
        search, python = json.loads(row.extra_info["plan"])
        group = _page(world, search["content"])
        prompt = " ".join(m["content"] for m in row.prompt)
        target = next(i for i, (c, p) in enumerate(group.towns) if search["finding"] == group.entry(c, p))
        positions[target] += 1
        # the question names the town and its country, never a population; no other candidate's country
        assert not re.search(r"\d{6}", prompt)
        others = [c for i, (c, _) in enumerate(group.towns) if i != target]
        assert group.towns[target][0] in prompt and not any(f" {c} " in f" {prompt} " for c in others)
    # the right entry stands anywhere on the page (binomial sd ~10 at 380 rows)
    assert set(positions) == {0, 1, 2, 3} and min(positions.values()) > 60


def test_the_tools_are_needed_and_give_the_answer(levels):
    world, rows, tools = levels[4]["world"], levels[4]["rows"], levels["tools"]
    pages = "\n".join(d["text"] for d in world_documents(world))
    for row in rows.head(6).itertuples():
        answer = row.reward_model["ground_truth"]
        search, python = json.loads(row.extra_info["plan"])
        # the answer is computed: no page holds it, and the prompt does not
        assert not re.search(rf"\b{answer}\b", pages) and answer not in row.prompt[1]["content"]
        # the town's name alone finds its page (real BM25, top-1), with the right entry on it
        shown = tools["search"].call_text(search["content"])
        assert search["finding"] in shown and shown.count(f"{search['content']} in ") == 4
        # the real sandbox computes the answer from the right entry, and another answer from each wrong one
        assert tools["python"].call_text(python["content"]).strip() == answer
        wrong = {tools["python"].call_text(a["content"]).strip() for a in python["alternatives"]}
        assert wrong == {a["answer"] for a in python["alternatives"]} and answer not in wrong


def test_pages_fit_the_search_tools_cut(levels):
    facts = fact_index(world_documents(levels[4]["world"]))
    for row in levels[4]["rows"].itertuples():
        search, _ = json.loads(row.extra_info["plan"])
        assert facts[search["finding"]][1] <= levels[4]["cfg"].world.page_chars


@pytest.mark.parametrize("level, verbose", [(1, False), (4, False), (4, True)])
def test_demonstrations_pick_a_wrong_town_at_the_configured_rate(levels, level, verbose):
    from arpo.data.sft_demonstrations import build_demonstration

    rows = levels[level]["rows"].head(60)
    modes = collections.Counter()
    for i, row in enumerate(rows.itertuples()):
        plan = json.loads(row.extra_info["plan"])
        segs, mode = build_demonstration(row.extra_info["question"], row.reward_model["ground_truth"], plan,
                                         levels["tools"] if level == 4 else _tools_for(levels, level),
                                         random.Random(i), 0.0, 0.0, verbose_think=verbose, wrong_pick_prob=0.5)
        modes[mode] += 1
        text = "".join(s.text for s in segs)
        # the model's own text after the search result: the thought and the call that make the pick
        picked = segs[2].text
        if mode == "wrong_pick":
            alt = next(a for a in plan[1]["alternatives"] if a["content"] in text)
            assert f"\\boxed{{ {alt['answer']} }}" in segs[-1].text and plan[1]["content"] not in text
            assert (alt["entry"] in picked) == verbose and plan[0]["finding"] not in picked
            assert (alt["finding"] in segs[-1].text) == verbose  # the closing thought restates the wrong result
        else:
            assert plan[1]["content"] in text and f"\\boxed{{ {row.reward_model['ground_truth']} }}" in segs[-1].text
            assert (plan[0]["finding"] in picked) == verbose
    if level == 1:
        assert modes == {"gold": len(rows)}  # one town: nothing to pick
    else:
        assert 15 <= modes["wrong_pick"] <= 45 and modes["wrong_pick"] + modes["gold"] == len(rows)


def _tools_for(levels, level):
    from tools.registry import load_tools

    if f"tools{level}" not in levels:
        out = levels[level]["paths"]["train"].parent
        levels[f"tools{level}"] = load_tools(load_config("sft", ["synthetic=premise", f"synthetic.out_dir={out}"]).tools)
    return levels[f"tools{level}"]


@pytest.mark.parametrize("extra, field", [
    (["synthetic.world.namesake_groups=0"], "synthetic.world.namesake_groups"),
    (["synthetic.candidates=0"], "synthetic.candidates"),
    (["synthetic.candidates=25"], "synthetic.candidates"),
])
def test_bad_premise_settings_are_one_line_naming_the_key(tmp_path, extra, field):
    cfg = _config(tmp_path, 2, extra)
    with pytest.raises(ConfigError, match=re.escape(field)):
        generate_from_config(cfg)
