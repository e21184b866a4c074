#!/usr/bin/env bash
# The released ARPO 7B reasoning settings (from the ARPO paper / official code, github.com/dongguanting/ARPO) on one 8-GPU node.
# Needs the GPU install (ARPO_REQUIREMENTS=requirements-gpu.txt make install), a Qwen2.5-7B cold-start SFT
# checkpoint at $MODEL, and the ARPO release data at $ARPO_SHARED_DATA. Search replays ARPO's recorded cache
# (tools=arpo_cache); switch to tools=default with a web backend for live search.
# GPU placement (docs/scaling/gpu_cluster.md): colocated (hybrid_engine, the default), so num_replicas null = one
# vLLM replica per training GPU (8: every GPU generates), each asleep while the actor updates (free_cache_engine
# null = on when colocated) and on CUDA graphs (enforce_eager null = off on CUDA). A checkpoint every 10 steps is
# ~91 GB at 7B with the optimizer: the newest 2 are kept (the resume point and one before it). Ray's object store
# holds two weight-sync buckets at once (the bf16 embedding alone is a 1.02 GiB bucket): 4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the SFT checkpoint}"
DATA=${ARPO_SHARED_DATA:-../shared/data/arpo}
.venv/bin/python -m arpo.main_arpo \
  tools=arpo_cache \
  actor_rollout_ref.model.path="$MODEL" \
  data.train_files="$DATA/rl/train_10k.parquet" data.val_files="$DATA/rl/valid.parquet" \
  data.train_batch_size=128 data.max_prompt_length=1536 data.max_response_length=4096 \
  actor_rollout_ref.rollout.n=16 actor_rollout_ref.rollout.arpo.initial_rollouts=8 \
  actor_rollout_ref.rollout.arpo.branching.beam_size=2 actor_rollout_ref.rollout.arpo.branching.branch_probability=0.5 \
  actor_rollout_ref.rollout.arpo.branching.entropy_weight=0.2 actor_rollout_ref.rollout.arpo.tools.call_limit=3 \
  actor_rollout_ref.rollout.arpo.tools.workers=64 actor_rollout_ref.rollout.arpo.tools.timeout_s=120 \
  actor_rollout_ref.rollout.max_model_len=5632 actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.cpu_kvcache_space_gb=null \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  algorithm.adv_estimator=grpo algorithm.advantage_mode=soft \
  trainer.n_gpus_per_node=8 trainer.total_epochs=2 trainer.total_training_steps=null \
  trainer.test_freq=10 trainer.save_freq=10 trainer.max_actor_ckpt_to_keep=2 data.val_max_samples=-1 \
  actor_rollout_ref.rollout.num_replicas=null actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  trainer.experiment_name=qwen7b_arpo trainer.output_dir=outputs/qwen7b_arpo "ray_init.num_cpus=null" \
  ray_init.object_store_memory=4000000000 "$@"
