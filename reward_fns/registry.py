"""Which reward grades which ``data_source``, and verl's ``custom_reward_function`` override.

Lookup order: the exact name, then the same name lower-cased, then the longest registered prefix.
Built-in routes:

==========================================================  ======================================
data_source                                                 reward
==========================================================  ======================================
``DR_*`` (ARPO's training/validation parquet: DR_grpo_mix,   ``deep_research`` (ARPO's: F1, −1 bad
DR_simpledeepsearch0.8k, DR_gaia …)                          format, +0.1 both tools)
aime24, aime25, aime, amc23, math500, math, gsm8k,           ``math`` (equivalence; ``mode: f1`` for
openai/gsm8k, lighteval/MATH …                               ARPO's F1 grading)
hotpotqa, 2wiki, musique, bamboogle, nq, triviaqa, popqa,    ``qa`` (token F1, no tool bonus)
gaia, hle, webwalker, xbench, simpleqa, ``searchR1_*``
``synthetic/*``                                              ``synthetic``
==========================================================  ======================================

The one obvious way to use your own reward is verl's ``custom_reward_function.path``/``.name`` (a function in a
file, called for every row; ``examples/length_penalty_reward.py``). To route only some data sources to it, register
it instead: ``@register("mybench")`` on the function (or ``register("mybench", "my_pkg.rewards:score")``). Entries are
stored as ``"module:function"`` strings or module-level functions so a snapshot of the registry
pickles into reward worker processes.

**The run's tool tags.** :func:`build_compute_score` reads the run's ``tools`` (the entries the rollout loads) into
a :class:`~arpo.protocol.ToolProtocol` and gives it to every reward that declares a ``protocol`` parameter (the
built-in ones do), so the format gate accepts the tags the rollout lets the model call. A reward without that
parameter is called exactly as before; without ``tools`` the built-in rewards keep their default, ``<search>`` and
``<python>``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from arpo.protocol import ToolProtocol

RewardOutput = float | dict[str, Any]
RewardFn = Callable[..., RewardOutput]

MATH_SOURCES = ("aime24", "aime25", "aime", "amc23", "math500", "math", "gsm8k", "openai/gsm8k", "lighteval/math",
                "digitallearninggmbh/math-lighteval")
QA_SOURCES = ("hotpotqa", "2wiki", "2wikimultihopqa", "musique", "bamboogle", "nq", "triviaqa", "popqa", "gaia",
              "hle", "webwalker", "xbench", "simpleqa")


#: families whose rewards are string and number checks (microseconds a row): ``reward.executor=auto`` scores
#: batches of only these in the calling process instead of starting a pool of worker processes
LIGHT_FAMILIES = frozenset({"synthetic", "qa", "deep_research"})


@dataclass
class RewardEntry:
    """A reward function (``"module:function"`` or a callable), its family and fixed keyword arguments."""

    target: str | RewardFn
    family: str = "custom"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def resolve(self) -> RewardFn:
        if callable(self.target):
            return self.target
        module_name, _, fn_name = self.target.partition(":")
        return getattr(importlib.import_module(module_name), fn_name or "compute_score")


def takes_protocol(fn: RewardFn) -> bool:
    """Whether a reward declares a ``protocol`` parameter by name (``**kwargs`` does not count: such a reward may
    pass its keywords on to code that rejects an unknown one)."""
    try:
        param = inspect.signature(fn).parameters.get("protocol")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY)


def call_reward(fn: RewardFn, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                protocol: "ToolProtocol | None") -> RewardOutput:
    """``fn(*args, **kwargs)``, with ``protocol`` when ``fn`` declares it. A ``protocol`` in ``kwargs`` (a wrapper
    passing on its own) wins, and is dropped for a reward that does not declare the parameter."""
    kwargs = dict(kwargs)
    forwarded = kwargs.pop("protocol", None)
    protocol = forwarded if forwarded is not None else protocol
    if protocol is not None and takes_protocol(fn):
        kwargs["protocol"] = protocol
    return fn(*args, **kwargs)


class RewardRegistry:
    """Maps data sources (exact names and prefixes) to reward functions; callable like verl's
    ``default_compute_score``."""

    def __init__(self) -> None:
        self.exact: dict[str, RewardEntry] = {}
        self.prefixes: dict[str, RewardEntry] = {}
        #: the run's tool tags, given to rewards that declare ``protocol``; None: each reward's own default
        self.protocol: ToolProtocol | None = None

    def register(self, data_source: str, fn: str | RewardFn, *, prefix: bool = False, family: str = "custom",
                 **kwargs: Any) -> None:
        """Route ``data_source`` (or every name starting with it, if ``prefix``) to ``fn``."""
        if not data_source:
            raise ValueError("data_source to register must be a non-empty string")
        if not callable(fn) and ":" not in str(fn):
            raise ValueError(f"reward fn {fn!r} must be a callable or 'module:function'")
        (self.prefixes if prefix else self.exact)[data_source] = RewardEntry(fn, family, dict(kwargs))

    def lookup(self, data_source: str) -> RewardEntry:
        """The entry for ``data_source``; KeyError naming it and how to register one when unknown."""
        name = str(data_source)
        for key in (name, name.lower()):
            if key in self.exact:
                return self.exact[key]
        for key in sorted(self.prefixes, key=len, reverse=True):
            if name.startswith(key) or name.lower().startswith(key.lower()):
                return self.prefixes[key]
        raise KeyError(
            f"no reward function registered for data_source={name!r}. Known names: {sorted(self.exact)}; "
            f"prefixes: {sorted(self.prefixes)}. Register one with "
            f"reward_fns.register({name!r}, 'my_module:compute_score') (prefix=True for a family), or set "
            f"custom_reward_function.path=/path/to/file.py custom_reward_function.name=compute_score")

    def configure(self, family: str, **kwargs: Any) -> "RewardRegistry":
        """Set keyword arguments on every entry of ``family`` (e.g. ``configure("math", mode="f1")``)."""
        for entry in (*self.exact.values(), *self.prefixes.values()):
            if entry.family == family:
                entry.kwargs.update(kwargs)
        return self

    def copy(self) -> "RewardRegistry":
        new = RewardRegistry()
        new.exact = {k: RewardEntry(e.target, e.family, dict(e.kwargs)) for k, e in self.exact.items()}
        new.prefixes = {k: RewardEntry(e.target, e.family, dict(e.kwargs)) for k, e in self.prefixes.items()}
        new.protocol = self.protocol
        return new

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: dict[str, Any] | None = None, **kwargs: Any) -> RewardOutput:
        entry = self.lookup(data_source)
        return call_reward(entry.resolve(), (data_source, solution_str, ground_truth, extra_info),
                           {**entry.kwargs, **kwargs}, self.protocol)


def builtin_registry() -> RewardRegistry:
    """A fresh registry with the built-in routes of the module docstring."""
    reg = RewardRegistry()
    reg.register("DR_", "reward_fns.deep_research:compute_score", prefix=True, family="deep_research")
    reg.register("synthetic/", "reward_fns.synthetic:compute_score", prefix=True, family="synthetic")
    reg.register("searchR1_", "reward_fns.qa:compute_score", prefix=True, family="qa")
    for name in MATH_SOURCES:
        reg.register(name, "reward_fns.math:compute_score", family="math")
    for name in QA_SOURCES:
        reg.register(name, "reward_fns.qa:compute_score", family="qa")
    return reg


#: The process-wide registry that :func:`register` and :func:`default_compute_score` use.
REGISTRY = builtin_registry()


def register(data_source: str, fn: str | RewardFn | None = None, *, prefix: bool = False, family: str = "custom",
             **kwargs: Any) -> Any:
    """Add a route to the process-wide registry (see :meth:`RewardRegistry.register`). Without ``fn`` it is a
    decorator for a module-level function (module-level so it pickles into reward workers)::

        @register("mybench", prefix=True)
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs): ...

    The module must be imported before training starts (e.g. by your launcher); a file used only once is
    simpler as ``custom_reward_function.path``/``.name`` (``examples/length_penalty_reward.py``)."""
    if fn is None:
        def decorator(f: RewardFn) -> RewardFn:
            REGISTRY.register(data_source, f, prefix=prefix, family=family, **kwargs)
            return f

        return decorator
    REGISTRY.register(data_source, fn, prefix=prefix, family=family, **kwargs)
    return fn


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict[str, Any] | None = None, **kwargs: Any) -> RewardOutput:
    """verl's entry point: grade one response with the reward registered for ``data_source``."""
    return REGISTRY(data_source, solution_str, ground_truth, extra_info, **kwargs)


