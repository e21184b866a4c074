#!/usr/bin/env bash
# Compile the venv's installed Python files to bytecode once, at install time (scripts/install.sh and
# `make install-bench`). uv installs without .pyc files, and where PYTHONDONTWRITEBYTECODE=1 is set (some container
# images) no process ever writes them, so every process that starts compiles transformers, vLLM and Ray from source
# again: measured on 2 cores, `import torch, transformers, vllm, ray, arpo.main_arpo` 11.2 s -> 5.8 s and a vLLM
# engine's start 29.5 s -> 20 s with them (docs/results/test-suite.md). A file that does not compile (a few test
# fixtures written for newer Pythons) only keeps its source import, hence `|| true`.
set -euo pipefail
VENV=${1:-.venv}
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
"$VENV/bin/python" -m compileall -qq -j 0 "$SITE" || true
