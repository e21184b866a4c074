#!/usr/bin/env bash
# The paper's Qwen2.5-7B recipe from a cold-start SFT checkpoint made elsewhere: ARPO RL with the released 7B
# reasoning settings on one 8-GPU node, evaluation of the RL model on the released benchmarks, the paper's tables.
# The settings live in one place, configs/pipeline/paper_qwen2.5_7b.yaml; this script runs that preset with
# sft.out_dir=$MODEL, so its base-model and SFT stages are skipped (the whole chain, SFT included:
# python -m arpo.pipeline --preset paper_qwen2.5_7b ; docs/reproduce.md).
# Needs the GPU install (ARPO_REQUIREMENTS=requirements-gpu.txt make install), the checkpoint at $MODEL, and the ARPO
# release data in $ARPO_DATA (python -m arpo.data.release). Outputs under outputs/qwen7b_arpo/ (rl/, eval/, tables/); a rerun resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the SFT checkpoint}"
exec .venv/bin/python -m arpo.pipeline --preset paper_qwen2.5_7b sft.out_dir="$MODEL" "$@"