# ---- custom_reward_function ---------------------------------------------------------------------------

_LOADED_FILES: dict[tuple[str, str], RewardFn] = {}


def _load_function_from_file(path: str, name: str) -> RewardFn:
    key = (path, name)
    if key in _LOADED_FILES:
        return _LOADED_FILES[key]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_reward_function.path={path!r} does not exist (give a .py file)")
    module_name = "custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path={path!r} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling inside the file need the module registered
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RuntimeError(f"error while loading custom_reward_function.path={path!r}: {exc!r}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AttributeError(f"custom_reward_function.name={name!r} is not a function in {path!r}; "
                             f"functions there: {public}")
    _LOADED_FILES[key] = fn
    return fn


class FileRewardFn:
    """A reward function loaded from a file (verl's ``custom_reward_function``), called with
    ``reward_kwargs`` appended, and ``protocol`` when it declares one. Pickles as its attributes, so worker
    processes reload the file."""

    def __init__(self, path: str, name: str = "compute_score", reward_kwargs: Mapping[str, Any] | None = None):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.name = name or "compute_score"
        self.reward_kwargs = dict(reward_kwargs or {})
        #: the run's tool tags (see :class:`RewardRegistry`)
        self.protocol: ToolProtocol | None = None
        _load_function_from_file(self.path, self.name)  # fail now, with a clear message, not per sample

    def __call__(self, *args: Any, **kwargs: Any) -> RewardOutput:
        return call_reward(_load_function_from_file(self.path, self.name), args, {**kwargs, **self.reward_kwargs},
                           self.protocol)

    def __repr__(self) -> str:
        return f"FileRewardFn(path={self.path!r}, name={self.name!r}, reward_kwargs={self.reward_kwargs!r})"


