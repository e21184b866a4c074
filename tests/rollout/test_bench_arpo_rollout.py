"""experiments/bench_arpo_rollout.py still runs and prints what its docstring promises (scripted engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_prints_every_mode_and_ratio():
    cmd = [sys.executable, str(REPO / "experiments" / "bench_arpo_rollout.py"), "--prompts", "3", "--n", "4",
           "--initial", "2", "--repeats", "2", "--latency-ms", "0", "--token-latency-ms", "0",
           "--max-response-length", "200", "--modes", "arpo_fill_duplicate", "arpo_speculative_fill",
           "arpo_no_fill_prediction",
           "--speculative-fill", "1", "--tool-latency-ms", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["engine"] == "scripted" and result["budget_m"] == 4
    for mode in ("arpo", "single", "arpo_fill_duplicate", "arpo_speculative_fill", "arpo_no_fill_prediction"):
        m = result[mode]
        assert len(m["wall_s_all"]) == 2 and m["wall_s_min"] == min(m["wall_s_all"]) > 0
        assert m["tokens/generated"] > 0 and m["requests"] > 0 and m["tokens_per_s"] > 0
        assert 0 <= m["engine_idle_fraction"] < 1 and m["requests_in_flight_mean"] >= 1
        assert 0 <= m["last_start_frac"] <= 1 and 0 <= m["tail_after_half_done_frac"] <= 1
        # the engine's work: decoded plus prefilled tokens (the scripted engine has a prefix cache, no engine core)
        assert m["work_tokens_median"] > m["tokens/generated"] * 0.5 and "engine_cpu_ms_per_work_token" not in m
    assert result["single"]["branches"] == 0
    assert result["single"]["tool_calls/total"] > 0 and result["single"]["rollout_tools"] >= 0.005
    assert result["arpo_no_fill_prediction"]["fill_predicted"] == 0
    for mode in ("arpo", "arpo_fill_duplicate", "arpo_speculative_fill", "arpo_no_fill_prediction"):
        assert result[f"{mode}_over_single_wall_min"] == result[mode]["wall_s_min"] / result["single"]["wall_s_min"]
        assert result[f"{mode}_over_single_wall_paired_median"] > 0
        assert result[f"{mode}_over_single_work"] > 0
