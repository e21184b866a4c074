"""experiments/plot_trainer_speed.py draws the committed trainer-speed results and reports their means."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys

from arpo.config import REPO_ROOT


def test_plot_draws_the_committed_results_and_reports_the_mean_update(tmp_path):
    folder = tmp_path / "trainer_speed"
    shutil.copytree(REPO_ROOT / "experiments" / "results" / "trainer_speed", folder)
    (folder / "update_seconds.png").unlink()
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "plot_trainer_speed.py"), str(folder)],
                       capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(r.stdout)
    assert (folder / "update_seconds.png").stat().st_size > 10_000
    walls = [json.loads(p.read_text())["results"][0]["fsdp2_2_ranks"]["update_policy_s"]
             for p in sorted(folder.glob("reshard_after_forward_*_false.json"))]
    assert len(walls) == 5 and out["reshard_false_mean_wall_s"] == round(statistics.mean(walls), 1)
