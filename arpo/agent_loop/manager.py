"""Run a batch of prompts through agent loops and pad the results into the rollout's DataBatch.

Input rows carry ``raw_prompt`` (the chat messages, verl's column name), optionally ``agent_name``
(which registered loop runs the row; default from the config) and any other dataset columns (copied
onto every output row of the prompt, and handed to the loop as keyword arguments). A row yields ``n``
trajectories: ``n`` independent runs of an ordinary loop, or one run of a group loop (ARPO) that
returns its ``n`` branches itself. Rows of one prompt are consecutive and share a ``uid``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Coroutine, Sequence, TypeVar

import numpy as np
import yaml
from tqdm.auto import tqdm

from arpo.agent_loop.base import (AgentLoopContext, AgentLoopOutput, MultiTurnConfig, register_entry,
                                  resolve_agent_loop)
from arpo.agent_loop.server_manager import ServerManager
from arpo.chat_templates.templater import ChatTemplater
from arpo.batch import DataBatch, Trajectory, collate_trajectories
from arpo.engine.base import SamplingParams
from arpo.rollout.tool_executor import ToolExecutor
from tools.base import BaseTool

# Importing the modules registers their loops under their decorator names.
import arpo.agent_loop.single_turn_agent_loop  # noqa: F401,E402
import arpo.agent_loop.tool_agent_loop  # noqa: F401,E402

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: verl's actor_rollout_ref.rollout.{agent,multi_turn} sections, with their defaults
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "rollout" / "agent.yaml"


@dataclass
class AgentLoopConfig:
    """The agent-loop config: ``actor_rollout_ref.rollout.agent`` (the loop registry and limits) and ``.multi_turn``
    (``configs/rollout/agent.yaml``), with the response length and chat-template arguments (in training verl's
    ``data.max_response_length`` and ``data.apply_chat_template_kwargs``)."""

    default_agent_loop: str = "single_turn_agent"
    response_length: int = 512
    #: conversations in flight at once across the batch (bounds engine queues and tool threads).
    max_concurrency: int = 1024
    #: sticky-session LRU size (request id -> server).
    max_cache_size: int = 10000
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: [{name, _target_, **constructor kwargs}] merged into the registry.
    agents: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, source: str | Path | dict[str, Any] | None = None, **overrides: Any) -> "AgentLoopConfig":
        """From a dict of this class's fields, or a YAML file laid out as ``configs/rollout/agent.yaml`` (None:
        that file); ``overrides`` replace top-level keys."""
        if source is None:
            source = DEFAULT_CONFIG_PATH
        if isinstance(source, (str, Path)):
            with open(source) as fh:
                sections = yaml.safe_load(fh) or {}
            values = {**(sections.get("agent") or {}), "multi_turn": sections.get("multi_turn")}
        else:
            values = dict(source)
        values.update(overrides)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown agent-loop config key(s) {unknown}; known: {sorted(known)}")
        mt = values.get("multi_turn")
        if not isinstance(mt, MultiTurnConfig):
            values["multi_turn"] = MultiTurnConfig.from_dict(mt)
        config = cls(**values)
        if config.response_length < 1:
            raise ValueError(f"response_length={config.response_length}: must be >= 1")
        if config.max_concurrency < 1:
            raise ValueError(f"max_concurrency={config.max_concurrency}: must be >= 1")
        for entry in config.agents:
            if "name" not in entry:
                raise ValueError(f"agent-loop entry {entry} has no 'name'")
            register_entry(entry["name"], entry)
        return config


def _summary(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {f"{prefix}/min": float(arr.min()), f"{prefix}/max": float(arr.max()), f"{prefix}/mean": float(arr.mean())}


class AgentLoopManager:
    """Trainer-facing entry point of the agent-loop path (see the package docstring for the layering)."""

    def __init__(self, servers: Sequence[Any], tokenizer: Any, config: AgentLoopConfig | None = None,
                 tools: Sequence[BaseTool] = (), calculate_log_probs: bool = False):
        self.config = config or AgentLoopConfig.load()
        self.tokenizer = tokenizer
        tool_map: dict[str, BaseTool] = {}
        for tool in tools:
            tool_map[tool.function_name] = tool
            if tool.name:
                tool_map[tool.name] = tool
        self.server_manager = ServerManager(servers, max_cache_size=self.config.max_cache_size)
        mt = self.config.multi_turn
        self._tool_executor = ToolExecutor(tool_map, max_workers=mt.tool_workers, timeout_s=mt.tool_timeout_s,
                                           retries=mt.tool_retries, retry_on_empty=mt.retry_on_empty,
                                           max_result_chars=mt.max_tool_response_length,
                                           truncate_side=mt.tool_response_truncate_side)
        self.context = AgentLoopContext(
            server_manager=self.server_manager,
            tokenizer=tokenizer,
            templater=ChatTemplater(tokenizer, [t.tool_schema for t in tools], self.config.chat_template_kwargs),
            tools=tool_map,
            multi_turn=self.config.multi_turn,
            response_length=self.config.response_length,
            tool_executor=self._tool_executor,
            calculate_log_probs=calculate_log_probs,
        )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id; set one")
        self.pad_token_id = int(pad)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ public API

    def generate_sequences(self, batch: DataBatch | list[dict[str, Any]], n: int = 1,
                           sampling_params: SamplingParams | None = None) -> DataBatch:
        """Blocking form of :meth:`generate_sequences_async`, run on the manager's own event loop thread.

        One persistent loop serves every call, so engines and servers that bind to the loop they were
        first used on (vLLM's AsyncLLM) keep working across training steps.
        """
        return self.run_coroutine(self.generate_sequences_async(batch, n, sampling_params))

    async def generate_sequences_async(self, batch: DataBatch | list[dict[str, Any]], n: int = 1,
                                       sampling_params: SamplingParams | None = None) -> DataBatch:
        if n < 1:
            raise ValueError(f"n={n}: each prompt needs at least one trajectory (rollout.n >= 1)")
        rows = self._rows(batch)
        params = sampling_params or SamplingParams(max_tokens=self.config.response_length)
        meta = batch.meta if isinstance(batch, DataBatch) else {}
        semaphore = asyncio.Semaphore(self.config.max_concurrency)
        start = time.perf_counter()
        jobs: list[tuple[int, Coroutine[Any, Any, list[AgentLoopOutput]]]] = []
        for g, row in enumerate(rows):
            cls, kwargs = resolve_agent_loop(row.get("agent_name") or self.config.default_agent_loop)
            fields = {k: v for k, v in row.items() if k not in ("raw_prompt", "agent_name", "uid")}
            runs = 1 if cls.returns_group else n
            for k in range(runs):
                run_params, extra = params, {}
                if cls.returns_group:  # the whole group, its draws seeded by (call seed, row) as in the batch rollout
                    extra = {"n": n, "group": g, "call_seed": meta.get("seed", params.seed),
                             "rollout_overrides": meta.get("rollout_overrides")}
                elif params.seed is not None and runs > 1:  # the same seed on every sample: n identical samples
                    run_params = params.with_(seed=(params.seed * 1_000_003 + g * 1009 + k) & 0x7FFFFFFF)
                jobs.append((g, self._run_one(semaphore, cls, kwargs, row["raw_prompt"], run_params, fields,
                                              extra)))
        with tqdm(total=len(jobs), desc="agent loop", disable=None, leave=False) as bar:
            async def tracked(coro):
                result = await coro
                bar.update(1)
                return result
            results = await asyncio.gather(*(tracked(c) for _, c in jobs))
        wall = time.perf_counter() - start

        per_group: list[list[AgentLoopOutput]] = [[] for _ in rows]
        for (g, _), outs in zip(jobs, results):
            per_group[g].extend(outs)
        trajectories = self._trajectories(per_group, rows)
        group_uids = [str(row.get("uid") or uuid.uuid4().hex) for row in rows]
        group_fields = {k: [row.get(k) for row in rows]
                        for k in dict.fromkeys(k for row in rows for k in row) if k not in ("uid", "agent_name")}
        out = collate_trajectories(trajectories, self.pad_token_id, group_uids, group_fields,
                                   max_response_length=self.config.response_length)
        outputs = [o for group in per_group for o in group]
        out.meta["timing"] = {
            "agent_loop/wall": wall,
            **_summary("agent_loop/generate_sequences", [o.metrics.get("generate_sequences", 0.0) for o in outputs]),
            **_summary("agent_loop/tool_calls", [o.metrics.get("tool_calls", 0.0) for o in outputs]),
        }
        out.meta["metrics"] = {
            **_summary("agent_loop/num_turns", [o.num_turns for o in outputs]),
            "agent_loop/num_trajectories": float(len(outputs)),
            # the batch rollout's names too, so tables and notebooks read both paths alike
            "rollout/trajectories": float(len(outputs)),
            # a branch's calls before its fork point ran once, in its parent
            "rollout/tool_calls/total": float(sum(c["end"] > o.branch_pos for o in outputs for c in o.tool_calls)),
            "agent_loop/branched_fraction": float(np.mean([o.parent >= 0 for o in outputs])),
        }
        return out

    def run_coroutine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the manager's event-loop thread and wait for it."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="agent-loop", daemon=True)
            self._loop_thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Stop the loop thread and the tool threads; safe to call twice."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=10)
            self._loop.close()
            self._loop = None
        self._tool_executor.close()

    # -------------------------------------------------------------------------------- internals

    async def _run_one(self, semaphore: asyncio.Semaphore, cls: type, kwargs: dict[str, Any],
                       messages: list[dict[str, Any]], params: SamplingParams, fields: dict[str, Any],
                       extra: dict[str, Any]) -> list[AgentLoopOutput]:
        async with semaphore:
            loop = cls(self.context, **kwargs)
            result = await loop.run(list(messages), params, **fields, **extra)
        return result if isinstance(result, list) else [result]

    @staticmethod
    def _rows(batch: DataBatch | list[dict[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(batch, DataBatch):
            cols = batch.non_tensors
            rows = [{k: v[i] for k, v in cols.items()} for i in range(len(batch))]
        else:
            rows = [dict(r) for r in batch]
        if not rows:
            raise ValueError("empty batch: nothing to generate")
        for i, row in enumerate(rows):
            messages = row.get("raw_prompt")
            if messages is None:
                raise ValueError(f"row {i} has no 'raw_prompt' column (the chat messages); "
                                 f"load the dataset with return_raw_chat=True")
            row["raw_prompt"] = list(messages)
        return rows

    def _trajectories(self, per_group: list[list[AgentLoopOutput]], rows: list[dict[str, Any]]) -> list[Trajectory]:
        trajectories: list[Trajectory] = []
        for g, outs in enumerate(per_group):
            base = len(trajectories)
            agent = rows[g].get("agent_name") or self.config.default_agent_loop
            for o in outs:
                t = o.to_trajectory(g, base + o.parent if o.parent >= 0 else -1, self.config.response_length)
                t.extra["agent_name"] = agent
                trajectories.append(t)
        return trajectories
