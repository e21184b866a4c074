#!/usr/bin/env bash
# TRL's GRPOTrainer against our trainer's parts on one GPU, at bench_peers' job (experiments/bench_peers.py), for a
# GPU machine with torch and transformers but neither Ray nor vLLM (and no network to install them), so our
# full step cannot run there. What runs: TRL's whole step (generation with model.generate, bf16 autocast over
# float32 weights), then ours by part at the same sizes: the FSDP2 update (experiments/bench_trainer.py, one rank
# in this process, on-policy as at beta 0) and our HF engine's generation (experiments/bench_engine.py). The
# weights are random (SmolLM2-135M's architecture): neither side then stops early, so both generate every token
# of the job.
#
#   experiments/gpu_check_peers.sh OUT_DIR MODEL_FILES PROMPTS_PARQUET
#
# MODEL_FILES: config.json and tokenizer files, no weights; PROMPTS_PARQUET: the job's prompts (make run's training
# set). trl, datasets, dill, multiprocess, omegaconf, hydra-core, antlr4 and concurrent-log-handler as wheels in
# .whl/ (see experiments/gpu_check.sh), installed from there when missing.
set -uo pipefail
out=${1:?usage: experiments/gpu_check_peers.sh OUT_DIR MODEL_FILES PROMPTS_PARQUET}
files=${2:?MODEL_FILES}
prompts=${3:?PROMPTS_PARQUET}
py=${PYTHON:-python3}
# the job and the run, overridable from the environment
prompts_n=${PROMPTS:-8} n=${N:-8} resp=${RESPONSE:-384} steps=${STEPS:-3} repeats=${REPEATS:-2} device=${DEVICE:-cuda}
cd "$(dirname "$0")/.."
mkdir -p "$out"
if ! "$py" -c "import trl, datasets, omegaconf, hydra, concurrent_log_handler" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || { echo "missing trl/datasets/omegaconf/... and no wheels in .whl/"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true
model=/tmp/peers_model
"$py" -c "
import sys; from pathlib import Path; sys.path.insert(0, 'experiments')
from bench_trainer import random_init_model
random_init_model(Path('$files'), Path('$model'), device='$device')" || exit 1
# prompt length: the job's mean prompt in tokens (chat template applied), for our parts' synthetic rows
plen=$("$py" -c "
import pandas as pd; from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained('$model'); f = pd.read_parquet('$prompts').iloc[:$prompts_n]
ids = [tok.apply_chat_template([dict(m) for m in r], add_generation_prompt=True, tokenize=True, return_dict=True)['input_ids'] for r in f['prompt']]
print(round(sum(map(len, ids)) / len(ids)))")
rows=$(( prompts_n * n ))
status=0
step() {  # name, command...: its stdout to OUT/name.json, stderr to OUT/name.log
  local name=$1; shift
  echo "== $name"
  timeout "${STEP_TIMEOUT:-300}" "$@" >"$out/$name.json" 2>"$out/$name.log" || { echo "FAILED $name"; tail -5 "$out/$name.log"; status=1; }
}
# TRL generating with model.generate, like our HF engine's generation below (vLLM cannot travel to this machine)
step trl "$py" experiments/bench_peers.py --model "$model" --data "$prompts" --sides trl --dtypes bfloat16 \
  --trl-generation hf \
  --prompts "$prompts_n" --n "$n" --max-response-length "$resp" --steps "$steps" --warmup 1 \
  --repeats "$repeats" --threads 8 --work-dir /tmp/peers_work
update=("$py" experiments/bench_trainer.py --model "$model" --no-ray --ranks 1 --settings multi --device "$device"
  --rows "$rows" --prompt-len "$plen" --response-len "$resp" --micro 8 --steps "$steps" --warmup 1 --on-policy)
step ours_update "${update[@]}"
# the same update with the actor's decoder layers compiled (actor_rollout_ref.actor.use_torch_compile; verl's GPU
# default), compiled in the warm-up step
step ours_update_compiled "${update[@]}" --set actor_rollout_ref.actor.use_torch_compile=true
step ours_generation "$py" experiments/bench_engine.py --model "$model" --backends hf --prompts "$rows" \
  --prompt-len "$plen" --max-tokens "$resp" --logprobs 0 --repeats "$repeats" --dtype bfloat16
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except Exception:
        return None
trl, upd, gen, compiled = load("trl"), load("ours_update"), load("ours_generation"), load("ours_update_compiled")
if trl:
    for r in trl["runs"]:
        timed = r["steps"][1:]
        print("TRL step_s", r.get("step_s"), "gen_s", [round(s["gen_seconds"], 2) for s in timed],
              "rest_s", [round(s["update_seconds"], 2) for s in timed], "gen tok/s", r.get("generated_tokens_per_s"))
if upd:
    print("ours update:", json.dumps({k: v for k, v in upd.items() if k not in ("machine",)})[:1500])
if compiled:
    print("ours update, compiled:", json.dumps({k: v for k, v in compiled.items() if k not in ("machine",)})[:1500])
if gen:
    print("ours HF generation:", json.dumps(gen.get("hf"))[:800])
PY
exit $status
