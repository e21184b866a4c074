"""The memory and placement planner: whether a run fits its GPUs and hosts, before any worker starts.

From the model's ``config.json`` alone (the architecture built on the meta device) and the run's composed config,
:func:`build_plan` gives each GPU's memory by phase (generation, log-probs, update, weight sync), the vLLM
replica's budget and KV cache, and each node's host RAM and shared memory; :func:`check_config` stops a run that
cannot fit with one line naming the keys to change; :func:`step_seconds` predicts a step's time.
``python -m arpo.plan [--gpu-memory-gb G] [key=value ...]`` prints the plan (docs/scaling/planner.md).
"""

from arpo.plan.check import build_plan, check_config, format_plan
from arpo.plan.cost import Throughputs, step_seconds
from arpo.plan.memory import MemoryPlan, plan_memory
from arpo.plan.settings import PlanSettings
from arpo.plan.shapes import ModelShapes, model_shapes

__all__ = ["MemoryPlan", "ModelShapes", "PlanSettings", "Throughputs", "build_plan", "check_config", "format_plan",
           "model_shapes", "plan_memory", "step_seconds"]
