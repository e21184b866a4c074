"""Synthetic SFT demonstrations: a training row's gold tool plan run through the real tools, tokenised as an RL
trajectory.

The tools are the ones RL uses (search over the benchmark's corpus, the sandboxed Python interpreter), so the results
the model sees in SFT are exactly what it will see in RL. Model segments and tool-result segments are tokenised
separately and concatenated (token-in-token-out), and the loss is masked on the prompt and on every ``<result>``
segment, exactly as the RL response mask. Recorded trajectories (:mod:`arpo.data.sft_dataset`) go through the same
:func:`tokenize_demonstration`, and :class:`DemonstrationStream` feeds either to the SFT driver (:mod:`arpo.sft`).

Demonstrations are deliberately imperfect (``sft.demo.*``): some skip a needed tool call and guess, some call
the wrong tool first and guess, so the SFT model follows the format but leaves headroom for RL.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import pandas as pd
from tqdm import tqdm

from arpo.protocol import DEFAULT_PROTOCOL, format_tool_result
from tools.base import BaseTool

logger = logging.getLogger(__name__)


@dataclass
class Segment:
    """A piece of a demonstration: model-written text (trained on) or tool output (masked)."""

    text: str
    is_model: bool


def _guess(rng: random.Random, answer: str) -> str:
    """A plausible wrong answer: a perturbed number, or a scrambled name."""
    if answer.lstrip("-").isdigit():
        value = int(answer)
        return str(value + rng.choice([-1, 1]) * rng.randint(1, max(2, abs(value) // 10 + 1)))
    letters = list(answer.replace(" ", ""))
    rng.shuffle(letters)
    guess = "".join(letters).capitalize()
    return guess if guess != answer else guess + "a"


def build_demonstration(question: str, answer: str, plan: list[dict], tools: Mapping[str, BaseTool],
                        rng: random.Random, skip_tool_prob: float, wrong_tool_prob: float,
                        verbose_think: bool = False, wrong_pick_prob: float = 0.0) -> tuple[list[Segment], str]:
    """Turn a gold plan into protocol text with real tool results. Returns (segments, demo kind).

    ``wrong_pick_prob``: a gold demonstration of a plan with a step that has ``alternatives`` (the ``pick``
    kind's wrong entries: code, result, answer and the page entry it reads) takes one of them instead, ending on
    its answer (demo kind ``wrong_pick``). Plans
    without alternatives draw nothing more, so their demonstrations stay what they were.

    ``verbose_think``: each ``<think>`` restates the query it is about to run and the fact the last result gave
    (free text copied from the question/results). Off: short fixed thoughts ("I will search."), so the only
    free text the model writes is the tool call and the boxed answer -- fewer tokens per demonstration and
    fewer high-entropy spans where sampling can drift into a stray tag."""
    draw = rng.random()
    if draw < skip_tool_prob:
        mode = "skip"
    elif draw < skip_tool_prob + wrong_tool_prob:
        mode = "wrong_tool"
    else:
        mode = "gold"
    segs: list[Segment] = []
    thought = "I need to answer the question." if verbose_think else ("I will search." if plan[0]["tool"] == "python"
                                                                     else "I will compute this with python.")
    if mode == "wrong_tool":
        # The first step's own content sent to the other tool (a query printed by python, an expression searched):
        # a plausible mistake, and no long free text inside a call tag.
        first = plan[0]["content"]
        if plan[0]["tool"] == "search":
            wrong, content = "python", f"print({json.dumps(first)})"
        else:
            wrong = "search"
            content = first[len("print("):-1] if first.startswith("print(") and first.endswith(")") else first
        segs.append(_call(f"<think> {thought} </think>", wrong, content, tools))
        segs.append(_result(wrong, content, tools))
        segs.append(Segment(f" <think> I will guess. </think> <answer> The final answer is \\boxed{{ {_guess(rng, answer)} }} </answer>", True))
        return segs, mode
    steps = plan if mode == "gold" else plan[:-1]
    picked = next((i for i, step in enumerate(steps) if step.get("alternatives")), None)
    if mode == "gold" and picked is not None and rng.random() < wrong_pick_prob:
        alt = rng.choice(steps[picked]["alternatives"])
        steps = [*steps[:picked], {**steps[picked], "content": alt["content"], "finding": alt["finding"]},
                 *steps[picked + 1:]]
        if picked > 0:  # the thought before the wrong step restates the wrong entry
            steps[picked - 1] = {**steps[picked - 1], "finding": alt["entry"]}
        mode, answer = "wrong_pick", alt["answer"]
    prefix = ""
    for i, step in enumerate(steps):
        if verbose_think:
            intent = f"I need the {step['content']}." if step["tool"] == "search" else "I will compute this with python."
        else:
            intent = "I will search." if step["tool"] == "search" else "I will compute this with python."
        think = f"<think> {prefix}{intent} </think>"
        segs.append(_call(think if i == 0 else f" {think}", step["tool"], step["content"], tools))
        segs.append(_result(step["tool"], step["content"], tools))
        prefix = step["finding"] + " " if verbose_think else ""
    guessed = mode == "skip"
    final = _guess(rng, answer) if guessed else answer
    if verbose_think:
        closing = (prefix + "I will guess the rest.").strip() if guessed else prefix.strip()
    else:
        closing = "I will guess the rest." if guessed else "I have the answer."
    lead = " " if steps else ""
    segs.append(Segment(f"{lead}<think> {closing} </think> <answer> The final answer is \\boxed{{ {final} }} </answer>", True))
    return segs, mode


def _call(think: str, tool: str, content: str, tools: Mapping[str, BaseTool]) -> Segment:
    open_tag, close_tag = DEFAULT_PROTOCOL.pair(tool)  # the demonstrations call search and python
    return Segment(f"{think} {open_tag} {content} {close_tag}", True)


def _result(tool: str, content: str, tools: Mapping[str, BaseTool]) -> Segment:
    if tool not in tools:
        raise KeyError(f"the SFT demonstrations need a '{tool}' tool; configure it under tools (configs/tools/)")
    return Segment(format_tool_result(tools[tool].call_text(content)), False)


def tokenize_demonstration(tokenizer, messages: list[dict], segments: Sequence[Segment]) -> tuple[list[int], list[int]]:
    """Prompt ids + response ids with the loss mask (0 on the prompt and tool results, 1 on model tokens + EOS)."""
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    ids, mask = list(prompt_ids), [0] * len(prompt_ids)
    for seg in segments:
        seg_ids = tokenizer.encode(seg.text, add_special_tokens=False)
        ids.extend(seg_ids)
        mask.extend([1 if seg.is_model else 0] * len(seg_ids))
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    return ids, mask


def iter_demonstrations(df: pd.DataFrame, tokenizer, tools: Mapping[str, BaseTool], seed: int,
                        skip_tool_prob: float, wrong_tool_prob: float, num_workers: int = 8,
                        verbose_think: bool = False,
                        wrong_pick_prob: float = 0.0) -> Iterator[tuple[tuple[list[int], list[int]], str]]:
    """``((ids, mask), demo kind)`` for every row, in row order, while a thread pool runs the tools ahead (each
    call is a sandboxed subprocess or an index lookup). Closing the iterator early cancels the calls not started."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i_row):
        i, row = i_row
        # A per-row RNG keeps the dataset identical whatever the thread scheduling.
        rng = random.Random(f"{seed}-{i}")
        plan = json.loads(row.extra_info["plan"])
        segs, mode = build_demonstration(row.extra_info["question"], str(row.reward_model["ground_truth"]),
                                         plan, tools, rng, skip_tool_prob, wrong_tool_prob, verbose_think,
                                         wrong_pick_prob)
        return tokenize_demonstration(tokenizer, list(row.prompt), segs), mode

    with ThreadPoolExecutor(max(1, num_workers)) as pool:
        futures = [pool.submit(one, x) for x in enumerate(df.itertuples(index=False))]
        try:
            for fut in futures:
                yield fut.result()
        finally:
            for fut in futures:
                fut.cancel()


class DemonstrationStream:
    """Demonstrations as they are built (row order), longer than ``max_length`` dropped and counted; everything
    yielded is kept in ``examples`` so later epochs reuse it. Lets training start while the tools still run."""

    def __init__(self, demos: Iterable[tuple[tuple[list[int], list[int]], str]], max_length: int,
                 kinds: Sequence[str] = ("gold", "skip", "wrong_tool")):
        self._demos = demos
        self.max_length = max_length
        self.examples: list[tuple[list[int], list[int]]] = []
        self.modes = {**{k: 0 for k in kinds}, "too_long": 0}
        self.done = False
        self.seconds = 0.0  # from the first pull to the last demonstration

    def __iter__(self):
        start = time.time()
        for (ids, mask), mode in tqdm(self._demos, desc="sft demos", leave=False):
            if len(ids) > self.max_length:
                self.modes["too_long"] += 1
                continue
            self.modes[mode] = self.modes.get(mode, 0) + 1
            self.examples.append((ids, mask))
            yield ids, mask
        self.done = True
        self.seconds = time.time() - start
        logger.info("sft demonstrations built in %.1f s: %s", self.seconds, self.modes)

    def collect(self) -> list[tuple[list[int], list[int]]]:
        """Build every demonstration now (no streaming); return the kept ones."""
        for _ in self:
            pass
        return self.examples
