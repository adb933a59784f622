#!/usr/bin/env bash
# scripts/demo.sh — the main job on a fresh machine: installs what is missing and builds
# (scripts/setup.sh: system packages, the C++ library; scripts/setup-python.sh: the virtualenv
# with PyTorch and dion3 built from this tree), then trains a small GPT with Dion3, Muon, NorMuon
# and AdamW (examples/train_gpt.py) and writes train_gpt_out/results.md and loss.png in the
# current directory. Extra arguments go to the demo (--help lists them; --preset gpu-125m on a GPU).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The virtualenv: relative to the repo, where scripts/setup-python.sh makes it.
DION3_VENV=${DION3_VENV:-.venv}
[[ "$DION3_VENV" == /* ]] || DION3_VENV="$ROOT/$DION3_VENV"
export DION3_VENV
PY="$DION3_VENV/bin/python"
for arg in "$@"; do  # --help needs no build once the virtualenv is there
  if [[ ( "$arg" == --help || "$arg" == -h ) && -x "$PY" ]] && "$PY" -c "import torch" 2>/dev/null; then
    exec "$PY" "$ROOT/examples/train_gpt.py" --help
  fi
done
(cd "$ROOT" && scripts/setup.sh && bash scripts/setup-python.sh)
# Run from the caller's directory: --out (default train_gpt_out) is relative to it.
exec "$PY" "$ROOT/examples/train_gpt.py" "$@"
