"""The ARPO generator on the scripted engine, one behaviour at a time: branching rules and timings, fill modes,
AEPO and Tree-GRPO, tool failures, the call limit, fill prediction, entropy windows and stop strings."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import numpy as np
import pytest
import torch

from arpo.batch import DataBatch
from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy, ToyTokenizer
from arpo.protocol import RESULT_CLOSE, format_tool_result
from arpo.rollout.arpo_rollout import ARPORollout, ARPORolloutConfig
from tests.rollout.fake_tools import BrokenSearch, FakePython, FakeSearch
from tests.rollout.rollout_helpers import BASE, CALLER, check_invariants, rollout, rows, snapshot, window


def own_records(rs):
    for i, r in enumerate(rs):
        for c in r["calls"]:
            if c["end"] > r["bpos"]:
                yield i, r, c


# budget large enough never to bind: 2 roots, beam 3, at most 2 calls each -> at most 2 * 3**2 = 18 < 20
UNBOUND = {"n": 20, "initial_rollouts": 2, "branching.beam_size": 3, "tools.call_limit": 2,
           "sampling.max_response_length": 1000, "return_entropy": True, "entropy.window": 6,
           "schedule.fill": "fresh"}
def forks_at(rs, i, pos):
    return sum(1 for r in rs if r["parent"] == i and r["bpos"] == pos and r["kind"] == "branch")


@pytest.mark.parametrize("timing", ["code", "paper"])
def test_paper_rule_forks_iff_alpha_plus_beta_dh_exceeds_tau(timing):
    cfg = {**UNBOUND, "branching.rule": "paper", "branching.timing": timing, "branching.paper_alpha": 0.0,
           "branching.paper_beta": 1.0, "branching.paper_tau": 0.0}
    seen = Counter()
    for seed in range(4):
        batch, engine, gen = rollout(cfg, CALLER, seed=seed)
        check_invariants(batch, gen.config, engine.tokenizer, 2)
        rs = rows(batch)
        for i, r, c in own_records(rs):
            dh = c["delta_entropy"]
            expected = 2 if dh is not None and dh > 0 else 0
            assert forks_at(rs, i, c["end"]) == expected
            seen[expected] += 1
    assert seen[2] > 0 and seen[0] > 0  # both outcomes occurred


@pytest.mark.parametrize("timing", ["code", "paper"])
def test_code_rule_extremes_and_direction(timing):
    always = {**UNBOUND, "branching.rule": "code", "branching.timing": timing, "branching.branch_probability": 1.0}
    batch, engine, gen = rollout(always, CALLER, seed=3)
    rs = rows(batch)
    recs = list(own_records(rs))
    assert recs and all(forks_at(rs, i, c["end"]) == 2 for i, r, c in recs if c["delta_entropy"] is not None)

    never = {**UNBOUND, "branching.rule": "code", "branching.timing": timing, "branching.branch_probability": 0.0,
             "branching.entropy_weight": 0.0, "n": 6}
    batch, engine, gen = rollout(never, CALLER, seed=3)
    assert batch.meta["metrics"]["rollout/branches"] == 0
    assert batch.meta["metrics"]["rollout/fill_fresh"] == 2 * 4
    check_invariants(batch, gen.config, engine.tokenizer, 2)

    # branch_probability 0 and a large weight: forks only where entropy rose (dH > 0)
    rising = {**UNBOUND, "branching.rule": "code", "branching.timing": timing, "branching.branch_probability": 0.0,
              "branching.entropy_weight": 50.0}
    made = 0
    for seed in range(3):
        batch, _, _ = rollout(rising, CALLER, seed=seed)
        rs = rows(batch)
        for i, r, c in own_records(rs):
            f = forks_at(rs, i, c["end"])
            made += f
            if c["delta_entropy"] is None or c["delta_entropy"] <= 0:
                assert f == 0
    assert made > 0


def test_timings_measure_different_windows():
    cfg = {**UNBOUND, "branching.branch_probability": 1.0}
    code, _, _ = rollout({**cfg, "branching.timing": "code"}, CALLER, seed=1)
    paper, engine, _ = rollout({**cfg, "branching.timing": "paper"}, CALLER, seed=1)
    # the scripted model is uncertain right after a result, as the ARPO paper measured on real models
    m_code, m_paper = code.meta["metrics"], paper.meta["metrics"]
    assert m_paper["rollout/entropy/delta_mean"] > m_code["rollout/entropy/delta_mean"]
    # paper timing sends a probe of exactly k tokens after each result, then continues the same segment
    probes = [r for r in engine.requests if r.sampling_params.max_tokens == cfg["entropy.window"]]
    assert probes and all(r.output_len <= cfg["entropy.window"] for r in probes)


def test_fill_modes():
    cfg = {"n": 6, "initial_rollouts": 2, "branching.beam_size": 2, "branching.branch_probability": 0.0,
           "branching.entropy_weight": 0.0, "sampling.max_response_length": 200}
    fresh, engine, gen = rollout({**cfg, "schedule.fill": "fresh"}, seed=4)
    rs = rows(fresh)
    assert Counter(r["kind"] for r in rs) == {"initial": 4, "fill": 8}
    assert all(r["parent"] == -1 for r in rs)
    assert len({tuple(r["ids"]) for r in rs}) > 6  # fresh samples, not copies
    dup, engine, gen = rollout({**cfg, "schedule.fill": "duplicate"}, seed=4)
    rs = rows(dup)
    assert Counter(r["kind"] for r in rs) == {"initial": 4, "duplicate": 8}
    for r in rs:
        if r["kind"] == "duplicate":
            assert rs[r["parent"]]["kind"] == "initial" and r["ids"] == rs[r["parent"]]["ids"]
            assert r["finish"] == rs[r["parent"]]["finish"]
    assert dup.meta["metrics"]["rollout/fill_duplicate"] == 8
    check_invariants(dup, gen.config, engine.tokenizer, 2)


@pytest.mark.parametrize("branch_probability", [0.0, 1.0])
def test_released_fill_adds_one_root_at_a_time_that_may_branch(branch_probability):
    # the released code's loop: a group with nothing left running gets one more root per round until it has M
    calls = branch_probability > 0
    policy = ScriptPolicy(call_prob=1.0 if calls else 0.0, call_decay=0.0)
    cfg = {"n": 8, "initial_rollouts": 2, "branching.beam_size": 2,
           "branching.branch_probability": branch_probability, "branching.entropy_weight": 0.0,
           "sampling.max_response_length": 300, "schedule.fill": "released", "schedule.mode": "rounds",
           "tools.call_limit": 1}
    batch, engine, gen = rollout(cfg, policy, seed=4)
    rs = rows(batch)
    check_invariants(batch, gen.config, engine.tokenizer, 2)
    assert {r["kind"] for r in rs} <= {"initial", "branch"}
    if not calls:  # every root is one request, and each late one waits for the one before
        assert Counter(r["kind"] for r in rs) == {"initial": 16}
        assert batch.meta["metrics"]["rollout/rounds"] == 1 + (8 - 2)
        fresh, _, _ = rollout({**cfg, "schedule.fill": "fresh"}, policy, seed=4)
        assert fresh.meta["metrics"]["rollout/rounds"] == 1  # fresh fills start with the roots: no draw can fork
    else:  # one call each: a root forks once, so the first roots make 4 and late roots fork like them
        for g in range(2):
            late = [i for i, r in enumerate(rs) if r["group"] == g and r["kind"] == "initial"][2:]
            assert late and all(any(r["parent"] == i for r in rs) for i in late[:-1])


@pytest.mark.parametrize("policy", ["arpo", "aepo"])
def test_aepo_damps_forks_at_consecutive_depths_of_a_path(policy):
    # every candidate wants a fork unless damped (p ~ 0, w 0); AEPO with penalty 1 silences the decision right
    # after a fork on the same path (f = 0), so a path forks at depths 1 and 3, never 2; ARPO forks at all
    policy_ = ScriptPolicy(call_prob=1.0, call_decay=0.0, tools=("search",))
    cfg = {"n": 40, "initial_rollouts": 2, "branching.beam_size": 2,
           "branching.branch_probability": 1e-9 if policy == "aepo" else 1.0, "branching.entropy_weight": 0.0,
           "tools.call_limit": 3, "sampling.max_response_length": 600, "policy": policy, "aepo.penalty": 1.0,
           "schedule.fill_probability": None}
    batch, engine, gen = rollout(cfg, policy_, n_prompts=1, seed=3)
    check_invariants(batch, gen.config, engine.tokenizer, 1)
    rs = rows(batch)
    depths = {sum(c["end"] <= r["bpos"] for c in r["calls"]) for r in rs if r["kind"] == "branch"}
    assert depths == ({1, 3} if policy == "aepo" else {1, 2, 3})
    damped = batch.meta["metrics"]["rollout/branch_points_damped"]
    assert (damped > 0) == (policy == "aepo")


@pytest.mark.parametrize("call_prob, beta", [(0.0, 0.5), (1.0, 50.0), (1.0, 0.5)])
def test_aepo_pre_monitoring_sets_each_groups_roots_from_its_probe(call_prob, beta):
    # The probe runs first and alone, is no row; N = clamp(int(M·σ(β·(H_root − H̄_tool))) + 1, 1, M). Without
    # tool calls H̄_tool = H_root: N = M/2 + 1. The scripted policy's tokens after a tool result are flat (high
    # entropy), so a steep β leaves one root and the rest of the budget to branching.
    cfg = {"n": 8, "initial_rollouts": 4, "policy": "aepo", "aepo.pre_monitoring": True, "aepo.beta": beta,
           "sampling.max_response_length": 400, "tools.call_limit": 3, "return_entropy": True}
    policy = ScriptPolicy(call_prob=call_prob, call_decay=0.0)
    batch, engine, gen = rollout(cfg, policy, n_prompts=1, seed=5)
    check_invariants(batch, gen.config, engine.tokenizer, 1)
    m, rs = batch.meta["metrics"], rows(batch)
    roots = sum(r["kind"] == "initial" for r in rs)
    h_root, h_tool = m["rollout/aepo/h_root_mean"], m["rollout/aepo/h_tool_mean"]
    assert roots == m["rollout/aepo/initial_rollouts_mean"] == \
        max(1, min(8, int(8 / (1 + math.exp(-beta * (h_root - h_tool)))) + 1))
    if call_prob == 0.0:
        assert h_tool == h_root and roots == 5
    else:
        assert h_tool > h_root and (roots == 1 if beta == 50.0 else roots < 5)
    # the probe (t0) is the group's first request and finishes before any root starts
    probe = [i for i, q in enumerate(engine.requests) if "-t0-" in q.request_id]
    assert probe[0] == 0 and all(i == j for i, j in zip(probe, range(len(probe))))
    assert m["rollout/tokens/monitor"] == sum(len(engine.requests[i].output_ids) for i in probe) > 0
    # the same roots and draws as without the probe, only N differs: the first root's tokens are the same
    plain, _, _ = rollout({**cfg, "aepo.pre_monitoring": False, "initial_rollouts": roots}, policy, n_prompts=1, seed=5)
    assert rows(plain)[0]["ids"] == rs[0]["ids"]
    with pytest.raises(ValueError, match="aepo.pre_monitoring=True: true only with"):
        ARPORolloutConfig.from_dict({**cfg, "policy": "arpo"})


def test_tree_grpo_grows_equal_trees_from_nodes_at_tool_results():
    # n 12 from 2 trees: each tree is expanded 2 nodes at a time until it holds 6 chains; no entropy decisions
    cfg = {"n": 12, "initial_rollouts": 2, "policy": "tree_grpo", "tree_grpo.expansions": 2, "tools.call_limit": 3,
           "sampling.max_response_length": 400, "return_entropy": True}
    batches = {s: rollout({**cfg, "schedule.mode": s}, ScriptPolicy(call_prob=0.8), n_prompts=2, seed=1)
               for s in ("async", "rounds")}
    batch, engine, gen = batches["async"]
    check_invariants(batch, gen.config, engine.tokenizer, 2)
    rs, trees = rows(batch), list(batch["tree_index"])
    assert Counter((r["group"], t) for r, t in zip(rs, trees)) == {(g, t): 6 for g in range(2) for t in range(2)}
    for r, t in zip(rs, trees):
        if r["parent"] >= 0:  # a node's continuation stays in its tree and starts right after a tool result
            assert trees[r["parent"]] == t and r["bpos"] in {c["end"] for c in rs[r["parent"]]["calls"]}
    assert {r["kind"] for r in rs} == {"initial", "branch"}  # picked roots are more chains; picked nodes forks
    assert batch.meta["metrics"]["rollout/branch_points"] == 0
    # the picks depend on the trees, not on completion order
    assert [(r["ids"], r["parent"], r["bpos"]) for r in rows(batches["rounds"][0])] == \
        [(r["ids"], r["parent"], r["bpos"]) for r in rs]
    with pytest.raises(ValueError, match="n=7: policy tree_grpo grows initial_rollouts \\(2\\) trees.*use a multiple"):
        ARPORolloutConfig.from_dict({**cfg, "n": 7})


def test_tool_failure_becomes_text():
    policy = ScriptPolicy(call_prob=1.0, call_decay=0.0, tools=("search",))
    batch, engine, gen = rollout({**BASE, "tools.call_limit": 1, "tools.retries": 1}, policy,
                                 tools=[BrokenSearch()])
    tok = engine.tokenizer
    expected = format_tool_result("Error: tool 'search' failed: ConnectionError: search server unreachable")
    for r in rows(batch):
        (c,) = r["calls"]
        assert c["error"] and tok.decode(r["ids"][c["start"]: c["end"]]) == expected
    assert batch.meta["metrics"]["rollout/tool_calls/errors"] > 0


def test_malformed_call_gets_an_error_result():
    policy = ScriptPolicy(call_prob=1.0, call_decay=0.0, tools=("python",), malformed_prob=1.0)
    batch, engine, gen = rollout({**BASE, "tools.call_limit": 2}, policy)
    r = rows(batch)[0]
    text = engine.tokenizer.decode(r["ids"][r["calls"][0]["start"]: r["calls"][0]["end"]])
    assert "malformed tool call: </python> without a matching <python>" in text
    assert batch.meta["metrics"]["rollout/tool_calls/malformed"] > 0


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_call_limit_appends_eos(limit):
    policy = ScriptPolicy(call_prob=1.0, call_decay=0.0)
    batch, engine, gen = rollout({**BASE, "tools.call_limit": limit, "sampling.max_response_length": 2000}, policy)
    tok = engine.tokenizer
    for r in rows(batch):
        assert r["finish"] == "tool_limit" and len(r["calls"]) == limit
        assert r["ids"][-1] == tok.eos_token_id and r["mask"][r["length"] - 1] == 0
        assert tok.decode(r["ids"][:-1]).rstrip().endswith(("</search>", "</python>"))
    assert batch.meta["metrics"]["rollout/tool_calls/hit_limit"] > 0
    assert batch.meta["metrics"]["rollout/tool_calls/total"] == sum(1 for _ in own_records(rows(batch)))
    check_invariants(batch, gen.config, tok, 2)


def test_max_response_length():
    policy = ScriptPolicy(ramble_prob=1.0)
    batch, engine, gen = rollout({**BASE, "sampling.max_response_length": 50}, policy)
    assert batch["responses"].shape[1] == 50
    assert all(r["finish"] == "length" and r["length"] == 50 for r in rows(batch))


def test_single_mode_is_plain_sampling():
    batch, engine, gen = rollout({"mode": "single", "n": 5, "initial_rollouts": 1, "sampling.max_response_length": 300})
    rs = rows(batch)
    assert len(rs) == 10 and all(r["parent"] == -1 and r["kind"] == "initial" for r in rs)
    assert all(r.sampling_params.logprobs is None for r in engine.requests)
    assert engine.max_in_flight == 10
    check_invariants(batch, gen.config, engine.tokenizer, 2)


def test_collated_layout_and_generate_sequences():
    engine = ScriptedEngine()
    tok = engine.tokenizer
    gen = ARPORollout(engine, tok, BASE, tools=[FakeSearch(), FakePython()])
    prompts = [tok.encode("Q one?"), tok.encode("A longer second question?")]
    col = np.empty(2, dtype=object)
    col[:] = prompts
    src = np.array(["nq", "math"], dtype=object)
    batch = gen.generate_sequences(DataBatch(non_tensors={"raw_prompt_ids": col, "data_source": src},
                                             meta={"seed": 9}))
    assert len(batch) == 16 and list(batch["data_source"][:8]) == ["nq"] * 8
    p_len = batch["prompts"].shape[1]
    for i in range(16):
        prompt = prompts[int(batch["group_index"][i])]
        assert batch["prompts"][i, p_len - len(prompt):].tolist() == prompt  # left padded
        assert batch["attention_mask"][i, : p_len - len(prompt)].sum() == 0
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], 1))
    same = gen.generate(prompts, seed=9)
    assert torch.equal(same["responses"], batch["responses"])
    greedy = gen.generate_sequences(DataBatch(non_tensors={"raw_prompt_ids": col},
                                              meta={"rollout_overrides": {"mode": "single", "n": 1,
                                                                          "sampling.temperature": 0.0}}))
    assert len(greedy) == 2
    gen.close()


def test_config_validation_messages():
    with pytest.raises(ValueError, match=r"arpo.initial_rollouts=9: the initial rollouts N cannot exceed the budget M "
                                         r"\(actor_rollout_ref.rollout.arpo.n=8\)"):
        ARPORolloutConfig(n=8, initial_rollouts=9).validate()
    with pytest.raises(ValueError, match="unknown key.*'beams'"):
        ARPORolloutConfig.from_dict({"beams": 2})
    with pytest.raises(ValueError, match="arpo.branching.rule='x'"):
        ARPORolloutConfig.from_dict({"branching.rule": "x"})
    with pytest.raises(ValueError, match="arpo.entropy.window=0"):
        ARPORolloutConfig.from_dict({"entropy.window": 0})
    with pytest.raises(ValueError, match="arpo.schedule.fill='copy'"):
        ARPORolloutConfig.from_dict({"schedule.fill": "copy"})
    assert ARPORolloutConfig.from_dict({"mode": "single", "n": 4, "initial_rollouts": 8}).num_initial == 4


class FixedScriptEngine(ScriptedEngine):
    """Writes ``texts[number of results in context]``, continuing a segment that a request left unfinished."""

    def __init__(self, texts: list[str]):
        super().__init__(ToyTokenizer(split_tags=True))
        self.texts = texts

    def _plan(self, context, rng):
        n = context.count(RESULT_CLOSE)
        # what this segment already holds: after the last result, or after the prompt (which ends with "?")
        emitted = context[context.rfind(RESULT_CLOSE) + len(RESULT_CLOSE):] if n else context.split("?", 1)[1]
        text = self.texts[min(n, len(self.texts) - 1)]
        assert text.startswith(emitted)
        ids = self.tokenizer.encode(text)[len(self.tokenizer.encode(emitted)):]
        return ids + ([self.tokenizer.eos_token_id] if "<answer>" in text else [])


def test_paper_probe_boundary_inside_a_multi_token_stop_string():
    # after a close tag the model would write on; the engine cannot see a stop string split over two requests
    texts = ["<python>print(1 + 2)</python> then", "<python>print(3 + 4)</python> then we",
             "<answer> \\boxed{7} </answer>"]
    engine = FixedScriptEngine(texts)
    tok = engine.tokenizer
    k = len(tok.encode("<python>print(3 + 4)")) + 1  # the probe ends after "</", inside "</python>"
    cfg = {**BASE, "n": 2, "initial_rollouts": 1, "branching.timing": "paper", "branching.branch_probability": 1.0,
           "entropy.window": k, "sampling.max_response_length": 200}
    batch, _, gen = rollout(cfg, engine=engine, n_prompts=1)
    check_invariants(batch, gen.config, tok, 1)
    r = rows(batch)[0]
    assert [c["tool"] for c in r["calls"]] == ["python", "python"]
    assert tok.decode(r["ids"][r["calls"][0]["start"]: r["calls"][0]["end"]]) == format_tool_result("3")
    assert tok.decode(r["ids"][r["calls"][1]["start"]: r["calls"][1]["end"]]) == format_tool_result("7")
    assert r["finish"] == "stop" and tok.decode(r["ids"]).endswith("</answer><eos>")
    # the probe stopped inside the tag, the continuation was cut right after it
    probe = next(q for q in engine.requests if q.sampling_params.max_tokens == k)
    assert probe.output_len == k and probe.finish_reason == "length"


@pytest.mark.parametrize("schedule", ["rounds", "async"])
def test_speculative_fill_confirms_or_drops_without_changing_decisions(schedule):
    base = {"n": 8, "initial_rollouts": 2, "branching.beam_size": 2, "sampling.max_response_length": 300,
            "tools.call_limit": 2, "return_entropy": True, "schedule.mode": schedule}
    # no branching: every speculative fill is needed and kept; without speculation the look-ahead over the
    # decisions' draws sees that no decision can fork, so the fills start with the initial rollouts anyway
    never = {**base, "branching.branch_probability": 0.0, "branching.entropy_weight": 0.0}
    plain, plain_engine, _ = rollout(never, seed=2)
    spec, engine, gen = rollout({**never, "schedule.speculative_fill": 6}, seed=2)
    check_invariants(spec, gen.config, engine.tokenizer, 2)
    ms = spec.meta["metrics"]
    assert ms["rollout/fill_fresh"] == 12 and ms["rollout/fill_discarded"] == 0
    assert engine.max_in_flight == plain_engine.max_in_flight == 2 * 8  # fills ran alongside the initial ones
    assert snapshot(spec) == snapshot(plain)
    # always branch: branching takes the slots, speculative fills are dropped; decisions are unchanged
    always = {**base, "branching.branch_probability": 1.0}
    plain, _, _ = rollout(always, seed=2)
    spec, engine, gen = rollout({**always, "schedule.speculative_fill": 6}, seed=2)
    check_invariants(spec, gen.config, engine.tokenizer, 2)
    ms, mp = spec.meta["metrics"], plain.meta["metrics"]
    assert ms["rollout/fill_discarded"] > 0 and ms["rollout/tokens/discarded"] > 0
    assert ms["rollout/branches"] == mp["rollout/branches"]
    kept = lambda b: sorted(tuple(r["ids"]) for r in rows(b) if r["kind"] != "fill")  # noqa: E731
    assert kept(spec) == kept(plain)
    again, _, _ = rollout({**always, "schedule.speculative_fill": 6}, seed=2)
    assert snapshot(again) == snapshot(spec)
    with pytest.raises(ValueError, match="schedule.speculative_fill=2: needs schedule.fill=fresh"):
        ARPORolloutConfig.from_dict({"schedule.speculative_fill": 2, "schedule.fill": "duplicate"}).validate()


@pytest.mark.parametrize("schedule", ["rounds", "async"])
def test_fill_prediction_changes_when_fills_start_not_the_batch(schedule):
    cfg = {**BASE, "schedule.mode": schedule, "tools.call_limit": 2}
    plain, _, _ = rollout({**cfg, "schedule.fill_probability": None}, seed=3, n_prompts=3)
    assert plain.meta["metrics"]["rollout/fill_predicted"] == 0
    predicted = {}
    for p in (0.01, 0.5, 1.0):
        batch, engine, gen = rollout({**cfg, "schedule.fill_probability": p}, seed=3, n_prompts=3)
        check_invariants(batch, gen.config, engine.tokenizer, 3)
        assert snapshot(batch) == snapshot(plain)
        predicted[p] = batch.meta["metrics"]["rollout/fill_predicted"]
    assert predicted[0.01] > predicted[1.0] and plain.meta["metrics"]["rollout/fill_fresh"] > 0


def test_fill_prediction_learns_from_the_last_call_that_fills_are_needed():
    # the policy never calls a tool, so every slot beyond the initial rollouts is a fill's; the look-ahead
    # alone cannot know that (every draw forks), and neither can the prediction before it has seen a segment end
    cfg = {**BASE, "initial_rollouts": 2, "branching.branch_probability": 1.0, "schedule.fill_probability": 0.8}
    engine = ScriptedEngine(policy=ScriptPolicy(call_prob=0.0))
    gen = ARPORollout(engine, engine.tokenizer, cfg, tools=[FakeSearch(), FakePython()])
    prompts = [engine.tokenizer.encode(f"Question {i}: what is the number?") for i in range(3)]
    try:
        first = gen.generate(prompts, seed=5)
        # within the call, roots that end without a call teach it too, but only once they have ended
        assert first.meta["metrics"]["rollout/fill_predicted"] < 3 * 6 and gen.call_rate_prior[1] < 0.2
        engine.max_in_flight = 0
        second = gen.generate(prompts, seed=5)
    finally:
        gen.close()
    # the second call starts every fill with the initial rollouts, and its batch is the first one's
    assert second.meta["metrics"]["rollout/fill_predicted"] == 3 * 6 and engine.max_in_flight == 3 * 8
    assert second.meta["metrics"]["rollout/fill_discarded"] == 0
    assert snapshot(second) == snapshot(first)


def test_engine_error_propagates_and_cancels_in_flight_requests():
    class FailingEngine(ScriptedEngine):
        def __init__(self):
            super().__init__(latency_s=0.05)
            self.cancelled = 0

        async def generate(self, prompt_ids, sampling_params, request_id):
            if request_id.endswith("-t1-r0") and "-g0-" in request_id:
                raise RuntimeError("engine died")
            try:
                return await super().generate(prompt_ids, sampling_params, request_id)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    engine = FailingEngine()
    # no predicted fills, so exactly the initial requests are in flight when one fails
    gen = ARPORollout(engine, engine.tokenizer, {**BASE, "schedule.fill_probability": None}, tools=[FakeSearch()])
    with pytest.raises(RuntimeError, match="engine died"):
        gen.generate([engine.tokenizer.encode("Q?")] * 2, seed=0)
    assert engine.cancelled == 2 * 4 - 1 and engine.in_flight == 0
    gen.close()


def test_generate_reuses_one_event_loop():
    engine = ScriptedEngine()
    loops = []

    class LoopRecorder(ScriptedEngine):
        async def generate(self, prompt_ids, sampling_params, request_id):
            loops.append(asyncio.get_running_loop())
            return await engine.generate(prompt_ids, sampling_params, request_id)

    gen = ARPORollout(LoopRecorder(), engine.tokenizer, BASE, tools=[FakeSearch()])
    gen.generate([engine.tokenizer.encode("Q?")], seed=0)
    gen.generate([engine.tokenizer.encode("Q?")], seed=1)
    assert len(set(map(id, loops))) == 1
    gen.close()


class RecordingEngine(ScriptedEngine):
    """Keeps every request's prompt and output."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    async def generate(self, prompt_ids, sampling_params, request_id):
        out = await super().generate(prompt_ids, sampling_params, request_id)
        self.calls.append((list(prompt_ids), sampling_params, out))
        return out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("split_tags", [True, False])
