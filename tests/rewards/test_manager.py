"""Batch scoring in parallel (threads and real worker processes), failure handling, and verl's token-level
reward tensor built from a collated DataBatch."""

from __future__ import annotations

import logging
import textwrap
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from arpo.batch import Trajectory, collate_trajectories
from reward_fns import FileRewardFn, build_compute_score
from reward_fns.manager import RewardManager, build_token_level_rewards

from .conftest import PYTHON_CHECK, REPO_ROOT, SEARCH_CITIBANK, respond

BOTH = respond(SEARCH_CITIBANK, PYTHON_CHECK, answer="James Madison")
HALF = respond(answer="0.5")

# A custom reward file: raises for one ground truth (a grader bug), returns a dict without score for
# another, and delegates the rest to the registry.
FLAKY = textwrap.dedent('''
    from reward_fns import default_compute_score

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "boom":
            raise ZeroDivisionError("grader bug")
        if ground_truth == "no-score":
            return {"f1": 1.0}
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
''')

ITEMS = [
    ("bamboogle", BOTH, ["james madison"], None),            # 1.0 (qa: no bonus)
    ("DR_grpo_mix", BOTH, "James Madison", None),            # 1.1
    ("math500", HALF, "\\frac{1}{2}", None),                 # 1.0
    ("DR_grpo_mix", HALF, "\\frac{1}{2}", None),             # 0.0 (token F1)
    ("hotpotqa", "no tags at all", ["yes"], None),           # -1.0
    ("synthetic/python", respond(answer="391"), "391", None),  # 1.0
    ("hotpotqa", BOTH, "boom", None),                        # raises -> error_score
    ("hotpotqa", BOTH, "no-score", None),                    # dict without score -> error_score
]
EXPECTED = [1.0, 1.1, 1.0, 0.0, -1.0, 1.0, 0.0, 0.0]


@pytest.fixture
def flaky_fn(tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY)
    return FileRewardFn(str(path), "flaky")


def _check_batch(result, caplog):
    assert result.scores == pytest.approx(EXPECTED)
    assert "ZeroDivisionError: grader bug" in result.rows[6]["error"]
    assert "without 'score'" in result.rows[7]["error"]
    assert all("error" not in row for row in result.rows[:6])
    assert result.metrics["reward/errors"] == 2.0
    assert result.metrics["reward/score/mean"] == pytest.approx(sum(EXPECTED) / 8)
    assert result.metrics["reward/DR_grpo_mix/score/mean"] == pytest.approx(0.55)
    assert result.metrics["reward/format_ok/mean"] == pytest.approx(5 / 6)  # 6 rows report format_ok
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("row 6" in w and "ZeroDivisionError" in w for w in warnings)
    extra = result.extra_info_lists()
    assert len(extra["score"]) == 8 and extra["f1"][6] is None and extra["answer"][0] == "James Madison"


@pytest.mark.parametrize("executor", ["serial", "thread"])
def test_in_process_executors(flaky_fn, caplog, executor):
    with RewardManager(flaky_fn, num_workers=3, executor=executor) as manager:
        _check_batch(manager.score(ITEMS), caplog)


def test_process_pool_scores_like_serial_and_survives_a_raising_reward(flaky_fn, caplog):
    with RewardManager(flaky_fn, num_workers=2, executor="process") as manager:
        _check_batch(manager.score(ITEMS), caplog)
        again = manager.score(ITEMS[:3])  # the pool is reused
        assert again.scores == pytest.approx(EXPECTED[:3])


def test_unrouted_data_source_fails_the_batch_before_scoring():
    with RewardManager(build_compute_score(None), executor="serial") as manager:
        with pytest.raises(KeyError, match="not_a_benchmark"):
            manager.score([("hotpotqa", BOTH, "x", None), ("not_a_benchmark", BOTH, "x", None)])


def test_bad_options_and_items_are_rejected():
    with pytest.raises(ValueError, match="reward.executor"):
        RewardManager(executor="gpu")
    with pytest.raises(ValueError, match="reward.position"):
        RewardManager(position="first")
    with pytest.raises(ValueError, match="expected"):
        RewardManager(executor="serial").score([("hotpotqa", BOTH, "x")])


def test_auto_scores_light_families_in_process_and_math_in_the_pool():
    light = [("synthetic/python", respond(answer="12"), "12", None), ("hotpotqa", BOTH, "x", None),
             ("DR_grpo_mix", BOTH, "x", None)]
    with RewardManager(build_compute_score(None), num_workers=2) as auto, \
            RewardManager(build_compute_score(None), num_workers=2, executor="process") as pool:
        assert auto.executor_kind == "auto"
        assert auto.score(light).rows == pool.score(light).rows  # the same verdicts, no worker process
        assert auto._pool is None and pool._pool is not None
        mixed = light + [ITEMS[2]]  # one math row: sympy / math-verify, whose time limits need the pool
        assert auto.score(mixed).scores == pool.score(mixed).scores
        assert isinstance(auto._pool, ProcessPoolExecutor)


