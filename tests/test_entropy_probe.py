"""The entropy probe (arpo/entropy_probe): trajectories read from every source with results where the protocol puts
them, offsets aligned on a scripted model whose uncertainty is known, intervals that cover a known mean, the
rollout's own window function. That its top-k entropy is the one the vLLM rollout records is checked on the
vLLM engine tests' engine (tests/engine/test_vllm_engine.py)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from arpo.entropy_probe import probe, read_trajectories
from arpo.entropy_probe.scoring import score_trajectories
from arpo.entropy_probe.stats import bootstrap_mean, measure, window_value
from arpo.entropy_probe.trajectories import ToolResult, Trajectory, split_response
from arpo.protocol import format_tool_result
from arpo.rollout.branching import token_entropy

RESULT_END = 3  # the scripted vocabulary's last token of a result
VOCAB = 40


class ScriptedLM(torch.nn.Module):
    """Flat next-token logits right after a result's last token, sharply peaked everywhere else: the entropy of
    exactly the first token after every result is maximal."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.0))
        self.config = type("Config", (), {"final_logit_softcapping": None})()

    def get_output_embeddings(self):
        return None

    def forward(self, input_ids, attention_mask=None):
        logits = torch.full((*input_ids.shape, VOCAB), -20.0)
        logits[..., 5] = 20.0
        flat = input_ids == RESULT_END
        logits[flat] = 0.0
        return type("Out", (), {"logits": logits * self.scale})()


def scripted_trajectory(rng: random.Random, name: str) -> Trajectory:
    """Prompt, then 2-3 rounds of model text (a call) and a result ending in RESULT_END, then a final answer."""
    ids, mask, results = [1] * 6, [False] * 6, []
    for _ in range(rng.randint(2, 3)):
        call = len(ids) + rng.randint(25, 40)
        ids += [rng.randrange(5, VOCAB) for _ in range(call - len(ids) + 4)]
        mask += [True] * (len(ids) - len(mask))
        start = len(ids)
        ids += [rng.randrange(5, VOCAB) for _ in range(rng.randint(5, 15))] + [RESULT_END]
        mask += [False] * (len(ids) - len(mask))
        results.append(ToolResult(rng.choice(["search", "python"]), call, start, len(ids)))
    ids += [rng.randrange(5, VOCAB) for _ in range(40)]
    mask += [True] * (len(ids) - len(mask))
    return Trajectory(name, mask, results, ids=ids)


def test_scripted_uncertainty_is_found_at_offset_zero_and_nowhere_else():
    rng = random.Random(0)
    trajectories = [scripted_trajectory(rng, f"t{i}") for i in range(12)]
    summary = probe(trajectories, ScriptedLM(), vocab_size=VOCAB, topk=10, window=5, before=10, after=20,
                    resamples=500, show_progress=False)
    offsets = summary["offsets"]
    for name in ("full", "topk"):
        for tool in ("search", "python"):
            mean = np.asarray(summary["curves"][name][tool]["mean"], dtype=float)
            assert offsets[int(np.nanargmax(mean))] == 0
            # uniform: 1 over the whole vocabulary, the top 10 (+ the written token) of 40 entries: about 0.26
            assert mean[offsets.index(0)] > (0.99 if name == "full" else 0.2) and np.nanmax(np.delete(mean, offsets.index(0))) < 0.01
            # one flat token in a window of 5 after, none before: the premise statistic is a fifth of it
            premise = summary["premise"][name][tool]
            assert premise["lo"] > 0.8 * premise["mean"] > 0 and premise["mean"] == pytest.approx(mean[offsets.index(0)] / 5, rel=1e-6)
        # the control point lies more than W tokens from every result: flat within W of it, no change across it
        control = summary["premise"][name]["random"]
        near = [c for c, off in enumerate(offsets) if -5 <= off < 5]
        assert abs(control["mean"]) < 1e-3
        assert max(summary["curves"][name]["random"]["mean"][c] for c in near) < 0.01
        # the test of "above the control": per trajectory, the tool's statistic minus the control's
        search, paired = summary["premise"][name]["search"], summary["premise"][name]["search - random"]
        assert 0 < paired["n"] <= min(search["n"], control["n"]) and paired["lo"] > 0
        assert paired["mean"] == pytest.approx(search["mean"] - control["mean"], rel=0.05)
    assert summary["curves"]["full"]["search"]["mean"][offsets.index(0)] == pytest.approx(1.0, abs=1e-6)  # uniform
    assert summary["events"]["random"] == 12