def test_window_logprobs_give_the_entropies_the_decisions_use(reduction, split_tags):
    k = 6
    engine = RecordingEngine(ToyTokenizer(split_tags=split_tags),
                             policy=ScriptPolicy(call_prob=1.0, call_decay=0.2, think_words=(4, 9)))
    cfg = {"n": 6, "initial_rollouts": 3, "sampling.max_response_length": 300, "entropy.window": k,
           "tools.call_limit": 3, "entropy.reduction": reduction, "branching.branch_probability": 0.5}
    batch, _, gen = rollout(cfg, engine=engine, n_prompts=2)
    check_invariants(batch, gen.config, engine.tokenizer, 2)
    with_lp = [(p, o) for p, sp, o in engine.calls if sp.logprobs is not None]
    # one request per segment, logprobs on every token; single-token tags need no detokenisation
    assert len(with_lp) == len(engine.calls) and any(len(o.token_ids) > k for _, o in with_lp)
    assert all(len(o.logprobs) == len(o.token_ids) for _, o in with_lp)
    assert all(sp.detokenize == split_tags for _, sp, _ in engine.calls)
    # the request that opened a segment carried the logprobs its window entropy came from
    p_len = batch["prompts"].shape[1]
    log_v = math.log(len(engine.tokenizer))
    checked = 0
    for i, r in enumerate(rows(batch)):
        prompt = batch["prompts"][i][batch["attention_mask"][i, :p_len].bool()].tolist()
        for c_i, c in enumerate(r["calls"]):
            if c["end"] <= r["bpos"]:
                continue
            seg_start = r["calls"][c_i - 1]["end"] if c_i else 0
            opener = [o for p, o in with_lp if p == prompt + r["ids"][:seg_start]
                      and r["ids"][seg_start: seg_start + len(o.token_ids)] == o.token_ids]
            ents = [sum(-math.exp(lp) * lp for lp in step.values()) / log_v for step in opener[0].logprobs[:k]]
            assert c["entropy_before"] == pytest.approx(window(ents, k, reduction), abs=1e-9)
            checked += 1
    assert checked > 0


