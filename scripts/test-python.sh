#!/usr/bin/env bash
# scripts/test-python.sh — the Python suite: prepares .venv (scripts/setup-python.sh: PyTorch,
# numpy, pytest, dion3 built from this tree) and runs pytest on tests/python. Extra arguments go
# to pytest. On a machine with a GPU and a CUDA build, the same tests also run on cuda tensors.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DION3_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup-python.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest tests/python -q "$@"
