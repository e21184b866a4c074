"""``reward.deep_research_variant=released``: the released ARPO training reward, checked against the released
function's outputs on 549 responses (``tests/eval/fixtures/released_reward.json``), and the two differences
from the default ``fixed`` reward that were undocumented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reward_fns import released_reward
from reward_fns.deep_research import compute_score
from reward_fns.registry import build_compute_score

FIXTURE = Path(__file__).parents[1] / "eval" / "fixtures" / "released_reward.json"


def test_every_released_reward_case_is_reproduced_exactly():
    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]
    assert len(cases) > 500
    for c in cases:
        got = compute_score("DR_grpo_mix", c["response"], c["ground_truth"], variant="released")
        want = c["expected"]
        assert got["score"] == pytest.approx(want["score"], abs=1e-12), c
        assert got["f1"] == pytest.approx(want["f1"], abs=1e-12), c
        if want["score"] != -1:
            assert got["answer"] == want["answer"], c
    scores = {c["expected"]["score"] for c in cases}
    assert {-1.0, 0.0, 1.0, 1.1} <= scores  # bad format, wrong, right, right with the text bonus


def test_boxed_with_a_space_is_graded_there_and_bad_format_here():
    response = "<think>t</think><answer>\\boxed{x} or rather \\boxed Paris$ said</answer>"
    released = compute_score("DR_x", response, ["Paris"], variant="released")
    assert released["score"] == 1.0 and released["answer"] == "Paris"  # "\boxed " wins over a complete \boxed{}
    assert compute_score("DR_x", "<think>t</think><answer>\\boxed Paris</answer>", ["Paris"])["score"] == -1.0


def test_empty_ground_truth_list_scores_zero_there_and_is_an_error_here():
    response = "<think>t</think><answer>\\boxed{Paris}</answer>"
    assert compute_score("DR_x", response, [], variant="released")["score"] == 0.0
    with pytest.raises(ValueError, match="empty list"):
        compute_score("DR_x", response, [])


def test_bonus_on_tag_text_and_format_by_counts():
    # a page quoting "</python>" earns the released bonus; the fixed reward needs a real python call
    response = ("<think>t</think><search>q</search><result>a page that quotes </python></result>"
                "<answer>\\boxed{Paris}</answer>")
    assert compute_score("DR_x", response, ["Paris"], variant="released")["score"] == pytest.approx(1.1)
    assert compute_score("DR_x", response, ["Paris"])["score"] == pytest.approx(1.0)
    # nested think blocks pass a count check
    assert released_reward.format_problem("<think><think></think></think><answer>\\boxed{1}</answer>") is None


def test_variant_is_chosen_in_config_and_validated():
    response = "<think>t</think><answer>\\boxed{x} \\boxed Paris</answer>"
    released = build_compute_score({"reward": {"deep_research_variant": "released"}})
    assert released("DR_grpo_mix", response, ["Paris"])["score"] == 1.0
    assert build_compute_score({"reward": {}})("DR_grpo_mix", response, ["Paris"])["score"] == 0.0  # graded "x"
    with pytest.raises(ValueError, match="reward.deep_research_variant must be one of"):
        build_compute_score({"reward": {"deep_research_variant": "official"}})
    with pytest.raises(ValueError, match="deep_research variant must be one of"):
        compute_score("DR_x", response, ["Paris"], variant="official")
