"""The synthetic tool-use benchmark reward: numeric tolerance, entity EM/F1, the shared format gate."""

from __future__ import annotations

import pandas as pd
import pytest

from reward_fns import default_compute_score
from reward_fns.synthetic import compute_score, parse_number

from .conftest import respond

CALC = ("python", "print(17 * 23)", "391")


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-3.5", -3.5), ("1,234", 1234.0), ("3/4", 0.75), ("1e-3", 0.001), ("12%", 12.0),
    ("$7", 7.0), ("forty-two", None), ("1,2", None), ("3/0", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_numeric_answers_compare_with_tolerance():
    assert compute_score("synthetic/python", respond(CALC, answer="391"), "391")["score"] == 1.0
    assert compute_score("synthetic/python", respond(CALC, answer="391.0000001"), "391")["score"] == 1.0
    assert compute_score("synthetic/python", respond(CALC, answer="391.01"), "391")["score"] == 0.0
    assert compute_score("synthetic/python", respond(CALC, answer="391.01"), "391", rel_tol=1e-3)["score"] == 1.0
    # a whole-number answer is exact up to float noise, however large: the relative tolerance (1.2 here) would
    # otherwise pass the next integer
    assert compute_score("synthetic/compare", respond(CALC, answer="1,201,200"), "1201200")["score"] == 1.0
    assert compute_score("synthetic/compare", respond(CALC, answer="1201201"), "1201200")["score"] == 0.0
    assert compute_score("synthetic/compare", respond(CALC, answer="1201200.0000001"), "1201200")["score"] == 1.0
    # a non-numeric prediction for a numeric ground truth is wrong, though F1 would give partial credit
    words = compute_score("synthetic/python", respond(CALC, answer="391 apples"), "391")
    assert words["score"] == 0.0 and words["f1"] == pytest.approx(2 / 3)


def test_entity_answers_by_normalised_em_or_f1():
    lookup = ("search", "capital of Australia", "Page 1: Canberra is the capital city of Australia.")
    assert compute_score("synthetic/search", respond(lookup, answer="The Canberra"), "Canberra")["score"] == 1.0
    partial = respond(lookup, answer="Canberra city")
    assert compute_score("synthetic/search", partial, "Canberra")["score"] == 0.0
    # "canberra city" vs "canberra": P 1/2, R 1 -> 2/3
    assert compute_score("synthetic/search", partial, "Canberra", entity_metric="f1")["score"] == pytest.approx(2 / 3)


def test_registry_routes_every_synthetic_source_and_applies_the_gate():
    both = respond(("search", "q", "17"), CALC, answer="391")
    for source in ("synthetic/search", "synthetic/python", "synthetic/both", "synthetic/anything_new"):
        assert default_compute_score(source, both, "391")["score"] == 1.0
        assert default_compute_score(source, "<answer>\\boxed{391}</answer>", "391")["score"] == -1.0


def test_a_near_namesake_distractor_is_a_wrong_answer():
    lookup = ("search", "founder of Trivex", "Page 1: Trivex Labs: Trivex Labs was founded by Mira Dolan.")
    for gold, distractor in (("Trivex", "Trivex Labs"), ("Kora", "New Kora"), ("Mira Dolan", "Tora Dolan")):
        assert compute_score("synthetic/chain", respond(lookup, answer=gold), gold)["score"] == 1.0
        assert compute_score("synthetic/chain", respond(lookup, answer=distractor), gold)["score"] == 0.0
        assert compute_score("synthetic/chain", respond(lookup, answer=gold), distractor)["score"] == 0.0
    # F1 gives the shared word partial credit: "trivex labs" vs "trivex" -> P 1/2, R 1
    partial = compute_score("synthetic/chain", respond(lookup, answer="Trivex Labs"), "Trivex", entity_metric="f1")
    assert partial["score"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("preset", ["hard", "premise"])
def test_every_kind_of_a_preset_is_graded_by_its_answer(preset, tmp_path):
    """Gold answers score 1, a number off by one or the answer's twin scores 0, in every kind the benchmark writes."""
    from arpo.config import load_config
    from arpo.data.synthetic import KINDS, generate, make_world

    s = load_config("synthetic_data", [f"synthetic={preset}", "synthetic.sizes.train=60"]).synthetic
    paths = generate(tmp_path, seed=s.seed, sizes=dict(s.sizes), mix=dict(s.mix), two_hop_fraction=s.two_hop_fraction,
                     world_sizes=dict(s.world))
    world = make_world(s.seed, dict(s.world))
    df = pd.read_parquet(paths["train"])
    assert set(df.ability) == {k for k in KINDS if s.mix.get(k, 0) > 0}  # every kind the preset weighs
    twins_checked = 0
    for row in df.itertuples():
        gold = row.reward_model["ground_truth"]
        call = ("search", row.extra_info["question"], "Page 1: ...")
        assert default_compute_score(row.data_source, respond(call, answer=gold), gold)["score"] == 1.0
        wrong = str(int(gold) + 1) if gold.isdigit() else world.counterpart(gold)
        if wrong is not None:
            twins_checked += not gold.isdigit()
            assert default_compute_score(row.data_source, respond(call, answer=wrong), gold)["score"] == 0.0
    assert twins_checked or all(g.isdigit() for g in df.reward_model.map(lambda r: r["ground_truth"]))