def test_topk_windows_are_the_rollouts_window_entropy():
    """Per-token top-k values are token_entropy / log|V| of the engine layout (top k + the written token), and a
    window through the rollout's window_entropy equals their mean (reduction mean) or sum (reduction sum)."""
    traj = scripted_trajectory(random.Random(1), "t")
    model = ScriptedLM()
    with torch.no_grad():
        model.scale.fill_(0.05)  # soften the peaks so every top-k entry carries mass
    scores = score_trajectories(model, [traj], vocab_size=VOCAB, topk=4, show_progress=False)[0]
    t = next(t for t, m in enumerate(traj.model_mask) if m and t > 0)
    assert len(scores.topk_logprobs[t]) in (4, 5) and traj.ids[t] in scores.topk_logprobs[t]
    assert scores.topk[t] == pytest.approx(token_entropy(scores.topk_logprobs[t]) / math.log(VOCAB))
    m = measure(traj, scores, window=5, seed=0)
    for reduction, reduce in (("mean", np.mean), ("sum", np.sum)):
        assert window_value(m, "topk", 3, 20, 5, VOCAB, reduction) == pytest.approx(reduce(m.values["topk"][3:8]))


def test_bootstrap_interval_covers_the_true_mean():
    covered = 0
    for seed in range(100):
        sample = np.random.default_rng(seed).exponential(0.3, size=40)  # skewed, as entropies are; mean 0.3
        ci = bootstrap_mean(sample, seed=seed, resamples=1000)
        covered += ci["lo"] <= 0.3 <= ci["hi"]
    assert covered >= 90


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def protocol_turns() -> list[tuple[str, str]]:
    return [("assistant", "<think> find it </think> <search> capital of Orn </search>"),
            ("tool", "Page 1: Orn's capital is Vel."),
            ("assistant", " <think> now compute </think> <python> print(2 + 3) </python>"),
            ("tool", "5"),
            ("assistant", " <answer> The final answer is \\boxed{ Vel } </answer>")]


def test_text_sources_mark_results_calls_and_think_where_the_protocol_puts_them(tokenizer, tmp_path):
    prompt = [{"role": "user", "content": "What is the capital of Orn?"}]
    turns = protocol_turns()
    messages = prompt + [{"role": r, "content": c} for r, c in turns]
    sharegpt = [{"from": "human", "value": prompt[0]["content"]}] + \
        [{"from": "gpt" if r == "assistant" else "observation", "value": c} for r, c in turns]
    response = "".join(c if r == "assistant" else format_tool_result(c) for r, c in turns)
    prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    (tmp_path / "messages.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps({"conversations": sharegpt}) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": prompt_text, "response": response}) + "\n")
    read = {name: read_trajectories(tmp_path / f"{name}.jsonl", tokenizer)[0]
            for name in ("messages", "sharegpt", "eval")}
    ref = read["messages"]
    assert read["sharegpt"].ids == ref.ids and read["sharegpt"].model_mask == ref.model_mask
    assert [r.tool for r in ref.results] == ["search", "python"]
    for traj in read.values():
        assert [(r.tool, r.end - r.start) for r in traj.results] == [(r.tool, r.end - r.start) for r in ref.results]
        for r in traj.results:
            text = tokenizer.decode(traj.ids[r.start:r.end])
            assert text.strip().startswith("<result>") and text.endswith("</result>")
            assert not any(traj.model_mask[r.start:r.end]) and traj.model_mask[r.end]
            assert tokenizer.decode(traj.ids[r.call_start:r.start]).strip().startswith(f"<{r.tool}>")
        assert tokenizer.decode(traj.ids[:traj.think_end]).endswith("</think>")
        model_text = tokenizer.decode([i for i, m in zip(traj.ids, traj.model_mask) if m])
        assert "Page 1" not in model_text and "\\boxed{ Vel }" in model_text
    assert split_response(response)[1] == ("result", format_tool_result("Page 1: Orn's capital is Vel."))



