"""tests/prebuild.py builds the cached SFT model with more tool threads and sandbox workers than the defaults (a
faster build): that is only the model the main job makes if nothing else changes and the demonstrations do not
depend on those counts."""

from __future__ import annotations

import pandas as pd
from omegaconf import OmegaConf

from tests import prebuild


def _demonstrations(cfg, rows: pd.DataFrame) -> list:
    from arpo.chat_templates import tokenizer_for
    from arpo.data.sft_demonstrations import iter_demonstrations
    from tools.registry import load_tools

    s = cfg.sft
    tools = load_tools(cfg.tools)
    try:
        return list(iter_demonstrations(rows, tokenizer_for(cfg), tools, s.seed, s.demo.skip_tool_prob,
                                        s.demo.wrong_tool_prob, s.tool_workers, s.demo.verbose_think))
    finally:
        for tool in tools.values():
            tool.close()


def test_sft_build_threads_change_no_demonstration(synthetic_dir, tiny_model_dir):
    from arpo.config import load_config

    paths = [f"synthetic.out_dir={synthetic_dir}", f"actor_rollout_ref.model.path={tiny_model_dir}"]
    default = load_config("sft", paths)
    build = load_config("sft", paths + list(prebuild.SFT_BUILD_OVERRIDES))
    assert (default.sft.tool_workers, build.sft.tool_workers) == (1, 8)
    # the override addresses the sandbox by its place in configs/tools/synthetic.yaml
    assert build.tools[1].class_name == "tools.python_sandbox.tool.PythonTool"
    assert build.tools[1].config.max_workers == 8
    # the overrides touch the two thread counts and nothing else of the config
    plain = OmegaConf.to_container(build, resolve=True)
    plain["sft"]["tool_workers"] = default.sft.tool_workers
    del plain["tools"][1]["config"]["max_workers"]
    assert plain == OmegaConf.to_container(default, resolve=True)

    rows = pd.read_parquet(synthetic_dir / "train.parquet").iloc[:24]
    demos = _demonstrations(default, rows)
    assert len(demos) == 24 and {kind for _, kind in demos} >= {"gold"}
    assert _demonstrations(build, rows) == demos
