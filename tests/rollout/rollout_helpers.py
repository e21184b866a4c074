"""The ARPO rollout tests' shared parts: a scripted-engine rollout, its batch as rows, and the invariants every
batch must satisfy (also checked on real vLLM and through the agent loop)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from arpo.batch import DataBatch
from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy, ToyTokenizer
from arpo.protocol import DEFAULT_PROTOCOL, RESULT_CLOSE
from arpo.rollout.arpo_rollout import ARPORollout, ARPORolloutConfig
from tests.rollout.fake_tools import BrokenSearch, FakePython, FakeSearch

CLOSE_TAGS = DEFAULT_PROTOCOL.stop_strings()


def rollout(cfg: dict, policy: ScriptPolicy | None = None, n_prompts: int = 2, seed: int = 0,
            tools=None, split_tags: bool = False, engine: ScriptedEngine | None = None):
    engine = engine or ScriptedEngine(ToyTokenizer(split_tags=split_tags), policy=policy)
    gen = ARPORollout(engine, engine.tokenizer, cfg, tools=tools if tools is not None else [FakeSearch(), FakePython()])
    prompts = [engine.tokenizer.encode(f"Question {i}: what is the number?") for i in range(n_prompts)]
    try:
        batch = gen.generate(prompts, seed=seed)
    finally:
        gen.close()
    return batch, engine, gen


def rows(batch: DataBatch):
    """Per row: unpadded response ids, mask, entropy, tool calls, finish, parent, branch_pos, extras."""
    p_len = batch["prompts"].shape[1]
    out = []
    for i in range(len(batch)):
        length = int(batch["attention_mask"][i, p_len:].sum())
        out.append(dict(
            ids=batch["responses"][i, :length].tolist(), mask=batch["response_mask"][i].tolist(), length=length,
            entropy=batch["token_entropy"][i] if "token_entropy" in batch.non_tensors else None,
            calls=batch["tool_calls"][i], finish=batch["finish_reason"][i], parent=int(batch["parent_index"][i]),
            bpos=int(batch["branch_pos"][i]), group=int(batch["group_index"][i]), kind=batch["rollout_kind"][i],
            h0=batch["initial_entropy"][i], n_calls=batch["num_tool_calls"][i], uid=batch["uid"][i],
        ))
    return out


def window(values: list[float], k: int, reduction: str) -> float:
    vals = values[:k]
    return (sum(vals) / len(vals)) if reduction == "mean" else sum(vals)


def check_invariants(batch: DataBatch, cfg: ARPORolloutConfig, tok, n_prompts: int) -> None:
    rs = rows(batch)
    r_len = batch["responses"].shape[1]
    k, red = cfg.entropy.window, cfg.entropy.reduction
    # every prompt yields exactly M trajectories, all sharing the group's uid
    assert Counter(r["group"] for r in rs) == {g: cfg.n for g in range(n_prompts)}
    for g in range(n_prompts):
        assert len({r["uid"] for r in rs if r["group"] == g}) == 1
        branches = sum(r["kind"] == "branch" for r in rs if r["group"] == g)
        # AEPO's pre-monitoring sets N per group (checked in its own test)
        roots = sum(r["kind"] == "initial" for r in rs if r["group"] == g) if cfg.pre_monitoring else cfg.num_initial
        assert branches <= cfg.n - roots
        if cfg.mode == "single" or cfg.branching.beam_size == 1:
            assert branches == 0
    assert batch.meta["metrics"]["rollout/branches"] == sum(r["kind"] == "branch" for r in rs)
    generated = 0
    for i, r in enumerate(rs):
        ids, L = r["ids"], r["length"]
        assert L <= cfg.sampling.max_response_length
        # masks: 0 exactly on tool-result tokens, the limit EOS, and padding
        expected = [1] * L + [0] * (r_len - L)
        for c in r["calls"]:
            assert 0 < c["start"] < c["end"] <= L
            expected[c["start"]: c["end"]] = [0] * (c["end"] - c["start"])
            text = tok.decode(ids[c["start"]: c["end"]])
            cut = c["end"] == L and r["finish"] == "length"  # result cut by the response length limit
            assert text.startswith(" <result>\n") or (cut and " <result>\n".startswith(text))
            assert text.endswith(f"\n{RESULT_CLOSE}") or cut
        if r["finish"] == "tool_limit" and L and ids[-1] == tok.eos_token_id and (not r["calls"] or r["calls"][-1]["end"] < L):
            expected[L - 1] = 0
        assert r["mask"] == expected, (i, r["finish"])
        assert r["n_calls"] == len(r["calls"]) <= cfg.tools.call_limit
        # model text between results: each call segment holds exactly one close tag, at its end
        bounds = [0] + [x for c in r["calls"] for x in (c["start"], c["end"])] + [L]
        pieces = [tok.decode(ids[a:b]) for a, b in zip(bounds[::2], bounds[1::2])]
        for piece in pieces[:-1]:
            assert sum(piece.count(t) for t in CLOSE_TAGS) == 1 and piece.rstrip().endswith(tuple(CLOSE_TAGS))
        last = pieces[-1].removesuffix(tok.eos_token) if r["finish"] == "tool_limit" else pieces[-1]
        n_last = sum(last.count(t) for t in CLOSE_TAGS)
        if r["finish"] == "tool_limit":
            assert n_last == 1 and last.rstrip().endswith(tuple(CLOSE_TAGS))
        elif r["finish"] == "length":
            assert n_last <= 1
        else:
            assert n_last == 0
        # the tree: a branch equals its parent token for token (and mask for mask) up to the branch point
        if r["parent"] >= 0:
            p = rs[r["parent"]]
            assert r["parent"] < i and p["group"] == r["group"] and r["bpos"] <= p["length"]
            assert ids[: r["bpos"]] == p["ids"][: r["bpos"]] and r["mask"][: r["bpos"]] == p["mask"][: r["bpos"]]
            assert r["h0"] == p["h0"] or (math.isnan(r["h0"]) and math.isnan(p["h0"]))
            if r["kind"] == "branch":
                assert r["bpos"] in {c["end"] for c in p["calls"]}  # forks happen right after a tool result
                assert p["kind"] != "fill"  # fill trajectories never branch
            else:
                assert r["kind"] == "duplicate" and ids == p["ids"] and r["bpos"] == p["length"]
        else:
            assert r["kind"] in ("initial", "fill") and r["bpos"] == 0
        if r["kind"] != "duplicate":
            generated += sum(r["mask"][r["bpos"]: L])
        # per-token entropy: NaN exactly on non-model tokens; initial entropy hand-checked
        if r["entropy"] is not None and cfg.mode == "arpo":
            ent = r["entropy"]
            assert len(ent) == L
            assert [not math.isnan(e) for e in ent] == [m == 1 for m in r["mask"][:L]]
            if r["kind"] in ("initial", "fill") and cfg.entropy.initial_scope == "trajectory":
                first = ent[: (r["calls"][0]["start"] if r["calls"] else L)]
                first = [e for e in first if not math.isnan(e)]
                assert r["h0"] == pytest.approx(window(first, k, red), abs=1e-9)
            for c_i, c in enumerate(r["calls"]):
                if c["end"] <= r["bpos"]:
                    continue  # inherited record
                seg_start = r["calls"][c_i - 1]["end"] if c_i else 0
                before = [e for e in ent[seg_start: c["start"]] if not math.isnan(e)]
                assert c["entropy_before"] == pytest.approx(window(before, k, red), abs=1e-9)
                if c["delta_entropy"] is not None:
                    h_now = c["entropy_before"] if cfg.branching.timing == "code" else c["entropy_after"]
                    assert c["delta_entropy"] == pytest.approx(h_now - r["h0"], abs=1e-9)
    # no generated token is thrown away (paper timing keeps its probe tokens as the continuation), except
    # those of dropped speculative fills
    m = batch.meta["metrics"]
    assert m["rollout/tokens/generated"] == generated + m["rollout/tokens/discarded"] + m.get("rollout/tokens/monitor", 0)
    assert ("rollout/tokens/monitor" in m) == cfg.pre_monitoring
    if cfg.schedule.speculative_fill == 0 and cfg.schedule.fill_probability is None:
        assert m["rollout/fill_discarded"] == 0
        if m["rollout/branches_dropped"] == 0:
            assert m["rollout/tokens/discarded"] == 0
    if not cfg.schedule.speculative_forks or cfg.schedule.branch_grant == "first_come":
        assert m["rollout/branches_speculative"] == 0 == m["rollout/branches_dropped"]
    assert m["rollout/branches_dropped"] <= m["rollout/branches_speculative"]
    if cfg.schedule.fill_probability is None:
        assert m["rollout/fill_predicted"] == 0
    # what describes the batch counts its rows only, not the dropped speculative fills
    assert m["rollout/trajectories"] == len(rs)
    # executed calls exclude a fork's inherited ones; the calls its trajectory holds include them
    assert m["rollout/tool_calls/total"] == sum(1 for r in rs for c in r["calls"] if c["end"] > r["bpos"])
    assert m["rollout/tool_calls/in_trajectory_mean"] == pytest.approx(sum(len(r["calls"]) for r in rs) / len(rs))
    assert m["rollout/tokens/response_model_total"] == sum(sum(r["mask"]) for r in rs)


def random_case(seed: int):
    r = random.Random(seed)
    n = r.choice([1, 2, 3, 4, 6, 8])
    cfg = {"mode": r.choice(["arpo"] * 5 + ["single"]), "n": n, "initial_rollouts": r.randint(1, n),
           "branching.beam_size": r.choice([1, 2, 2, 3]), "branching.branch_probability": r.random(),
           "branching.entropy_weight": r.choice([0.0, 0.2, 1.0]), "branching.rule": r.choice(["code", "paper"]),
           "branching.timing": r.choice(["code", "paper"]), "branching.paper_alpha": r.choice([0.3, 0.5]),
           "branching.paper_beta": r.choice([0.2, 1.0]), "branching.paper_tau": 0.5,
           "entropy.window": r.choice([1, 5, 20]), "entropy.topk_logprobs": r.choice([1, 5, 10]),
           "entropy.reduction": r.choice(["mean", "sum"]),
           "entropy.initial_scope": r.choice(["trajectory", "group"]), "tools.call_limit": r.choice([0, 1, 3, 6]),
           "sampling.max_response_length": r.choice([30, 120, 400]),
           "schedule.fill": r.choice(["fresh", "released", "duplicate"]), "return_entropy": r.random() < 0.7,
           "tools.retries": r.choice([0, 1]), "schedule.mode": r.choice(["async", "rounds"]),
           "schedule.branch_grant": r.choice(["ordered", "first_come"])}
    if cfg["schedule.fill"] == "fresh":
        cfg["schedule.speculative_fill"] = r.choice([0, 0, 1, 4])
    policy = ScriptPolicy(call_prob=r.uniform(0.3, 1.0), call_decay=r.choice([0.0, 0.1]),
                          ramble_prob=r.choice([0.0, 0.0, 0.1]), malformed_prob=r.choice([0.0, 0.1]))
    tools = [BrokenSearch(), FakePython()] if r.random() < 0.2 else [FakeSearch(), FakePython()]
    case = cfg, policy, tools, r.random() < 0.3, r.randint(1, 3)
    if cfg["schedule.fill"] == "fresh":  # drawn last, so the cases drawn before it stay as they were
        cfg["schedule.fill_probability"] = r.choice([None, None, 0.05, 0.5, 0.95])
    if r.random() < 0.3:  # drawn after everything else, for the same reason
        cfg.update({"policy": "aepo", "aepo.penalty": r.choice([0.05, 0.5, 1.0])})
        if r.random() < 0.5:
            cfg.update({"aepo.pre_monitoring": True, "aepo.beta": r.choice([0.5, 5.0])})
    return case


def snapshot(batch: DataBatch):
    keys = [k for k in batch.non_tensors]
    return ({k: v.tolist() for k, v in batch.tensors.items()},
            {k: [repr(x) for x in batch.non_tensors[k]] for k in keys})


BASE = {"n": 8, "initial_rollouts": 4, "sampling.max_response_length": 300, "return_entropy": True,
        "entropy.window": 8}


CALLER = ScriptPolicy(call_prob=0.9, call_decay=0.0)
