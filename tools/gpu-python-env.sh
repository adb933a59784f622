# shellcheck shell=bash
# tools/gpu-python-env.sh — sourced by the GPU tools (ROOT set): dion3_python_build builds
# dion3._C with the CUDA backend into the machine's Python (a --target folder, /tmp/dion3-site)
# and puts it on PYTHONPATH. Needs .deps/blas carried, and .deps/pysetuptools where the machine's
# setuptools is older than the build needs (both from tools/prepare-device-deps).
#   dion3_python_build            build (incrementally: compiled objects are kept)
#   dion3_python_build if-missing build only when no earlier call of this machine built it
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export DION3_BLAS=blas DION3_BLAS_DIR=$ROOT/.deps/blas DION3_CUDA=1 MAX_JOBS=${MAX_JOBS:-16}
source "$ROOT/tools/gpu-native-env.sh"  # the BLAS (and NCCL) on the library paths
DION3_SITE=/tmp/dion3-site

dion3_python_build() {
  if [ "${1:-}" != if-missing ] || [ ! -f "$DION3_SITE/dion3/__init__.py" ]; then
    # setuptools copies Python files into build-py-ext only when they look newer than its copies:
    # start that copy afresh so an edited module is never shipped stale.
    rm -rf "$ROOT"/build-py-ext/lib* "$DION3_SITE"
    (cd "$ROOT" && PYTHONPATH="$ROOT/.deps/pysetuptools${PYTHONPATH:+:$PYTHONPATH}" \
      python3 -m pip install -q --no-build-isolation --no-deps --target "$DION3_SITE" . >/tmp/pip.log 2>&1) || {
      tail -40 /tmp/pip.log; echo "dion3 Python build failed"; return 1; }
  fi
  export PYTHONPATH="$DION3_SITE"
}
