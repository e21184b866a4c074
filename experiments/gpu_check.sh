#!/usr/bin/env bash
# The prepared GPU check, for a machine with only torch and transformers (no network): the paper-scale path on one
# GPU (experiments/gpu_check_scale.py: FSDP2 loading from rank 0, bucketed weight sync, the planner against measured
# peaks). Results in OUT_DIR as JSON.
#
#   experiments/gpu_check.sh OUT_DIR          # one H200: about 75 s (docs/results/gpu-h200.md)
#   experiments/gpu_check.sh OUT_DIR --layers 28 --lora-rank 64 --prompt-len 1536 --response-len 4096
#                                             # the whole 7B with LoRA at the paper's lengths (arguments after
#                                             # OUT_DIR go to experiments/gpu_check_scale.py)
#
# omegaconf, hydra-core and concurrent-log-handler are pure-Python wheels; put them in .whl/ beforehand
# (python -m pip wheel --no-deps -w .whl omegaconf hydra-core antlr4-python3-runtime==4.9.3 concurrent-log-handler)
# and carry that folder: they are installed from it when missing.
set -uo pipefail
out=${1:?usage: experiments/gpu_check.sh OUT_DIR [gpu_check_scale.py args]}
shift
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
if ! "$py" -c "import omegaconf, hydra, concurrent_log_handler" 2>/dev/null; then
  "$py" -m pip install -q --no-index --find-links .whl omegaconf hydra-core concurrent-log-handler \
    || { echo "missing omegaconf/hydra-core/concurrent-log-handler and no wheels in .whl/"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
status=0
timeout "${CHECK_TIMEOUT:-420}" "$py" experiments/gpu_check_scale.py --out "$out/gpu_check_scale.json" "$@" \
  >/dev/null 2>"$out/gpu_check_scale.log" || { echo "FAILED gpu_check_scale (see $out/gpu_check_scale.log)"; status=1; }
[[ -f $out/gpu_check_scale.json ]] && "$py" - "$out/gpu_check_scale.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("seconds:", d["seconds"], "| start:", d["start_s"], "s")
for phase, v in d["peak_gpu_vs_plan"].items():
    print(f"  {phase:14s} measured {v['measured_gib']} GiB, planned {v['planned_gib']} GiB, ratio {v['planned_over_measured']}")
PY
exit $status
