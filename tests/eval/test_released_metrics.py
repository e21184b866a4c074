"""The ``arpo`` metric profile against the released ARPO evaluation, run on 1,808 cases (fixtures made by
``tests/eval/fixtures/make_released_fixtures.py`` from RUC-NLPIR/ARPO a95cd08), and where it differs from ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arpo.evaluation import released_metrics as rm
from arpo.evaluation.metrics import arpo_metrics, released_task
from reward_fns import math as math_reward
from reward_fns import qa

FIXTURES = Path(__file__).parent / "fixtures"


def _cases(name: str) -> list[dict]:
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))["cases"]


def test_every_released_evaluation_case_is_reproduced_exactly():
    cases = _cases("released_eval.json")
    assert len(cases) > 1500
    wrong = []
    for c in cases:
        got = rm.sample_metrics(c["output"], c["answer"], c["task"], c["benchmark"])
        e = c["expected"]
        want = {"em": e["em"], "substring_acc": e["acc"], "f1": e["f1"], "math_equal": e["math_equal"],
                "prediction": e["prediction"]}
        if any(got[k] != pytest.approx(v, abs=1e-12) if k != "prediction" else got[k] != v for k, v in want.items()):
            wrong.append((c, got))
        headline = e["math_equal"] if c["task"] == "math" else e["f1"]  # the released overall accuracy
        assert got["acc"] == pytest.approx(headline, abs=1e-12)
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]}"


def test_fixtures_cover_the_faults_and_fallbacks():
    """The cases reach every path that makes the released metric odd, so matching them means something."""
    cases = _cases("released_eval.json")
    faults = 0
    for c in cases:
        pred = rm.normalize(rm.graded_prediction(c["output"]))
        try:
            rm.strip_math(pred)
        except rm._NormaliserFault:
            faults += 1
    assert faults >= 10  # \text{ twice, trailing \sqrt or \frac: raw string equality instead
    fallback = sum(not rm.extract_prediction(c["output"]) and bool(c["output"].strip()) for c in cases)
    assert fallback >= 50  # the last five lines graded
    assert sum(isinstance(c["answer"], str) and c["answer"].startswith("[") for c in cases) >= 40
    assert sum(c["expected"]["acc"] == 1 and c["expected"]["em"] == 0 for c in cases) >= 50  # substring acc
    assert {c["benchmark"] for c in cases} >= {"bamboogle", "hotpotqa", "2wiki", "musique", "gsm8k", "math500"}


@pytest.mark.parametrize("prediction,reference,released_f1,strict_f1", [
    ("The answer is 1827.", "1827", 0.0, 0.5),  # punctuation kept there
    ("Paris, France", "Paris", 0.0, 2 / 3),
    ("yes, definitely no", "no", 0.5, 0.0),  # no yes/no rule there
])
def test_qa_f1_differs_from_squad_where_the_issue_says(prediction, reference, released_f1, strict_f1):
    assert rm.qa_metrics(prediction, reference)["f1"] == pytest.approx(released_f1)
    assert qa.f1_score(prediction, reference) == pytest.approx(strict_f1)


def test_qa_substring_accuracy_and_list_like_references():
    assert rm.qa_metrics("it was 1827 or so", ["1827"])["substring_acc"] == 1.0
    assert rm.qa_metrics("anything", [""])["substring_acc"] == 1.0  # the empty reference is in everything
    assert rm.qa_references('["Paris", "Lyon"]') == ['"Paris"', '"Lyon"']  # quotes kept
    assert rm.qa_metrics("Lyon", '["Paris", "Lyon"]')["em"] == 0.0
    assert rm.qa_metrics("Lyon", "[Paris, Lyon]")["em"] == 1.0


@pytest.mark.parametrize("prediction,reference", [
    ("18.0", "18"), ("1,000", "1000"), ("\\frac{2}{4}", "\\frac{1}{2}"), ("x^2+1", "1+x^2"), ("$18", "18"),
])
def test_math_string_equivalence_rejects_what_math_verify_accepts(prediction, reference):
    assert not rm.math_equiv(rm.normalize(prediction), rm.normalize(reference))
    assert math_reward.is_equiv(prediction, reference)


def test_math_normaliser_rules():
    eq = lambda a, b: rm.math_equiv(rm.normalize(a), rm.normalize(b))  # noqa: E731
    assert eq("0.5", "\\frac{1}{2}") and eq("\\frac12", "\\frac{1}{2}") and eq("3/4", "\\frac{3}{4}")
    assert eq("90^\\circ", "90") and eq("50\\%", "50") and eq("x = 5", "5") and eq("5 \\text{ cm}", "5")
    assert not eq("abc=5", "5")  # only a left side of at most 2 characters is dropped
    assert eq("2\\sqrt", "2\\sqrt") and not eq("2\\sqrt", "2")  # a normaliser fault: raw strings compared
    assert eq("A", "a")  # lower-cased first


def test_prediction_extraction_and_the_last_five_lines_fallback():
    assert rm.graded_prediction("<answer>x \\boxed{\\text{Paris}}</answer>") == "Paris"
    assert rm.graded_prediction("<answer>Paris</answer>") == "Paris"
    assert rm.graded_prediction("so \\boxed{12}.") == "12"
    assert rm.graded_prediction("<answer>\\boxed{12</answer>") == "\\boxed{12"
    text = "l1\nl2\n\nl3\nl4\nl5\nl6"
    assert rm.graded_prediction(text) == "l2\nl3\nl4\nl5\nl6"
    assert rm.sample_metrics("", "12", "math")["acc"] == 0.0


def test_gsm8k_reference_is_the_number_after_the_hashes():
    assert rm.reference_for("gsm8k", "She sells 9 eggs.\n#### 1,018") == "1018"
    assert rm.sample_metrics("<answer>\\boxed{1018}</answer>", "work\n#### 1,018", "math", "gsm8k")["acc"] == 1.0
    assert rm.reference_for("math500", "#### 3") == "#### 3"


def test_task_follows_the_reward_family_and_records_are_graded_from_their_response():
    assert released_task("gsm8k") == "math" and released_task("bamboogle") == "qa"
    assert released_task("DR_hle_100") == "qa" and released_task("unknown_bench") == "qa"
    record = {"benchmark": "math500", "data_source": "math500", "ground_truth": "\\frac{1}{2}",
              "response": "<think>t</think><answer>\\boxed{0.5}</answer>"}
    assert arpo_metrics(record)["acc"] == 1.0 and arpo_metrics(record)["prediction"] == "0.5"
    with pytest.raises(ValueError, match="'math' or 'qa'"):
        rm.sample_metrics("x", "x", "code")