def test_a_loaded_tools_tag_names_its_results_tool(tokenizer, tmp_path):
    """Given the run's protocol, a result after ``<convert>…</convert>`` answers unit_converter; by default (search
    and python) the call is not recognised and the result's tool is unknown."""
    from arpo.protocol import ToolProtocol

    prompt = [{"role": "user", "content": "How many miles is 3 km?"}]
    turns = [{"role": "assistant", "content": "<think> miles </think> <convert> 3 km to mi </convert>"},
             {"role": "tool", "content": "3 km = 1.864 mi"},
             {"role": "assistant", "content": " <answer> \\boxed{1.864} </answer>"}]
    (tmp_path / "messages.jsonl").write_text(json.dumps({"messages": prompt + turns}) + "\n")
    protocol = ToolProtocol({"search": "search", "unit_converter": "convert"})
    (traj,) = read_trajectories(tmp_path / "messages.jsonl", tokenizer, protocol=protocol)
    (result,) = traj.results
    assert result.tool == "unit_converter"
    assert tokenizer.decode(traj.ids[result.call_start:result.start]).strip().startswith("<convert>")
    assert [r.tool for r in read_trajectories(tmp_path / "messages.jsonl", tokenizer)[0].results] == ["unknown"]

def test_rollout_rows_align_as_the_rollout_analysis_does():
    """A dump row's recorded entropy after each result is what arpo.analysis puts at the same offsets; a fork
    counts only the results from its branch point on."""
    from arpo.analysis import entropy_around_tool_calls

    rng = random.Random(2)
    ent = [round(rng.random(), 5) for _ in range(120)]
    for lo, hi in ((30, 45), (70, 80)):
        ent[lo:hi] = [None] * (hi - lo)
    calls = [{"tool": "search", "start": 30, "end": 45}, {"tool": "python", "start": 70, "end": 80}]
    root = {"parent_index": -1, "branch_pos": 0, "token_entropy": ent, "tool_calls": calls}
    fork = {**root, "parent_index": 0, "branch_pos": 45}
    from arpo.entropy_probe.trajectories import from_rollout_row

    trajs = [from_rollout_row("root", root), from_rollout_row("fork", fork)]
    summary = probe(trajs, before=5, after=30, resamples=200, show_progress=False)
    ref = entropy_around_tool_calls([root], before=5, after=30)
    offsets = summary["offsets"]
    for tool in ("search", "python"):
        want = ref[(ref.tool == tool) & (ref.offset >= 0)].set_index("offset")["entropy"]
        mine = summary["curves"]["topk"][tool]
        for off, value in want.items():
            n = mine["n"][offsets.index(off)]
            assert n == 2 and mine["mean"][offsets.index(off)] == pytest.approx(value)  # root and fork, equal
    assert summary["events"] == {"search": 2, "python": 2, "random": 2}
    assert "full" not in summary["curves"]  # no model: the recorded top-k entropy only


def _as_rollout_row(traj: Trajectory, prompt_len: int = 6) -> dict:
    """``traj`` as a rollout dump row keeping its token ids (positions relative to the response)."""
    calls = [{"tool": r.tool, "start": r.start - prompt_len, "end": r.end - prompt_len} for r in traj.results]
    return {"parent_index": -1, "branch_pos": 0, "tool_calls": calls, "prompt_ids": traj.ids[:prompt_len],
            "response_ids": traj.ids[prompt_len:], "response_mask": [int(m) for m in traj.model_mask[prompt_len:]]}


