"""The RL prompt dataset and its stateful loader (real synthetic parquet, the tiny model's real tokenizer)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from arpo.data.rl_dataset import RLDataset, StatefulPromptLoader, create_rl_dataloaders
from tests.trainer.workers_helpers import small_model  # noqa: F401


def _indices(rows):
    return [r["index"] for r in rows]


@pytest.fixture(scope="module")
def tokenizer(small_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(small_model))


@pytest.fixture(scope="module")
def dataset(synthetic_dir, tokenizer):
    return RLDataset(str(synthetic_dir / "val.parquet"), tokenizer, max_prompt_length=4096)


def test_rows_carry_templated_prompt_ids_and_dataset_columns(dataset, synthetic_dir, tokenizer):
    df = pd.read_parquet(synthetic_dir / "val.parquet")
    assert len(dataset) == len(df)
    row = dataset[3]
    messages = [dict(m) for m in df["prompt"].iat[3]]
    assert row["raw_prompt"] == messages
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert row["raw_prompt_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert row["data_source"] == df["data_source"].iat[3]
    assert row["reward_model"]["ground_truth"] == df["reward_model"].iat[3]["ground_truth"]
    assert row["extra_info"]["question"] == df["extra_info"].iat[3]["question"]
    assert row["agent_name"] == df["agent_name"].iat[3]

    rows = dataset.select([3, 0])
    assert [r["index"] for r in rows] == [3, 0]
    assert rows[0]["raw_prompt_ids"] == row["raw_prompt_ids"]
    assert {"data_source", "reward_model", "extra_info", "agent_name", "raw_prompt"} <= set(rows[1])
    rows[0]["uid"] = "x"  # consumers may add keys without touching the dataset
    assert "uid" not in dataset[3]


def test_overlong_prompts_are_filtered_truncated_or_rejected(synthetic_dir, tokenizer, dataset):
    lengths = sorted(len(r["raw_prompt_ids"]) for r in dataset.rows)
    limit = lengths[len(lengths) // 2]
    filtered = RLDataset(str(synthetic_dir / "val.parquet"), tokenizer, max_prompt_length=limit)
    assert len(filtered) == sum(n <= limit for n in lengths) < len(dataset)
    assert max(len(r["raw_prompt_ids"]) for r in filtered.rows) <= limit

    left = RLDataset(str(synthetic_dir / "val.parquet"), tokenizer, max_prompt_length=limit,
                     filter_overlong_prompts=False, truncation="left")
    assert len(left) == len(dataset)
    longest = max(range(len(dataset)), key=lambda i: len(dataset[i]["raw_prompt_ids"]))
    assert left[longest]["raw_prompt_ids"] == dataset[longest]["raw_prompt_ids"][-limit:]

    with pytest.raises(ValueError, match="data.max_prompt_length"):
        RLDataset(str(synthetic_dir / "val.parquet"), tokenizer, max_prompt_length=limit,
                  filter_overlong_prompts=False, truncation="error")
    with pytest.raises(ValueError, match="data.truncation"):
        RLDataset(str(synthetic_dir / "val.parquet"), tokenizer, max_prompt_length=limit, truncation="middle")
    with pytest.raises(FileNotFoundError, match="data.train_files"):
        RLDataset(str(synthetic_dir / "nope.parquet"), tokenizer, max_prompt_length=limit)


def test_shuffle_is_seeded_per_epoch_and_covers_every_prompt(dataset):
    loader = StatefulPromptLoader(dataset, batch_size=5, shuffle=True, seed=3)
    n_batches = len(loader)
    assert n_batches == len(dataset) // 5
    epoch0 = [_indices(b) for b in loader]
    epoch1 = [_indices(b) for b in loader]
    assert len(epoch0) == n_batches and loader.epoch == 2
    flat0 = np.concatenate(epoch0)
    assert len(set(flat0.tolist())) == len(flat0) == n_batches * 5
    assert epoch0 != epoch1
    again = StatefulPromptLoader(dataset, batch_size=5, shuffle=True, seed=3)
    assert [_indices(b) for b in again] == epoch0
    other_seed = StatefulPromptLoader(dataset, batch_size=5, shuffle=True, seed=4)
    assert [_indices(b) for b in other_seed] != epoch0


def test_state_dict_resumes_at_the_exact_next_batch_across_epochs(dataset):
    loader = StatefulPromptLoader(dataset, batch_size=4, shuffle=True, seed=1)
    per_epoch = len(loader)
    it = iter(loader)
    for _ in range(per_epoch - 1):
        next(it)
    state = loader.state_dict()
    expected = [_indices(loader.next_batch()) for _ in range(3)]  # crosses into epoch 1
    assert loader.epoch == 1

    resumed = StatefulPromptLoader(dataset, batch_size=4, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.batch_index) == (0, per_epoch - 1)
    got = [_indices(resumed.next_batch()) for _ in range(3)]
    assert got == expected
    assert resumed.state_dict() == loader.state_dict()

    with pytest.raises(ValueError, match="batch_size was 4, now 5"):
        StatefulPromptLoader(dataset, batch_size=5, shuffle=True, seed=1).load_state_dict(state)


def test_create_rl_dataloaders_from_config(synthetic_dir, tokenizer):
    cfg = {"data": {"train_files": [str(synthetic_dir / "val.parquet")], "val_files": str(synthetic_dir / "test.parquet"),
                    "train_batch_size": 8, "max_prompt_length": 4096, "seed": 2, "val_batch_size": None}}
    train, val = create_rl_dataloaders(cfg, tokenizer)
    assert train.batch_size == 8 and train.shuffle and train.drop_last
    first = train.next_batch()
    assert len(first) == 8 and train.steps_per_epoch == len(train.dataset) // 8
    assert val is not None and not val.shuffle
    val_batches = list(val)
    assert len(val_batches) == 1 and _indices(val_batches[0]) == list(range(len(val.dataset)))
    assert _indices(val.all_rows()) == list(range(len(val.dataset)))
    with pytest.raises(ValueError, match="data.train_files"):
        create_rl_dataloaders({"data": {}}, tokenizer)


def test_hermes_runs_get_the_tools_block_in_every_prompt(synthetic_dir, small_model):
    """With tool schemas (tools.format hermes) the chat template writes its tools block into each prompt: the
    model reads there which functions it may call."""
    from arpo.chat_templates import load_tokenizer
    from arpo.config import REPO_ROOT
    from tools.registry import load_tools

    qwen = load_tokenizer(small_model, "qwen2.5")
    tools = load_tools(REPO_ROOT / "configs" / "tools" / "python.yaml")
    cfg = {"data": {"train_files": [str(synthetic_dir / "val.parquet")], "train_batch_size": 2,
                    "max_prompt_length": 8192}}
    plain, _ = create_rl_dataloaders(cfg, qwen)
    hermes, _ = create_rl_dataloaders(cfg, qwen, tools.schemas())
    without, with_tools = (qwen.decode(loader.dataset.rows[0]["raw_prompt_ids"]) for loader in (plain, hermes))
    assert "<tools>" not in without and "<tools>" in with_tools
    assert all(f'"name": "{s["function"]["name"]}"' in with_tools for s in tools.schemas())
    tools.close()
