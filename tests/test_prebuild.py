"""tests/prebuild.py builds the cached SFT model with more tool threads than configs/sft.yaml's (a faster build):
that is only the model the main job makes if the demonstrations do not depend on the thread count."""

from __future__ import annotations

import pandas as pd

from tests import prebuild


def test_sft_build_threads_change_no_demonstration(synthetic_dir, tiny_model_dir):
    from arpo.chat_templates import tokenizer_for
    from arpo.config import load_config
    from arpo.sft import iter_demonstrations
    from tools.registry import load_tools

    assert prebuild.SFT_BUILD_OVERRIDES == ("sft.tool_workers=4",)
    cfg = load_config("sft", [f"synthetic.out_dir={synthetic_dir}", f"actor_rollout_ref.model.path={tiny_model_dir}"])
    s = cfg.sft
    tokenizer = tokenizer_for(cfg)
    rows = pd.read_parquet(synthetic_dir / "train.parquet").iloc[:8]
    tools = load_tools(cfg.tools)
    try:
        demos = {workers: list(iter_demonstrations(rows, tokenizer, tools, s.seed, s.demo.skip_tool_prob,
                                                   s.demo.wrong_tool_prob, workers, s.demo.verbose_think))
                 for workers in (s.tool_workers, 4)}
    finally:
        for tool in tools.values():
            tool.close()
    assert s.tool_workers == 1 and len(demos[1]) == 8
    assert demos[1] == demos[4]
    assert {kind for _, kind in demos[1]} >= {"gold"}
