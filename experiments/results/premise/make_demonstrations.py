"""Tool-use trajectories of the synthetic benchmark in OpenAI ``messages`` form, for the entropy probe.

Each question's gold plan is written out as the cold-start SFT writes its demonstrations (arpo/sft.py
``build_demonstration``: short thoughts, the tool calls, real tool results from BM25 search and the Python
sandbox, the boxed answer), with no deliberate mistakes. They are the trajectories an SFT-trained policy imitates,
so probing a model on them asks how uncertain it is right after real tool results of this benchmark.

    python experiments/results/premise/make_demonstrations.py --data DIR --split val --limit 64 --out FILE.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="synthetic benchmark folder (python -m arpo.data.synthetic)")
    parser.add_argument("--split", default="val")
    parser.add_argument("--limit", type=int, default=64, help="questions (the split's first)")
    parser.add_argument("--out", required=True, help="output JSONL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose-think", action="store_true",
                        help="thoughts restate the query and the last result's fact (sft.demo.verbose_think)")
    args = parser.parse_args()

    import pandas as pd

    from arpo.config import load_config
    from arpo.data.sft_demonstrations import build_demonstration
    from tools.registry import load_tools

    tools = load_tools(load_config("sft", [f"synthetic.out_dir={args.data}"]).tools)
    df = pd.read_parquet(Path(args.data) / f"{args.split}.parquet").head(args.limit)
    rows = []
    try:
        for i, row in enumerate(df.itertuples(index=False)):
            segs, _ = build_demonstration(row.extra_info["question"], str(row.reward_model["ground_truth"]),
                                          json.loads(row.extra_info["plan"]), tools, random.Random(f"{args.seed}-{i}"),
                                          skip_tool_prob=0.0, wrong_tool_prob=0.0, verbose_think=args.verbose_think)
            turns = [{"role": "assistant" if s.is_model else "tool", "content": s.text} for s in segs]
            rows.append({"messages": [dict(m) for m in row.prompt] + turns, "data_source": row.data_source})
    finally:
        for tool in tools.values():
            tool.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} trajectories to {out}")


if __name__ == "__main__":
    main()
