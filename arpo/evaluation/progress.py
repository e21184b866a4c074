"""The evaluation's progress bar: finished samples, plus the samples in flight and the tokens they generate.

A bar that counts only finished samples stands still for as long as the slowest samples run, which for a
model that rambles to an 8,192-token budget is minutes ("28/32" with a busy engine looks hung). So the bar
also shows, in its postfix, how many samples are in flight and how many tokens have been generated (and at
what rate). The in-process vLLM engine reports tokens as they are generated (its ``token_listener``), so
even one long request moves the bar; other engines report each request's tokens when it ends
(:class:`TokenCountingEngine`), so each generation turn of a multi-turn sample moves it. A heartbeat redraws the bar every ``refresh_s`` seconds
(1 on a terminal, 30 into a log file, where each redraw is written out), so its clock keeps running even
while no request finishes.

With those engines the tokens of one long request (a single turn that runs to the budget) show up when it
ends; until then ``in_flight`` and the running clock say the sample is still being generated.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Callable

from tqdm.auto import tqdm

from arpo.engine.base import GenerationOutput, SamplingParams


def _count(n: int) -> str:
    """8,192 exactly; 123k and 1.23M once exact digits stop being readable at a glance."""
    return f"{n:,}" if n < 100_000 else tqdm.format_sizeof(n)


class TokenCountingEngine:
    """Forwards to ``engine``; after each ``generate`` it reports the number of tokens the request generated."""

    def __init__(self, engine: Any, on_tokens: Callable[[int], None]):
        self._engine = engine
        self._on_tokens = on_tokens

    async def generate(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       request_id: str) -> GenerationOutput:
        out = await self._engine.generate(prompt_ids, sampling_params, request_id)
        self._on_tokens(len(out.token_ids))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class EvalProgress:
    """The bar (``desc="eval"``, one step per finished sample) and the counters shown in its postfix:
    ``acc`` (mean over finished samples), ``in_flight``, ``tokens`` (generated so far, finished and in-flight
    samples), ``tok/s`` (since the bar started), ``truncated`` (samples that reached their budget, once any)."""

    def __init__(self, total: int, enabled: bool = True, refresh_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.bar = tqdm(total=total, desc="eval", unit="sample", disable=not enabled)
        self.enabled = enabled
        self.refresh_s = refresh_s if refresh_s is not None else 1.0 if sys.stderr.isatty() else 30.0
        self.clock = clock
        self.started_at = clock()
        self._last_draw = self.started_at
        self.in_flight = 0
        self.tokens = 0
        self.finished = 0
        self.truncated = 0
        self.acc_sum = 0.0

    def sample_started(self) -> None:
        self.in_flight += 1
        self._show()

    def generated(self, n_tokens: int) -> None:
        """A sample in flight generated ``n_tokens`` more tokens."""
        self.tokens += int(n_tokens)
        self._show()

    def sample_finished(self, record: dict[str, Any]) -> None:
        self.in_flight -= 1
        self.finished += 1
        self.acc_sum += float(record["metrics"].get("acc", 0.0))
        self.truncated += int(bool(record.get("truncated")))
        self.bar.set_postfix(self.postfix(), refresh=False)
        self.bar.update(1)  # draws the new count and postfix (at most every tqdm's mininterval)

    def postfix(self) -> dict[str, str]:
        elapsed = max(self.clock() - self.started_at, 1e-9)
        shown = {"acc": f"{self.acc_sum / self.finished:.3f}"} if self.finished else {}
        shown.update(in_flight=str(self.in_flight), tokens=_count(self.tokens),
                     **{"tok/s": _count(round(self.tokens / elapsed))})
        if self.truncated:
            shown["truncated"] = str(self.truncated)
        return shown

    def _show(self) -> None:
        # Many samples end turns each second: the postfix is set every time, the bar drawn at most every
        # refresh_s (the heartbeat draws it otherwise).
        self.bar.set_postfix(self.postfix(), refresh=False)
        now = self.clock()
        if now - self._last_draw >= self.refresh_s:
            self._last_draw = now
            self.bar.refresh()

    async def heartbeat(self) -> None:
        """Redraw the bar (its clock, tok/s) every ``refresh_s`` until cancelled."""
        if not self.enabled:
            return
        while True:
            await asyncio.sleep(self.refresh_s)
            self.bar.set_postfix(self.postfix(), refresh=False)
            self._last_draw = self.clock()
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