def test_from_config_reads_the_reward_section(tmp_path):
    manager = RewardManager.from_config({"reward": {"num_workers": 1, "math_mode": "f1", "error_score": -0.5,
                                                    "position": "last_model_token"}})
    assert manager.executor_kind == "serial" and manager.error_score == -0.5
    assert manager.position == "last_model_token"
    assert manager.score([ITEMS[2]]).scores == [0.0]  # math graded by token F1


# a response calling the unit converter by its tag, <convert>, with the result the rollout appended
CONVERT = respond(("convert", "3 km to mi", "3 km = 1.864 mi"), answer="1.864")
CONVERT_ITEMS = [("synthetic/python", CONVERT, "1.864", None), ("DR_grpo_mix", CONVERT, "1.864", None)]


def test_from_config_gives_the_rewards_the_run_s_tool_tags():
    """The run's tools (here the unit converter) reach the format gate in the reward worker processes: without
    them <convert> is unknown text and its <result> a hallucinated tool output (-1)."""
    omegaconf = pytest.importorskip("omegaconf")
    reward = omegaconf.OmegaConf.load(REPO_ROOT / "configs" / "reward.yaml")
    tools = omegaconf.OmegaConf.load(REPO_ROOT / "examples" / "unit_converter_tools.yaml")
    reward.reward.num_workers, reward.reward.executor = 2, "process"
    with RewardManager.from_config(omegaconf.OmegaConf.merge(reward, tools)) as manager:
        assert manager.executor_kind == "process"
        result = manager.score(CONVERT_ITEMS)
    # synthetic: correct; deep_research: F1 1 + the bonus, since every loaded tool (the converter) really ran
    assert result.scores == pytest.approx([1.0, 1.1])
    assert [row["format_ok"] for row in result.rows] == [1.0, 1.0]
    with RewardManager.from_config({"reward": {"num_workers": 1}}) as manager:  # no tools: search and python
        assert manager.score(CONVERT_ITEMS).scores == [-1.0, -1.0]


def _batch(records):
    """Three rows of one DR_ prompt group: full model response; one ending inside a tool result; empty."""
    trajs = [
        Trajectory(group=0, prompt_ids=[1, 2, 3], response_ids=[10, 11, 12, 13], response_mask=[1, 1, 1, 1],
                   tool_calls=records[0]),
        Trajectory(group=0, prompt_ids=[1, 2, 3], response_ids=[10, 11, 20, 21], response_mask=[1, 1, 0, 0],
                   tool_calls=records[1]),
        Trajectory(group=0, prompt_ids=[1, 2, 3]),
    ]
    return collate_trajectories(trajs, pad_token_id=0, group_uids=["q0"], group_fields={
        "data_source": ["DR_grpo_mix"], "reward_model": [{"ground_truth": "James Madison", "style": "rule"}],
        "extra_info": [{"index": 0, "split": "train"}]})


def test_token_level_rewards_go_on_the_last_valid_token():
    ok = [{"tool": "search", "start": 5, "end": 9, "error": False},
          {"tool": "python", "start": 12, "end": 14, "error": False}]
    failed_python = [ok[0], {**ok[1], "error": True}]
    batch = _batch([ok, failed_python])
    with RewardManager(executor="serial") as manager:
        rewards, result = build_token_level_rewards(batch, [BOTH, BOTH, ""], manager)
    expected = torch.zeros(3, 4)
    expected[0, 3] = 1.1   # both tools ran -> bonus
    expected[1, 3] = 1.0   # the rollout recorded the python call as failed -> no bonus
    expected[2, 0] = -1.0  # empty response: bad format, kept on column 0 so the group sum sees it
    assert torch.allclose(rewards, expected)
    assert rewards.dtype == torch.float32
    assert [row["num_python"] for row in result.rows] == [1, 0, 0]


def test_token_level_rewards_on_the_last_model_token():
    batch = _batch([[], []])
    with RewardManager(executor="serial", position="last_model_token") as manager:
        rewards, _ = build_token_level_rewards(batch, [BOTH, BOTH, ""], manager)
    assert rewards[0, 3] == pytest.approx(1.0) and rewards[1, 1] == pytest.approx(1.0)
    assert rewards[1, 3] == 0.0 and rewards[2, 0] == -1.0


def test_token_level_rewards_can_decode_with_a_tokenizer_and_check_columns():
    class CharTokenizer:  # decodes ids as characters; enough to check what gets decoded
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i - 10) for i in ids)

    batch = _batch([[], []])
    with RewardManager(executor="serial") as manager:
        _, result = build_token_level_rewards(batch, None, manager, tokenizer=CharTokenizer())
        assert [row["format_reason"] for row in result.rows] == ["no <think> block"] * 3
        with pytest.raises(ValueError, match="response texts"):
            build_token_level_rewards(batch, ["only one"], manager)
        with pytest.raises(KeyError, match="source"):
            build_token_level_rewards(batch, [BOTH] * 3, manager, data_source_key="source")


def test_process_pool_whose_workers_all_die_raises_with_a_hint(tmp_path):
    path = tmp_path / "killer.py"
    path.write_text("import os\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    os._exit(3)  # what an OOM kill or a native crash looks like from the parent\n")
    with RewardManager(FileRewardFn(str(path)), num_workers=2, executor="process") as manager:
        with pytest.raises(RuntimeError, match="reward worker process died"):
            manager.score(ITEMS[:4])
