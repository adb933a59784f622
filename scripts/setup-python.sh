#!/usr/bin/env bash
# scripts/setup-python.sh — the repo-local Python environment for the PyTorch front end.
#
# Creates .venv (git-ignored) with PyTorch, numpy, pytest, matplotlib (the demo's plot), accelerate,
# lightning and transformers (the framework recipes' tests) and the build tools (setuptools, ninja,
# build), then builds and installs dion3 from this tree into it. Idempotent: every step is skipped
# when its result is already there, and the extension is rebuilt (incrementally, by ninja) only
# when a source file changed since the last build. Environment knobs:
#   DION3_VENV=path        use another virtualenv folder (default: <repo>/.venv)
#   PYTHON=python3.x       interpreter that creates the virtualenv
#   DION3_TORCH_SPEC=...   pip requirement for PyTorch (default: torch from PyPI, with its CUDA
#                          runtime, where nvidia-smi lists a GPU; elsewhere the CPU-only wheel from
#                          the PyTorch index when it answers, else torch from PyPI)
#   DION3_CUDA=0|1         build the CUDA backend (default: when torch sees a GPU and nvcc exists;
#                          the build log and `python -m dion3` say what was built)
#   MAX_JOBS=n             parallel compile jobs (default 2)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DION3_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${DION3_TORCH_SPEC:-torch}
export MAX_JOBS=${MAX_JOBS:-2}

t0=$SECONDS
log() { printf '[setup-python] %4ss %s\n' "$((SECONDS - t0))" "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
# From /: the repo root holds folders (build/) that would import as namespace packages.
has_module() { (cd / && "$PY" -c "import $1") >/dev/null 2>&1; }

# A machine with an NVIDIA GPU gets PyTorch with CUDA, so that the demo and the extension use it.
gpu_present() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
if ! has_module torch; then
  # Without a GPU, the CPU-only wheel index is much smaller (no CUDA runtime wheels); use it when it
  # answers. Where only PyPI is reachable, PyPI's torch (with its CUDA runtime dependencies) is used.
  if [ -z "${DION3_TORCH_SPEC:-}" ] && ! gpu_present &&
    curl -fsS -m 10 -o /dev/null https://download.pytorch.org/whl/cpu/ 2>/dev/null; then
    log "installing CPU PyTorch from the PyTorch CPU index"
    pip_install --index-url https://download.pytorch.org/whl/cpu torch
  else
    log "installing PyTorch from PyPI ($TORCH_SPEC)"
    pip_install "$TORCH_SPEC"
  fi
fi
for mod in numpy pytest ninja build matplotlib accelerate lightning transformers; do
  has_module "$mod" || { log "installing $mod"; pip_install "$mod"; }
done
# The package's metadata (an SPDX license expression) needs setuptools >= 77; a virtualenv may
# come with an older one.
if ! "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' >/dev/null 2>&1; then
  log "installing setuptools>=77"
  pip_install "setuptools>=77"
fi

# Rebuild only when a source file is newer than the stamp of the last successful build.
STAMP="$VENV/.dion3-build-stamp"
need_build=1
if [ -f "$STAMP" ] && has_module dion3._C; then
  changed=$(find "$ROOT/src" "$ROOT/include" "$ROOT/python" "$ROOT/setup.py" "$ROOT/pyproject.toml" \
              "$ROOT/VERSION" \
              -newer "$STAMP" -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.hpp' \
              -o -name '*.h' -o -name '*.py' -o -name '*.toml' -o -name VERSION \) -print -quit 2>/dev/null || true)
  [ -z "$changed" ] && need_build=0
fi
if [ "$need_build" = 1 ]; then
  log "building and installing dion3 (MAX_JOBS=$MAX_JOBS)"
  touch "$STAMP.new"
  (cd "$ROOT" && "$PY" -m pip install --disable-pip-version-check -q --no-build-isolation --no-deps .)
  mv "$STAMP.new" "$STAMP"
else
  log "dion3 is up to date"
fi
log "done in $((SECONDS - t0)) s"