def test_rollout_rows_with_token_ids_are_re_scored_teacher_forced(tmp_path):
    """A dump row that keeps its ids reads back as the trajectory it came from (prompt first, results placed in
    the whole sequence), so a model re-scores it: the scripted uncertainty is found at offset 0 as on the original."""
    rng = random.Random(0)
    originals = [scripted_trajectory(rng, f"t{i}") for i in range(12)]
    (tmp_path / "step_1.jsonl").write_text("".join(json.dumps(_as_rollout_row(t)) + "\n" for t in originals))
    read = read_trajectories(tmp_path / "step_1.jsonl")
    for mine, want in zip(read, originals):
        assert mine.ids == want.ids and mine.model_mask == want.model_mask and mine.recorded is None
        assert [(r.tool, r.start, r.end) for r in mine.results] == [(r.tool, r.start, r.end) for r in want.results]
    kwargs = dict(vocab_size=VOCAB, topk=10, window=5, before=10, after=20, resamples=200, show_progress=False)
    mine, want = probe(read, ScriptedLM(), **kwargs), probe(originals, ScriptedLM(), **kwargs)
    for name in ("full", "topk"):
        for tool in ("search", "python"):
            assert mine["premise"][name][tool]["mean"] == pytest.approx(want["premise"][name][tool]["mean"], rel=1e-9)
            curve = np.asarray(mine["curves"][name][tool]["mean"], dtype=float)
            assert mine["offsets"][int(np.nanargmax(curve))] == 0


def test_a_rollout_row_read_with_its_tokenizer_marks_the_first_think_end(tokenizer, tmp_path):
    """The ``</think>`` control in rollout dumps: the position right after the first close tag, as text sources
    place it; without a tokenizer (recorded entropy only) there is none."""
    prompt = [{"role": "user", "content": "What is the capital of Orn?"}]
    messages = prompt + [{"role": r, "content": c} for r, c in protocol_turns()]
    (tmp_path / "messages.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    (ref,) = read_trajectories(tmp_path / "messages.jsonl", tokenizer)
    prompt_len = ref.model_mask.index(True)  # the response starts at the first model token
    (tmp_path / "rollout.jsonl").write_text(json.dumps(_as_rollout_row(ref, prompt_len)) + "\n")
    (mine,) = read_trajectories(tmp_path / "rollout.jsonl", tokenizer)
    assert mine.think_end == ref.think_end and tokenizer.decode(mine.ids[:mine.think_end]).endswith("</think>")
    assert read_trajectories(tmp_path / "rollout.jsonl")[0].think_end is None


def test_a_rollout_row_keeping_its_ids_gives_the_same_recorded_curves():
    """Keeping the ids shifts every position by the prompt's length, and nothing else: recorded entropy around a
    result, forks and results read the same."""
    from arpo.entropy_probe.trajectories import from_rollout_row

    rng = random.Random(3)
    ent = [round(rng.random(), 5) for _ in range(120)]
    ent[30:45] = [None] * 15
    row = {"parent_index": 0, "branch_pos": 20, "token_entropy": ent,
           "tool_calls": [{"tool": "search", "start": 30, "end": 45}]}
    with_ids = {**row, "prompt_ids": list(range(7)), "response_ids": list(range(120)),
                "response_mask": [int(v is not None) for v in ent]}
    plain, shifted = from_rollout_row("a", row), from_rollout_row("b", with_ids)
    assert shifted.own_from == plain.own_from + 7 and shifted.results[0].end == plain.results[0].end + 7
    kwargs = dict(before=5, after=20, resamples=100, show_progress=False)
    # (the random control is drawn afresh: only the result's curve must match)
    same = [json.dumps(probe([t], **kwargs)["curves"]["topk"]["search"]) for t in (shifted, plain)]  # NaN as NaN
    assert same[0] == same[1]


def test_unknown_trajectory_format_is_one_clear_error(tmp_path, capsys):
    from arpo.entropy_probe.__main__ import main
    from arpo.config import cli_main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(SystemExit) as e:
        cli_main(lambda: main(["--trajectories", str(bad), "--out", str(tmp_path / "out")]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown trajectory format" in err[0] and "'messages'" in err[0]


def test_head_on_scored_positions_matches_full_logits(tiny_model_dir, tokenizer):
    """The probe runs the output head on the model's tokens only; the entropies are those of the full forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    traj = scripted_trajectory(random.Random(3), "t")
    traj.ids = [i % len(tokenizer) for i in traj.ids]
    fast = score_trajectories(model, [traj], vocab_size=len(tokenizer), show_progress=False)[0]
    model.get_output_embeddings = lambda: None  # the fallback: full logits
    slow = score_trajectories(model, [traj], vocab_size=len(tokenizer), show_progress=False)[0]
    np.testing.assert_allclose(fast.full, slow.full, atol=1e-5)
    np.testing.assert_allclose(fast.topk, slow.topk, atol=1e-5)