def load_custom_reward_fn(config: Mapping[str, Any] | Any) -> FileRewardFn | None:
    """verl's ``get_custom_reward_fn``: the function named by ``custom_reward_function`` or None if no path."""
    section = config_value(config, "custom_reward_function") or {}
    path = config_value(section, "path")
    if not path:
        return None
    return FileRewardFn(str(path), config_value(section, "name") or "compute_score",
                        dict(config_value(section, "reward_kwargs") or {}))


def build_compute_score(config: Mapping[str, Any] | Any | None = None) -> RewardFn:
    """The compute_score a run uses: the custom function if configured, else a configured registry copy.

    Options read from ``config.reward`` (see ``configs/reward.yaml``): ``math_mode`` (equiv|f1),
    ``math_timeout_s``, ``qa_metric`` (f1|em), ``deep_research_tool_bonus``, ``deep_research_variant``
    (fixed|released). ``config.tools`` gives the rewards that declare ``protocol`` the run's tool tags
    (:func:`run_protocol`).
    """
    protocol = run_protocol(config)
    custom = load_custom_reward_fn(config) if config is not None else None
    if custom is not None:
        custom.protocol = protocol
        return custom
    reg = REGISTRY.copy()
    reg.protocol = protocol
    options = (config_value(config, "reward") if config is not None else None) or {}
    math_mode = config_value(options, "math_mode")
    if math_mode is not None:
        from reward_fns.math import MATH_MODES
        if math_mode not in MATH_MODES:
            raise ValueError(f"reward.math_mode must be one of {MATH_MODES}, got {math_mode!r}")
        reg.configure("math", mode=math_mode)
    if config_value(options, "math_timeout_s") is not None:
        reg.configure("math", timeout_s=float(config_value(options, "math_timeout_s")))
    qa_metric = config_value(options, "qa_metric")
    if qa_metric is not None:
        if qa_metric not in ("f1", "em"):
            raise ValueError(f"reward.qa_metric must be 'f1' or 'em', got {qa_metric!r}")
        reg.configure("qa", metric=qa_metric)
    if config_value(options, "deep_research_tool_bonus") is not None:
        reg.configure("deep_research", tool_bonus=float(config_value(options, "deep_research_tool_bonus")))
    variant = config_value(options, "deep_research_variant")
    if variant is not None:
        from reward_fns.deep_research import VARIANTS
        if variant not in VARIANTS:
            raise ValueError(f"reward.deep_research_variant must be one of {VARIANTS}, got {variant!r}")
        reg.configure("deep_research", variant=str(variant))
    return reg


def run_protocol(config: Mapping[str, Any] | Any | None) -> "ToolProtocol | None":
    """The tag protocol of the run's tools (``config.tools``: the rollout's tool entries or a tool YAML path),
    read without starting any tool, in the rollout's call format (``actor_rollout_ref.rollout.arpo.tools.format``,
    so a hermes run's calls pass the gate); None when the config declares no tools."""
    declared = config_value(config, "tools")
    if not declared:
        return None
    # imported here: reward worker processes get the protocol pickled and never import the tool classes
    from tools.registry import tool_protocol

    protocol = tool_protocol(declared)
    section = config_value(config, "actor_rollout_ref")
    for key in ("rollout", "arpo", "tools", "format"):
        section = config_value(section, key)
    return protocol.with_format(str(section)) if section else protocol


def config_value(obj: Any, key: str) -> Any:
    """``obj[key]`` for dicts and OmegaConf/attribute objects alike; None when absent."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    try:
        return obj[key]
    except (KeyError, TypeError, IndexError, AttributeError):
        return getattr(obj, key, None)