def test_multi_token_tags_make_one_request_per_segment():
    # the tag "</python>" is several tokens: the engine matches it as a string, so a segment longer than the
    # entropy window is still one request, which stops right after the tag and carries logprobs throughout
    texts = ["<python>print(1 + 2)</python> then more words", "<answer> \\boxed{3} </answer>"]
    engine = FixedScriptEngine(texts)
    tok = engine.tokenizer
    k = len(tok.encode("<python>print(1 + 2)")) + 1
    cfg = {"n": 1, "initial_rollouts": 1, "entropy.window": k, "sampling.max_response_length": 200}
    batch, _, gen = rollout(cfg, engine=engine, n_prompts=1)
    check_invariants(batch, gen.config, tok, 1)
    r = rows(batch)[0]
    assert [c["tool"] for c in r["calls"]] == ["python"]
    assert tok.decode(r["ids"][: r["calls"][0]["start"]]) == "<python>print(1 + 2)</python>"
    assert len(engine.requests) == 2  # the segment before the result, the answer after it
    first = engine.requests[0]
    assert first.sampling_params.detokenize and first.sampling_params.logprobs is not None
    assert first.finish_reason == "stop" and len(first.output_ids) > k
    assert batch.meta["metrics"]["rollout/tokens/discarded"] == 0
