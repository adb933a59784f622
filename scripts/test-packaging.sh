#!/usr/bin/env bash
# scripts/test-packaging.sh — the packaging tests (tests/packaging): the version in one place,
# `pip install .` with no download, clear build errors, the reported CUDA choice, and a wheel
# built from the sdist in a clean folder, installed in a fresh virtualenv and used. Prepares
# .venv like scripts/test-python.sh; extra arguments go to pytest. The wheel is built CPU-only.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DION3_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup-python.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest tests/packaging -q -p no:cacheprovider "$@"
