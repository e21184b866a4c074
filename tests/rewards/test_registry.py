"""Routing by data_source, verl's default_compute_score, and the custom_reward_function override."""

from __future__ import annotations

import pickle
import textwrap

import pytest

import reward_fns
from reward_fns import FileRewardFn, build_compute_score, builtin_registry, default_compute_score
from reward_fns.registry import REGISTRY, load_custom_reward_fn

from .conftest import REPO_ROOT, respond

BOTH_TOOLS = respond(("search", "q", "r"), ("python", "print(0.5)", "0.5"), answer="0.5")


@pytest.mark.parametrize("source, family", [
    ("DR_grpo_mix", "deep_research"), ("DR_simpledeepsearch0.8k", "deep_research"), ("DR_gaia", "deep_research"),
    ("aime24", "math"), ("aime25", "math"), ("math500", "math"), ("gsm8k", "math"), ("math", "math"),
    ("lighteval/MATH", "math"), ("hotpotqa", "qa"), ("2wiki", "qa"), ("musique", "qa"), ("bamboogle", "qa"),
    ("nq", "qa"), ("triviaqa", "qa"), ("SimpleQA", "qa"), ("searchR1_nq", "qa"), ("synthetic/both", "synthetic"),
])
def test_builtin_routes(source, family):
    assert REGISTRY.lookup(source).family == family


def test_the_route_decides_the_grading():
    # same response, ground truth 1/2: ARPO's reward grades by F1 and adds the bonus; math by equivalence
    dr = default_compute_score("DR_grpo_mix", BOTH_TOOLS, "\\frac{1}{2}")
    assert dr["score"] == 0.0 and dr["acc"] == 0.0
    assert default_compute_score("math500", BOTH_TOOLS, "\\frac{1}{2}")["score"] == 1.0
    assert default_compute_score("DR_grpo_mix", BOTH_TOOLS, "0.5")["score"] == pytest.approx(1.1)


def test_unknown_data_source_names_it_and_how_to_register():
    with pytest.raises(KeyError) as err:
        default_compute_score("my_new_bench", BOTH_TOOLS, "0.5")
    message = str(err.value)
    assert "my_new_bench" in message and "register" in message and "custom_reward_function.path" in message


def test_register_exact_and_prefix_routes_longest_prefix_wins():
    reg = builtin_registry()
    reg.register("corp/", "reward_fns.qa:compute_score", prefix=True, family="qa", metric="em")
    reg.register("corp/math", "reward_fns.math:compute_score", prefix=True, family="math")
    assert reg.lookup("corp/trivia").family == "qa"
    assert reg.lookup("corp/math_hard").family == "math"
    text = respond(answer="Titan IIIE rocket")
    assert reg("corp/trivia", text, "Titan IIIE")["score"] == 0.0  # em, fixed by the registration kwargs
    reg.register("corp/trivia", lambda ds, s, gt, extra=None: 0.25)
    assert reg("corp/trivia", text, "x") == 0.25  # exact beats prefix
    with pytest.raises(ValueError, match="module:function"):
        reg.register("bad", "no_colon_here")


def test_process_wide_register_is_visible_to_default_compute_score():
    reward_fns.register("test_only_source", "reward_fns.qa:compute_score", family="qa")
    try:
        assert default_compute_score("test_only_source", respond(answer="x"), "x")["score"] == 1.0
    finally:
        del REGISTRY.exact["test_only_source"]


def test_build_compute_score_applies_reward_options_without_touching_the_global_registry():
    f1_math = build_compute_score({"reward": {"math_mode": "f1", "qa_metric": "em",
                                              "deep_research_tool_bonus": 0.0}})
    assert f1_math("math500", BOTH_TOOLS, "\\frac{1}{2}")["score"] == 0.0
    assert f1_math("hotpotqa", respond(answer="the Crystal Dynamics studio"), "Crystal Dynamics")["score"] == 0.0
    assert f1_math("DR_grpo_mix", BOTH_TOOLS, "0.5")["score"] == 1.0
    assert default_compute_score("math500", BOTH_TOOLS, "\\frac{1}{2}")["score"] == 1.0
    with pytest.raises(ValueError, match="reward.math_mode"):
        build_compute_score({"reward": {"math_mode": "exact"}})
    pickle.loads(pickle.dumps(f1_math))  # reward worker processes receive it


def test_build_compute_score_reads_omegaconf_configs():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.load(REPO_ROOT / "configs" / "reward.yaml")
    fn = build_compute_score(cfg)
    assert fn("math500", BOTH_TOOLS, "\\frac{1}{2}")["score"] == 1.0
    cfg.reward.math_mode = "f1"
    assert build_compute_score(cfg)("math500", BOTH_TOOLS, "\\frac{1}{2}")["score"] == 0.0


