#!/usr/bin/env bash
# The trainer (FSDP2 on one GPU: nccl, bf16) and the HF rollout engine on CUDA, without Ray or vLLM: what a bare
# single-GPU machine with only torch + transformers (+ omegaconf) runs. One JSON file per bench in OUT_DIR, the
# benches' logs in OUT_DIR/stderr.log. Weights are drawn at random (timing and memory, not numerics).
#
#   experiments/bench_gpu.sh CONFIG_DIR OUT_DIR     # CONFIG_DIR: a checkpoint's config.json and tokenizer files
#   DEVICE=cpu SMOKE=1 experiments/bench_gpu.sh CONFIG_DIR OUT_DIR   # the same calls on tiny shapes, CPU
#
# Shapes: 32 rows (4 prompts x M=8), prompts of 120-150 tokens, responses of 300-500 (the SmolLM2 preset's ARPO step), and
# the recorded SmolLM2 ARPO trees (experiments/results/smollm2_advantage/rollouts) packed and unpacked.
set -uo pipefail
cfg=$1 out=$2
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
mkdir -p "$out"
cd "$(dirname "$0")/.."
if [[ ${SMOKE:-0} == 1 ]]; then
  shape=(--rows 4 --prompt-len 16 --response-len 24) micros=2 steps=(--steps 1 --warmup 0) tree_rows=8 gen=(--prompts 2 --prompt-len 16 --max-tokens 8 --repeats 1)
else
  shape=(--rows 32 --prompt-len 120-150 --response-len 300-500) micros=4,8,16,32 steps=(--steps 2 --warmup 1) tree_rows=32 gen=(--prompts 32 --prompt-len 128 --max-tokens 256 --repeats 2)
fi
common=(--model "$cfg" --random-init --no-ray --ranks 1 --settings multi --device "$device" "${steps[@]}")
trees=experiments/results/smollm2_advantage/rollouts/arpo_soft.jsonl
status=0
bench() {  # name, then the command's arguments
  local name=$1; shift
  echo "== $name ($(date +%T))"
  timeout "${BENCH_TIMEOUT:-150}" "$py" "$@" >"$out/$name.json" 2>>"$out/stderr.log" || { echo "FAILED $name"; status=1; }
}
bench trainer_bf16 experiments/bench_trainer.py "${common[@]}" "${shape[@]}" --micro "$micros"
bench trainer_bf16_no_checkpointing experiments/bench_trainer.py "${common[@]}" "${shape[@]}" --micro "${micros##*,}" \
  --set actor_rollout_ref.model.enable_gradient_checkpointing=false
bench trainer_fp32 experiments/bench_trainer.py "${common[@]}" "${shape[@]}" --micro "${micros%%,*}" \
  --set actor_rollout_ref.model.dtype=float32
for packing in true false; do
  bench "trees_packing_$packing" experiments/bench_trainer.py "${common[@]}" --trees "$trees" --prompt-len 200 \
    --rows "$tree_rows" --micro 8 --set actor_rollout_ref.model.tree_packing=$packing
done
model=$out/.random_model
"$py" -c "import sys; sys.path.insert(0, 'experiments'); from pathlib import Path; from bench_trainer import random_init_model; \
random_init_model(Path(sys.argv[1]), Path(sys.argv[2]))" "$cfg" "$model" 2>>"$out/stderr.log"
for dtype in bfloat16 float32; do
  bench "engine_hf_$dtype" experiments/bench_engine.py --model "$model" --backends hf --dtype "$dtype" "${gen[@]}"
done
rm -rf "$model"
exit $status
