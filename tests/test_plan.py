"""The memory planner (arpo/plan/) on Qwen2.5-7B's real shapes, built on the meta device: no weights are loaded."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from arpo.config import ConfigError, load_config
from arpo.plan import build_plan, check_config, model_shapes, step_seconds
from arpo.plan.memory import CUDA_CONTEXT_BYTES, GIB, layer_activation_bytes, micro_tokens, training_activation_bytes
from arpo.plan.settings import PlanSettings

QWEN7B = Path(__file__).parent / "fixtures" / "models" / "qwen2.5-7b"
UTIL = "actor_rollout_ref.rollout.gpu_memory_utilization"


def paper_overrides() -> list[str]:
    """The RL stage's overrides of the paper's preset (configs/pipeline/paper_qwen2.5_7b.yaml, which
    experiments/paper_qwen7b.sh runs), the cold-start checkpoint being the 7B config fixture."""
    from arpo.pipeline import Pipeline

    return Pipeline("/nonexistent/paper-plan", "paper_qwen2.5_7b",
                    [f"sft.out_dir={QWEN7B}"]).stage_overrides("arpo_trainer")


def paper_cfg(*extra: str):
    return load_config("arpo_trainer", paper_overrides() + list(extra))


def test_qwen7b_meta_model_has_the_published_parameter_count():
    m = model_shapes(str(QWEN7B))
    assert m.numel == 7_615_616_512
    assert m.root_numel + m.layers * m.layer_numel == m.numel
    assert m.head_numel == m.vocab * m.hidden  # untied head
    assert (m.kv_heads, m.head_dim, m.layers) == (4, 128, 28)


@pytest.mark.parametrize("world_size", [6, 8])
def test_fsdp2_shards_of_the_meta_model_hold_what_the_planner_counts(world_size):
    """fully_shard per decoder layer and the root, on the meta device over a fake process group: rank 0's local
    shards (dim 0 padded to the world size) are the elements the planner gives each rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, AutoModelForCausalLM

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(QWEN7B))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = sum(p.to_local().numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    m = model_shapes(str(QWEN7B))
    assert local == m.shard_numel(world_size)
    assert local >= m.numel / world_size
    plan = build_plan(paper_cfg(f"trainer.n_gpus_per_node={world_size}"), 80 * GIB)
    states = dict(plan.gpu_tables[0].rows)[f"actor fp32 weights + AdamW m, v (shard 1/{world_size})"]
    assert states[0] == 12 * local  # fp32 weights, AdamW m and v


def test_paper_run_fits_eight_80gb_gpus(capsys):
    from arpo.plan.__main__ import main

    assert main(["--gpu-memory-gb", "80", "--cost"] + paper_overrides()) == 0
    out = capsys.readouterr().out
    assert "per training GPU, with its vLLM replica" in out and "\nfits\n" in out and "predicted seconds" in out
    plan = build_plan(paper_cfg(), 80 * GIB)
    assert plan.fits
    table = plan.gpu_tables[0]
    peak, _ = table.peak()
    assert peak <= 80 * GIB
    # vLLM's rule: gpu_memory_utilization x GPU memory is the engine's whole budget
    # free_cache_engine null: on when colocated on GPUs, so the replica sleeps through the update
    assert dict(table.rows)["vLLM replica (0.6 x GPU; asleep after generation)"][0] == 0.6 * 80 * GIB
    e = plan.engine
    m = plan.shapes
    assert e.kv_bytes_per_token == 2 * m.layers * m.kv_heads * m.head_dim * 2  # K and V, bf16
    assert e.sequences == int(e.kv_cache // e.kv_bytes_per_token) // 5632 >= 1
    # num_replicas null: one replica per tensor-parallel group of training GPUs; without GPUs one
    per_gpu = build_plan(paper_cfg("actor_rollout_ref.rollout.num_replicas=null"), 80 * GIB)
    assert per_gpu.settings.replicas == 8 and dict(per_gpu.host)["8 engine process(es)"] > 0
    assert build_plan(paper_cfg("actor_rollout_ref.rollout.num_replicas=null"), None).settings.replicas == 1


def test_help_prints_usage_and_exits_0(capsys):
    from arpo.plan.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--gpu-memory-gb" in capsys.readouterr().out


def test_paper_run_at_util_09_with_a_reference_on_the_training_gpus_stops_with_one_line():
    from arpo.config import cli_main
    from arpo.plan.__main__ import main

    extra = [f"{UTIL}=0.9", "actor_rollout_ref.actor.use_kl_loss=true"]
    with pytest.raises(ConfigError) as e:
        main(["--gpu-memory-gb", "80"] + paper_overrides() + extra)
    line = str(e.value)
    assert "\n" not in line and f"{UTIL}=" in line and "per training GPU" in line
    with pytest.raises(SystemExit) as exit_:
        cli_main(lambda: main(["--gpu-memory-gb", "80"] + paper_overrides() + extra))
    assert exit_.value.code == 2
    # each key the line names makes the plan fit on its own
    named = [w.rstrip(",") for w in line.split("set one of ")[1].split(" (")[0].split(", ")]
    for change in named:
        assert build_plan(paper_cfg(*extra, change), 80 * GIB).fits, change


def test_start_up_check_stops_an_overfull_gpu_run(monkeypatch):
    """What arpo/main_arpo.py's validate_config runs: on a machine with an 80 GB GPU the same run stops there."""
    class Props:
        total_memory = 80 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr("arpo.plan.check._physical_ram", lambda: 1024 * GIB)  # an 8-GPU node's RAM
    check_config(paper_cfg())  # fits: no error
    with pytest.raises(ConfigError, match=UTIL.replace(".", r"\.")):
        check_config(paper_cfg(f"{UTIL}=0.9", "actor_rollout_ref.actor.use_kl_loss=true"))


def test_free_cache_engine_frees_the_gpu_during_the_update_and_costs_host_ram():
    kept = build_plan(paper_cfg(f"{UTIL}=0.9", "actor_rollout_ref.rollout.free_cache_engine=false"), 80 * GIB)
    asleep = build_plan(paper_cfg(f"{UTIL}=0.9"), 80 * GIB)  # null: on, colocated on GPUs
    phases = kept.gpu_tables[0].phases
    update = phases.index("actor update")
    assert asleep.gpu_tables[0].totals()[update] < kept.gpu_tables[0].totals()[update] - 60 * GIB
    # the push wakes the engine's weights only; its KV cache (and the rest of its budget) comes back after it
    sync = phases.index("weight sync")
    engine = asleep.engine
    woken = CUDA_CONTEXT_BYTES + engine.weights
    assert asleep.gpu_tables[0].totals()[sync] == pytest.approx(kept.gpu_tables[0].totals()[sync] - engine.budget + woken)
    offload = dict(asleep.host)["sleeping engines' weights offloaded (8 x 2 B/param)"]
    assert offload == asleep.settings.replicas * asleep.shapes.numel * 2


def test_gradient_checkpointing_keeps_one_layer_of_activations():
    m = model_shapes(str(QWEN7B))
    s = PlanSettings.from_config(paper_cfg(), gpu=True)
    tokens = micro_tokens(s, s.micro_batch)
    assert tokens == 2 * (1536 + 4096)
    full = training_activation_bytes(m, s, tokens, checkpointing=False)
    kept = training_activation_bytes(m, s, tokens, checkpointing=True)
    per_layer = layer_activation_bytes(m, s) * tokens
    assert full - kept == pytest.approx((m.layers - 1) * per_layer - m.layers * tokens * 2 * m.hidden)


def test_adamw_step_temporary_counts_only_beyond_what_backward_freed():
    """torch's foreach AdamW holds one temporary of the trained fp32 shard during the step, after backward freed
    the gathered params, unsharded grads, activations and head chunks (seen on an H200: the 7B cut to 8 layers
    on one GPU peaked 2 GiB above the backward's total, at the step)."""
    eight = build_plan(paper_cfg("trainer.n_gpus_per_node=8"), 80 * GIB).gpu_tables[0]
    assert not any(name.startswith("AdamW step") for name, _ in eight.rows)  # 1/8 shard < the freed transients
    one = build_plan(paper_cfg("trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"),
                     80 * GIB).gpu_tables[0]
    rows = dict(one.rows)
    step = rows["AdamW step temporary (one trained fp32 shard, beyond what backward freed)"]
    update = one.phases.index("actor update")
    freed = sum(v[update] for name, v in one.rows
                if name.startswith(("FSDP2", "update activations", "log-prob head")))
    assert step[update] == pytest.approx(rows["actor fp32 gradient shard"][update] - freed)
    assert step[update] > 0 and sum(step) == step[update]


def test_cpu_plan_blocks_only_a_clearly_oversized_run(tmp_path, monkeypatch):
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512).save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_config(load_config("arpo_trainer", [f"actor_rollout_ref.model.path={tmp_path}"]))  # the tiny CPU run
    plan = build_plan(load_config("arpo_trainer", [f"actor_rollout_ref.model.path={QWEN7B}"]), None)
    assert plan.engine is None and not plan.gpu_tables
    assert plan.host_bytes > 16 * model_shapes(str(QWEN7B)).numel  # AdamW states + fp32 weights of 7.6B params
    # a CPU engine reloads its largest layer (the 152,064 x 3,584 embedding) twice over: materialised and repacked
    reload = [b for name, b in plan.host if name.startswith("weight sync: largest layer reloaded")]
    assert reload == [plan.settings.replicas * 2 * 152064 * 3584 * plan.settings.engine_bytes]
    monkeypatch.setattr("arpo.plan.check._physical_ram", lambda: 24 * GIB)
    with pytest.raises(ConfigError, match="host RAM") as e:
        check_config(load_config("arpo_trainer", [f"actor_rollout_ref.model.path={QWEN7B}"]))
    assert "\n" not in str(e.value) and "gpu_memory_utilization" not in str(e.value)  # no GPU advice on a CPU


def test_cost_model_scales_with_its_stated_rates():
    from arpo.plan.cost import Throughputs

    plan = build_plan(paper_cfg(), 80 * GIB)
    base = step_seconds(plan)
    faster = step_seconds(plan, Throughputs(training_mfu=0.6))
    assert faster["update"] == pytest.approx(base["update"] / 2)
    assert base["step"] == pytest.approx(sum(base[k] for k in ("generation", "old_log_probs", "update",
                                                               "weight_sync")))
    assert base["decoded_tokens"] == 128 * 16 * 2048
    assert math.isfinite(base["decode_tokens_per_s_per_gpu"]) and base["decode_tokens_per_s_per_gpu"] > 0


def test_lora_plans_no_reference_copy_and_adapter_only_gradients_and_adamw():
    """With LoRA the reference is the actor's base model (no reference copy, no reference process) and only the
    adapters, counted as peft injects them, have gradients and AdamW state."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from arpo.trainer.lora import apply_lora

    kl = [f"{UTIL}=0.9", "actor_rollout_ref.actor.use_kl_loss=true"]
    full = build_plan(paper_cfg(*kl), 80 * GIB)
    lora = build_plan(paper_cfg(*kl, "actor_rollout_ref.model.lora_rank=64"), 80 * GIB)
    assert full.settings.reference and not lora.settings.reference
    assert not any("reference" in name for name, _ in lora.gpu_tables[0].rows + lora.host)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(QWEN7B))
    apply_lora(model, 64, 16, "all-linear")
    m = lora.shapes
    assert m.lora_numel(64, "all-linear") == sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert m.lora_numel(64, ["q_proj", "v_proj"]) == 64 * m.layers * (2 * m.hidden + m.heads * m.head_dim
                                                                        + m.kv_hidden)
    shard, adapters = m.shard_numel(8), math.ceil(m.lora_numel(64, "all-linear") / 8)
    i, j = full.gpu_tables[0].phases.index("actor update"), lora.gpu_tables[0].phases.index("actor update")
    # gone: AdamW m, v and the gradient of the base (12 B/param), the reference's weights (b B/param) and its
    # process's CUDA context, and FSDP2's unsharded gradients of the root and a layer (the frozen base has none;
    # one layer's adapters instead); added: the adapters' weights, AdamW and gradient (16 B/param)
    b = full.settings.compute_bytes
    unsharded = m.root_numel * b + m.layer_numel * (b + 4) - m.lora_numel(64, "all-linear") / m.layers * (b + 4)
    saved = (12 + b) * shard + CUDA_CONTEXT_BYTES - 16 * adapters + unsharded
    assert full.gpu_tables[0].totals()[i] - lora.gpu_tables[0].totals()[j] == pytest.approx(saved)
    assert not full.fits and lora.fits  # the run that needed use_kl_loss=false fits with LoRA


def test_keeping_layers_gathered_through_the_update_costs_all_but_two_layers_on_each_gpu():
    m = model_shapes(str(QWEN7B))
    resharded = build_plan(paper_cfg(), 80 * GIB)
    kept = build_plan(paper_cfg("actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"), 80 * GIB)
    assert not kept.settings.reshard_after_forward and resharded.settings.reshard_after_forward
    phases = kept.gpu_tables[0].phases
    extra = [a - b for a, b in zip(kept.gpu_tables[0].totals(), resharded.gpu_tables[0].totals())]
    assert extra[phases.index("actor update")] == pytest.approx((m.layers - 2) * m.layer_numel * 2)  # bf16
    assert all(x == 0 for p, x in zip(phases, extra) if p != "actor update")
