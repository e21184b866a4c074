#!/usr/bin/env bash
# The premise study: token entropy around tool results, SmolLM2-135M-Instruct and the committed SmolLM2 rollouts.
#   MODEL=<HF dir of SmolLM2-135M-Instruct> [SFT=<make run's models/smollm2-sft>] [RL=<make run's rl/ folder>] \
#       [EVAL=<an arpo.eval run's samples/ folder>] bash experiments/results/premise/run_study.sh
# MODEL: `python -m arpo.models.pretrained base_model.source=smollm2-135m-instruct` converts it (a few minutes).
set -euo pipefail
cd "$(dirname "$0")/../../.."
: "${MODEL:?set MODEL to the converted SmolLM2-135M-Instruct checkpoint directory}"
OUT=experiments/results/premise
WORK=${WORK:-outputs/premise}
PY="nice -n 10 .venv/bin/python"
git rev-parse HEAD > "$OUT/git_sha.txt"

# (a) the committed SmolLM2 RL rollouts (SFT model, 8 ARPO steps): their recorded top-k entropy (no token ids kept)
for variant in arpo_soft arpo_hard grpo; do
  $PY -m arpo.entropy_probe --trajectories experiments/results/smollm2_advantage/rollouts/$variant.jsonl \
      --out "$OUT" --name rollouts_$variant
done

# (b) SmolLM2 zero-shot, teacher-forced over gold tool-use trajectories of the hard synthetic benchmark (val split)
$PY -m arpo.data.synthetic synthetic=hard synthetic.out_dir="$WORK/data"
$PY experiments/results/premise/make_demonstrations.py --data "$WORK/data" --split val --limit 48 \
    --out "$WORK/demos_val.jsonl"
$PY -m arpo.entropy_probe --model "$MODEL" --trajectories "$WORK/demos_val.jsonl" --out "$OUT" \
    --name smollm2_zeroshot_demos --dtype fp32
# (c) the same with verbose thoughts: after each result the model restates the fact it found (free text)
$PY experiments/results/premise/make_demonstrations.py --data "$WORK/data" --split val --limit 32 --verbose-think \
    --out "$WORK/demos_val_verbose.jsonl"
$PY -m arpo.entropy_probe --model "$MODEL" --trajectories "$WORK/demos_val_verbose.jsonl" --out "$OUT" \
    --name smollm2_zeroshot_demos_verbose --dtype fp32
# (d) after make run's SFT, and (e) after its 8 ARPO steps: the same demonstrations teacher-forced, and (e) the RL
# model on its own last training step's rollouts (dumps keep their token ids)
if [[ -n ${SFT:-} ]]; then
  $PY -m arpo.entropy_probe --model "$SFT" --trajectories "$WORK/demos_val.jsonl" --out "$OUT" \
      --name smollm2_sft_demos --dtype fp32
  $PY -m arpo.entropy_probe --model "$SFT" --trajectories "$WORK/demos_val_verbose.jsonl" --out "$OUT" \
      --name smollm2_sft_demos_verbose --dtype fp32
fi
if [[ -n ${RL:-} ]]; then
  RL_MODEL="$RL/hf_model"          # the run's exported final model
  $PY -m arpo.entropy_probe --model "$RL_MODEL" --trajectories "$WORK/demos_val.jsonl" --out "$OUT" \
      --name smollm2_rl_demos --dtype fp32
  last=$(ls "$RL"/rollouts/step_*.jsonl | sort -V | tail -1)
  $PY -m arpo.entropy_probe --model "$RL_MODEL" --trajectories "$last" --out "$OUT" --name smollm2_rl_own_rollouts \
      --dtype fp32
  [[ -n ${SFT:-} ]] && $PY -m arpo.entropy_probe --model "$SFT" --trajectories "$last" --out "$OUT" \
      --name smollm2_sft_on_rl_rollouts --dtype fp32
fi
# (f) trajectories on released benchmarks (an arpo.eval run's samples, e.g. the SFT model on bamboogle + gsm8k),
# scored by every model given: zero-shot, after SFT, after RL
if [[ -n ${EVAL:-} ]]; then
  $PY -m arpo.entropy_probe --model "$MODEL" --trajectories "$EVAL"/*.jsonl --out "$OUT" \
      --name smollm2_zeroshot_released_bamboogle_gsm8k --dtype fp32
  [[ -n ${SFT:-} ]] && $PY -m arpo.entropy_probe --model "$SFT" --trajectories "$EVAL"/*.jsonl --out "$OUT" \
      --name smollm2_sft_released_bamboogle_gsm8k --dtype fp32
  [[ -n ${RL:-} ]] && $PY -m arpo.entropy_probe --model "$RL/hf_model" --trajectories "$EVAL"/*.jsonl --out "$OUT" \
      --name smollm2_rl_released_bamboogle_gsm8k --dtype fp32
fi
$PY experiments/results/premise/table.py "$OUT" > "$OUT/table.md"
