"""Draw a folder of ``experiments/bench_trainer.py`` JSON results: the update's seconds by rank layout
(``rank_layout.json``, ``--settings all``) and by ``fsdp_config.reshard_after_forward`` (``reshard_after_forward_NN_
{true,false}.json``, one run each, alternating), wall and the busiest rank's CPU seconds.

    python experiments/plot_trainer_speed.py experiments/results/trainer_speed      # writes update_seconds.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

LAYOUTS = {"single_process": "1 rank,\n2 threads", "single_process_one_share": "1 rank,\n1 thread",
           "fsdp2_2_ranks": "2 FSDP2 ranks,\n1 thread each"}


def reshard_runs(folder: Path) -> dict[str, list[tuple[float, float]]]:
    """(wall s, busiest rank CPU s) of each run's update, by the key's value, in run order."""
    runs: dict[str, list[tuple[float, float]]] = {"true": [], "false": []}
    for path in sorted(folder.glob("reshard_after_forward_*_*.json")):
        r = json.loads(path.read_text())["results"][0]["fsdp2_2_ranks"]
        runs[path.stem.rsplit("_", 1)[1]].append((r["update_policy_s"], r["update_policy_cpu_s"]))
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = json.loads((args.folder / "rank_layout.json").read_text())["results"][0]
    runs = reshard_runs(args.folder)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [k for k in LAYOUTS if k in layout]
    left.bar(range(len(names)), [layout[k]["update_policy_s"] for k in names], label="wall")
    left.bar(range(len(names)), [layout[k]["update_policy_cpu_s"] for k in names],
             width=0.4, label="CPU s of the busiest rank (all its threads)")
    left.set_xticks(range(len(names)), [LAYOUTS[k] for k in names])
    left.set_ylabel("update seconds (one step's trees)")
    left.set_title("rank layout")
    left.legend(fontsize=8)
    for x, (value, points) in enumerate(runs.items()):
        right.scatter([x] * len(points), [w for w, _ in points], label="wall" if x == 0 else None, color="C0")
        right.scatter([x + 0.15] * len(points), [c for _, c in points], label="busiest rank CPU" if x == 0 else None,
                      color="C1")
        if points:
            right.hlines(statistics.mean(w for w, _ in points), x - 0.2, x + 0.2, color="C0")
    right.set_xticks(range(len(runs)), [f"reshard_after_forward\n{v}" for v in runs])
    right.set_title("2 FSDP2 ranks: layers kept gathered (false) or not")
    right.legend(fontsize=8)
    fig.tight_layout()
    out = args.folder / "update_seconds.png"
    fig.savefig(out, dpi=120)
    print(json.dumps({"png": str(out), **{f"reshard_{v}_mean_wall_s": round(statistics.mean(w for w, _ in pts), 1)
                                          for v, pts in runs.items() if pts}}))


if __name__ == "__main__":
    main()
