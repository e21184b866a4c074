"""DAPO's dynamic sampling: group filtering, batches of several generation rounds joined and cut without breaking
a tree, the collector's stopping rule, and the config checks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from arpo.batch import Trajectory, collate_trajectories, concat_padded, select_rows
from arpo.trainer.algo_config import validate_algorithm_config
from arpo.trainer.dynamic_sampling import FilterGroupsConfig, GroupCollector, informative_rows
from arpo.trainer.hard_advantage import compute_hard_advantage

PAD = 0


def random_round(seed: int, groups: int, n: int = 4) -> tuple[object, list[Trajectory]]:
    """A collated round of ``groups`` prompt groups of ``n`` trajectories each: random prompt and response
    lengths (so rounds pad differently), branches that copy a prefix of an earlier row of their group, tool-result
    tokens, and per-row accuracies."""
    rng = random.Random(seed)
    trajectories: list[Trajectory] = []
    for g in range(groups):
        prompt = [rng.randint(1, 99) for _ in range(rng.randint(2, 9))]
        first = len(trajectories)
        for k in range(n):
            t = Trajectory(group=g, prompt_ids=prompt)
            if k and rng.random() < 0.6:
                parent = rng.randrange(first, len(trajectories))
                p = trajectories[parent]
                t.parent, t.branch_pos = parent, rng.randint(0, len(p.response_ids))
                t.response_ids, t.response_mask = p.response_ids[: t.branch_pos], p.response_mask[: t.branch_pos]
                t.response_ids, t.response_mask = list(t.response_ids), list(t.response_mask)
            for _ in range(rng.randint(1, 12)):
                t.append([rng.randint(1, 99)], model_generated=rng.random() < 0.8)
            trajectories.append(t)
    batch = collate_trajectories(trajectories, PAD, [f"s{seed}-g{g}" for g in range(groups)],
                                 {"data_source": ["synthetic/x"] * groups})
    acc = [float(rng.random() < 0.5) for _ in trajectories]
    batch.non_tensors["reward_acc"] = np.asarray(acc, dtype=object)
    batch.non_tensors["reward_score"] = np.asarray(acc, dtype=object)
    scores = torch.zeros(batch.tensors["responses"].shape)
    scores[:, 0] = torch.tensor(acc)
    batch.tensors["token_level_scores"] = scores
    return batch, trajectories


def row_tokens(batch, i: int) -> tuple[list[int], list[int], list[int]]:
    attn = batch.tensors["attention_mask"][i].bool()
    p_len = batch.tensors["prompts"].shape[1]
    prompt = batch.tensors["input_ids"][i][:p_len][attn[:p_len]].tolist()
    r = int(attn[p_len:].sum())
    return prompt, batch.tensors["responses"][i][:r].tolist(), batch.tensors["response_mask"][i][:r].tolist()


def test_groups_with_equal_metric_are_dropped_and_singletons_kept():
    batch, _ = random_round(0, groups=3)
    acc = np.asarray([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0], dtype=float)
    batch.non_tensors["reward_acc"] = acc.astype(object)
    batch.tensors["token_level_scores"][:, 0] = torch.tensor(acc)
    rows, kept, dropped = informative_rows(batch, "acc")
    assert rows.tolist() == [4, 5, 6, 7] and (kept, dropped) == (1, 2)
    single = select_rows(batch, [r for r in range(12) if batch.non_tensors["parent_index"][r] == -1][:1])
    assert informative_rows(single, "acc")[1:] == (1, 0)  # a group of one row has no std: verl keeps it
    # seq_reward reads the token-level scores: a shaped reward can make an all-correct group informative
    batch.tensors["token_level_scores"][0, 1] = -0.5
    assert informative_rows(batch, "seq_reward")[1] == 2


@pytest.mark.parametrize("seed", range(6))
def test_joined_rounds_keep_every_row_tree_and_hard_advantage(seed):
    rounds = [random_round(seed * 10 + k, groups=3) for k in range(3)]
    joined = concat_padded([b for b, _ in rounds], PAD)
    assert len(joined) == sum(len(b) for b, _ in rounds)
    i = 0
    for b, trajectories in rounds:
        for r, t in enumerate(trajectories):
            assert row_tokens(joined, i) == (t.prompt_ids, t.response_ids, t.response_mask)
            assert row_tokens(joined, i) == row_tokens(b, r)
            i += 1
    attn = joined.tensors["attention_mask"]
    assert torch.equal(joined.tensors["position_ids"], torch.clamp(attn.cumsum(1) - 1, min=0))
    assert torch.equal(joined.tensors["input_ids"][:, : joined.tensors["prompts"].shape[1]], joined.tensors["prompts"])
    # every group keeps its own number and its parents: hard advantage over the join = per round, concatenated
    assert len(set(joined.non_tensors["group_index"])) == 9
    scores = torch.randn(len(joined))
    adv = compute_hard_advantage(scores, joined.tensors["response_mask"], np.asarray(joined.non_tensors["uid"]),
                                 joined.non_tensors["parent_index"], joined.non_tensors["branch_pos"])
    start = 0
    for b, _ in rounds:
        part = compute_hard_advantage(scores[start: start + len(b)], b.tensors["response_mask"],
                                      np.asarray(b.non_tensors["uid"]), b.non_tensors["parent_index"],
                                      b.non_tensors["branch_pos"])
        width = part.shape[1]
        assert torch.allclose(adv[start: start + len(b), :width], part, atol=1e-6)
        assert not adv[start: start + len(b), width:].any()
        start += len(b)


def test_selecting_groups_renumbers_parents_and_refuses_orphans():
    batch, trajectories = random_round(3, groups=3)
    uids = np.asarray(batch.non_tensors["uid"])
    rows = np.flatnonzero(uids != uids[0])  # drop the first group
    sub = select_rows(batch, rows)
    for new, old in enumerate(rows):
        parent = sub.non_tensors["parent_index"][new]
        old_parent = batch.non_tensors["parent_index"][old]
        assert (parent == -1) == (old_parent == -1)
        if parent >= 0:
            assert rows[parent] == old_parent
    child = next(r for r in range(len(batch)) if batch.non_tensors["parent_index"][r] >= 0)
    with pytest.raises(ValueError, match="whole groups"):
        select_rows(batch, [child])


def test_collector_stops_at_the_target_or_the_cap_and_cuts_to_whole_groups():
    cfg = FilterGroupsConfig(enable=True, metric="acc", max_num_gen_batches=3)
    collector = GroupCollector(cfg, target=4, pad_token_id=PAD)
    seed = 0
    while not collector.done:
        batch, _ = random_round(seed, groups=3)
        collector.add(batch)
        seed += 1
    out = collector.batch()
    kept_uids = list(dict.fromkeys(out.non_tensors["uid"]))
    assert len(kept_uids) == min(collector.kept, 4) and collector.kept + collector.dropped == 3 * collector.rounds
    assert all(informative_rows(select_rows(out, np.flatnonzero(out.non_tensors["uid"] == u)), "acc")[1] == 1
               for u in kept_uids)
    m = collector.metrics()
    assert m["train/num_gen_batches"] == collector.rounds and m["train/num_groups_kept"] == len(kept_uids)

    never = GroupCollector(cfg, target=4, pad_token_id=PAD)
    while not never.done:
        batch, _ = random_round(1, groups=2)
        batch.non_tensors["reward_acc"] = np.ones(len(batch), dtype=object)
        never.add(batch)
    assert never.rounds == 3 and never.batch() is None and never.metrics()["train/num_groups_dropped"] == 6


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm": {"filter_groups": {"enable": True, "metric": "f1"}}}, "algorithm.filter_groups.metric"),
    ({"algorithm": {"filter_groups": {"enable": True, "max_num_gen_batches": -1}}}, "max_num_gen_batches"),
    ({"algorithm": {"filter_groups": {"enable": True, "metrc": "acc"}}}, "algorithm.filter_groups.metrc"),
    ({"data": {"gen_batch_size": 12}}, "algorithm.filter_groups.enable=true"),
    ({"data": {"gen_batch_size": 0}, "algorithm": {"filter_groups": {"enable": True}}}, "data.gen_batch_size"),
    ({"algorithm": {"use_kl_in_reward": True, "filter_groups": {"enable": True, "metric": "seq_final_reward"}}},
     "seq_reward"),
])
def test_bad_dynamic_sampling_config_names_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_algorithm_config(overrides)