CUSTOM_REWARD = textwrap.dedent('''
    def length_reward(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
        return {"score": scale * float(ground_truth in solution_str), "length": len(solution_str)}

    def plain(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5
''')


def test_custom_reward_function_loads_a_function_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_REWARD)
    config = {"custom_reward_function": {"path": str(path), "name": "length_reward",
                                         "reward_kwargs": {"scale": 2.0}},
              "reward": {"math_mode": "f1"}}
    fn = build_compute_score(config)
    assert isinstance(fn, FileRewardFn)
    out = fn("anything_at_all", "the answer is 42", "42", None)  # the registry is bypassed entirely
    assert out == {"score": 2.0, "length": len("the answer is 42")}
    clone = pickle.loads(pickle.dumps(fn))
    assert clone("x", "no", "42", None)["score"] == 0.0
    assert load_custom_reward_fn({"custom_reward_function": {"path": str(path), "name": "plain"}})("a", "b", "c") \
        == 0.5
    assert load_custom_reward_fn({"custom_reward_function": {"path": None}}) is None


def test_custom_reward_function_errors_name_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        FileRewardFn(str(tmp_path / "missing.py"))
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_REWARD)
    with pytest.raises(AttributeError, match=r"custom_reward_function.name='compute_score'.*length_reward"):
        FileRewardFn(str(path))
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(RuntimeError, match="error while loading"):
        FileRewardFn(str(broken))


def test_deep_research_file_loads_by_path_like_the_official_scripts():
    fn = FileRewardFn(str(REPO_ROOT / "reward_fns" / "deep_research.py"), "compute_score")
    assert fn("DR_grpo_mix", BOTH_TOOLS, "0.5")["score"] == pytest.approx(1.1)


PROTOCOL_REWARDS = textwrap.dedent('''
    from reward_fns import default_compute_score

    def tags(data_source, solution_str, ground_truth, extra_info=None, protocol=None):
        return {"score": 1.0, "tags": ",".join(protocol.tags.values()) if protocol else "none"}

    def wrapper(data_source, solution_str, ground_truth, extra_info=None, protocol=None):
        return default_compute_score(data_source, solution_str, ground_truth, extra_info, protocol=protocol)
''')
CONVERTER_TOOLS = {"tools": [{"class_name": "examples.unit_converter_tool.UnitConverterTool", "tag": "convert"}]}
CONVERT = respond(("convert", "3 km to mi", "3 km = 1.864 mi"), answer="1.864")


def test_the_run_s_tools_reach_rewards_that_declare_protocol_and_only_those(tmp_path):
    fn = build_compute_score(CONVERTER_TOOLS)
    assert fn.protocol.tags == {"unit_converter": "convert"}
    assert pickle.loads(pickle.dumps(fn))("synthetic/python", CONVERT, "1.864")["score"] == 1.0
    assert build_compute_score(None)("synthetic/python", CONVERT, "1.864")["score"] == -1.0  # default: not a tag
    assert build_compute_score({"tools": []}).protocol is None
    # a registered reward with verl's four arguments (or **kwargs) is called as before
    seen = []
    fn.register("old_style", lambda ds, sol, gt, extra=None, **kwargs: seen.append(kwargs) or 0.5)
    assert fn("old_style", CONVERT, "x") == 0.5 and seen == [{}]
    # a custom file: the declared parameter gets the tags; a wrapper passes them on to the routed reward, and
    # they are dropped for a route that does not declare them
    path = tmp_path / "protocol_rewards.py"
    path.write_text(PROTOCOL_REWARDS)
    config = {**CONVERTER_TOOLS, "custom_reward_function": {"path": str(path), "name": "tags"}}
    assert build_compute_score(config)("a", "b", "c")["tags"] == "convert"
    assert build_compute_score({"custom_reward_function": {"path": str(path), "name": "tags"}})("a", "b", "c")[
        "tags"] == "none"
    wrapper = build_compute_score({**config, "custom_reward_function": {"path": str(path), "name": "wrapper"}})
    assert pickle.loads(pickle.dumps(wrapper))("synthetic/python", CONVERT, "1.864")["score"] == 1.0
    REGISTRY.register("test_only_old_style", lambda ds, sol, gt, extra=None: 0.25)
    try:
        assert wrapper("test_only_old_style", CONVERT, "x") == 0.25
    finally:
        del REGISTRY.exact["test_only_old_style"]
