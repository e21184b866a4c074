"""The pipeline stages that the paper's recipe adds to the synthetic run: RL data given as files (checked, not
generated), a base model named by its Hugging Face id, evaluation of the RL model on the released benchmarks, and
the paper's tables (:mod:`arpo.pipeline` composes them).

They live here so that :mod:`arpo.pipeline` stays the readable list of stages; each function is the same code a
researcher runs by hand (``python -m arpo.eval``, ``python -m arpo.tables``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig

from arpo.config import ConfigError
from arpo.data.release import missing_file_hint

logger = logging.getLogger(__name__)

#: where a preset's RL prompts come from: generated (the synthetic benchmark) or given (data.train_files/val_files)
RL_DATA = ("synthetic", "files")


def override_key(override: str) -> str:
    """The dotted key an override sets (``+a.b=1`` -> ``a.b``)."""
    return override.lstrip("+~").split("=", 1)[0]


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value the overrides give ``key`` (the last one wins, as in Hydra); None when none sets it."""
    values = [o.split("=", 1)[1] for o in overrides if override_key(o) == key]
    return values[-1] if values else None


def has_key(cfg: Any, dotted: str) -> bool:
    """Whether ``cfg`` holds ``dotted`` (list items by index), without resolving any interpolation."""
    node = cfg
    for part in dotted.split("."):
        if isinstance(node, ListConfig) and part.isdigit() and int(part) < len(node):
            node = node._get_node(int(part))
        elif isinstance(node, DictConfig) and part in node:
            node = node._get_node(part)
        else:
            return False
    return True


def routed_to_eval(overrides: Sequence[str], eval_base: DictConfig, sections: set[str]) -> list[str]:
    """The shared overrides the evaluation also takes: every ``eval.*`` one (a typo stops there), and of the other
    sections only keys the eval config has (engine, tools, reward, chat template), so the RL model is evaluated on
    the engine and tools it trained with while training-only keys (optimizer, rollout.n, ...) stay with RL."""
    out = []
    for o in overrides:
        key = override_key(o)
        top = key.split(".", 1)[0]
        if top not in sections or key == "actor_rollout_ref.model.path":
            continue
        if top == "eval" or has_key(eval_base, key):
            out.append(o)
    return out


def check_rl_files(cfg: DictConfig) -> list[Path]:
    """The RL prompt files a ``rl_data: files`` preset trains and validates on; a missing one stops the run
    before any model is built, naming the key and the fix."""
    found = []
    for key in ("train_files", "val_files"):
        value = cfg.data[key]
        if value is None:
            if key == "train_files":
                raise ConfigError("data.train_files is not set: give data.train_files=PATH (verl parquet)")
            continue
        for path in ([value] if isinstance(value, str) else list(value)):
            p = Path(str(path)).expanduser()
            if not p.is_file():
                raise ConfigError(f"data.{key}={path}: no such file{missing_file_hint(path)}; or give "
                                  f"data.{key}=PATH")
            found.append(p)
    return found


def check_sft_file(overrides: Sequence[str], train_file: str) -> None:
    """A ``rl_data: files`` preset has no synthetic demonstrations: its SFT stage needs a trajectory file, given
    among ``overrides``; ``train_file`` is its value as the SFT stage's composed config resolves it."""
    if override_value(overrides, "sft.train_file") is None:
        raise ConfigError("sft.train_file is not set: this preset's cold start trains on recorded trajectories; give "
                          "sft.train_file=PATH (ShareGPT or messages .json/.jsonl/.parquet, e.g. ARPO-SFT-54K) or "
                          "sft.out_dir=DIR holding a cold-start checkpoint made elsewhere")
    if not Path(train_file).expanduser().is_file():
        raise ConfigError(f"sft.train_file={train_file}: no such file{missing_file_hint(train_file)}; or give "
                          f"the SFT trajectory file's path")



def has_checkpoint(folder: Path) -> bool:
    """An HF checkpoint's weights: one file, or shards with their index (7B checkpoints are saved sharded)."""
    return (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists()


#: the RL model an evaluation folder's samples were made with (the pipeline writes it there)
MODEL_STAMP = "pipeline_model.json"


def weights_fingerprint(model_dir: Path, edge_bytes: int = 4 << 20) -> dict[str, str]:
    """Per weight file its size and a hash of its first and last ``edge_bytes``: seconds at 7B, and a trained
    model differs there (every tensor moves under AdamW), while a re-export of the same weights does not."""
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        h = hashlib.sha256(str(size).encode())
        with f.open("rb") as fh:
            h.update(fh.read(edge_bytes))
            fh.seek(max(0, size - edge_bytes))
            h.update(fh.read(edge_bytes))
        out[f.name] = h.hexdigest()
    return out


def claim_eval_dir(run_dir: Path, model_dir: Path, force: bool) -> None:
    """Samples in ``run_dir`` resume only for the same RL model: a rerun after more training would otherwise report
    the old model's answers. ``force`` starts the folder afresh; a different model without it stops the run."""
    stamp_path = run_dir / MODEL_STAMP
    stamp = {"model": str(model_dir), "weights": weights_fingerprint(model_dir)}
    if force and run_dir.exists():
        shutil.rmtree(run_dir)
    elif stamp_path.is_file() and json.loads(stamp_path.read_text()) != stamp:
        raise ConfigError(f"{run_dir} holds samples of another RL model than {model_dir} now is; rerun with --force "
                          f"to evaluate it afresh, or give another eval.method or eval.seed to keep both")
    run_dir.mkdir(parents=True, exist_ok=True)
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")


def run_eval(cfg: DictConfig) -> dict[str, Any]:
    """``python -m arpo.eval`` with the composed config; resumes a killed evaluation from its samples."""
    from arpo.evaluation.evaluate import evaluate, print_summary

    summary = evaluate(cfg)
    print_summary(summary)
    return summary


def eval_digest(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Per benchmark mean accuracy and sample count, for the pipeline's summary (the rest is in the run dir)."""
    return {"method": summary.get("method"), "run_dir": str(run_dir),
            "benchmarks": {b: {"acc": s["acc"]["mean"], "samples": s["num_samples"]}
                           for b, s in summary.get("benchmarks", {}).items()}}


def write_tables(eval_dir: Path, out_dir: Path, reference: str | None = None) -> dict[str, Path]:
    """``python -m arpo.tables --runs <eval_dir> --out <out_dir> [--reference FILE]``: the paper's tables over
    every run there, with the reported rows of ``reference`` after ours."""
    from arpo.evaluation.tables import make_tables

    written = make_tables([str(eval_dir)], out_dir, reference=reference)
    logger.info("tables written: %s", ", ".join(sorted(p.name for p in written.values())))
    return written
