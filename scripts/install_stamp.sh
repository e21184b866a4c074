#!/usr/bin/env bash
# Which stack a virtual environment holds, and whether `make install` must (re)install it.
#
# The stamp file $VENV/.arpo-installed holds one line: the requirements file installed and the sha256 of that file,
# pyproject.toml, scripts/install.sh and scripts/compile_bytecode.sh together. The stack to install is
# $ARPO_REQUIREMENTS when set, else the one the stamp names (so `make test` after a GPU install keeps the GPU stack),
# else requirements.txt (CPU).
#
#   install_stamp.sh decide VENV    print "up-to-date REQ" or "install REQ"; exit 2 with one line on stderr when
#                                   ARPO_REQUIREMENTS names another stack than the one installed: the CPU and GPU
#                                   stacks pin different builds of torch and its companions, and one laid over the
#                                   other leaves a mix neither was tested with; a fresh venv is the clean switch.
#   install_stamp.sh ensure VENV    decide, then run scripts/install.sh when needed (--dry-run: print only)
#   install_stamp.sh record VENV REQ   write the stamp (scripts/install.sh does, after a successful install)
#
# ARPO_ROOT (default: this script's repository) is where the requirements files live.
set -euo pipefail
ROOT=${ARPO_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}

digest() {  # sha256 of the requirements file and the install inputs, as one hex string
  (cd "$ROOT" && cat "$1" pyproject.toml scripts/install.sh scripts/compile_bytecode.sh 2>/dev/null) | sha256sum | cut -d' ' -f1
}

decide() {
  local venv=$1 stamp=$1/.arpo-installed installed="" recorded="" req
  if [ -f "$stamp" ]; then read -r installed recorded < "$stamp" || true; fi
  req=${ARPO_REQUIREMENTS:-${installed:-requirements.txt}}
  if [ ! -f "$ROOT/$req" ]; then
    echo "error: ARPO_REQUIREMENTS=$req: no such file in $ROOT (requirements.txt: CPU, requirements-gpu.txt: CUDA)" >&2
    return 2
  fi
  if [ -n "$installed" ] && [ "$installed" != "$req" ]; then
    local other=cpu; case $req in *gpu*) other=gpu ;; esac
    echo "error: $venv holds the $installed stack; installing $req over it would mix two torch builds: use another venv (make VENV=.venv-$other ARPO_REQUIREMENTS=$req ...) or remove $venv first" >&2
    return 2
  fi
  if [ -x "$venv/bin/python" ] && [ "$recorded" = "$(digest "$req")" ]; then
    echo "up-to-date $req"
  else
    echo "install $req"
  fi
}

case "${1:-}" in
  decide) decide "$2" ;;
  ensure)
    venv=$2
    decision=$(decide "$venv")
    if [ "${3:-}" = "--dry-run" ] || [ "${decision%% *}" = "up-to-date" ]; then
      echo "$decision"
    else
      ARPO_VENV="$venv" ARPO_REQUIREMENTS="${decision#install }" bash "$ROOT/scripts/install.sh"
    fi ;;
  record) mkdir -p "$2" && echo "$3 $(digest "$3")" > "$2/.arpo-installed" ;;
  *) echo "usage: $0 decide VENV | ensure VENV [--dry-run] | record VENV REQ" >&2; exit 64 ;;
esac
