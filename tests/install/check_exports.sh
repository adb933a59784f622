#!/usr/bin/env bash
# tests/install/check_exports.sh LIB INCLUDE_DIR — libdion3.so exports the public API and nothing
# else: every C function of dion3.h and a few C++ entry points are there, and every exported
# symbol is a dion3_* function or belongs to a name the public headers declare in namespace
# dion3 (no backend internals, pimpl classes, anonymous namespaces or standard-library
# instantiations).
set -euo pipefail
lib=$1
include=$2

exported=$(nm -D --defined-only "$lib" | awk 'NF == 3 { print $3 }' | c++filt)
[ -n "$exported" ] || { echo "no exported symbols in $lib" >&2; exit 1; }
fail=0

# Everything exported must be on the allow list.
while IFS= read -r sym; do
  case "$sym" in
    dion3_*) continue ;;
  esac
  name=$(printf '%s\n' "$sym" | sed -nE 's/^((typeinfo name|typeinfo|vtable) for )?dion3::([A-Za-z_][A-Za-z_0-9]*).*/\3/p')
  if [ -z "$name" ] || printf '%s\n' "$sym" | grep -qE 'dion3::(cuda|cpu|detail)::|::Impl::|\(anonymous namespace\)' ||
     ! grep -qE "(class|struct) (DION3_API )?$name\b|[ &*]$name\(" "$include"/dion3/*.hpp; then
    echo "not public API: $sym" >&2
    fail=1
  fi
done <<< "$exported"

# Every C API function is exported, and the C++ entry points a consumer starts from.
required=$(grep -oE '^DION3_API [^(]*\bdion3_[a-z0-9_]+\(' "$include/dion3/dion3.h" | grep -oE 'dion3_[a-z0-9_]+\($' | tr -d '(')
[ -n "$required" ] || { echo "no DION3_API functions found in dion3.h" >&2; exit 1; }
required+=$'\n'"dion3::make_cpu_backend()"$'\n'"dion3::Optimizer::step()"$'\n'"typeinfo for dion3::Error"
required+=$'\n'"typeinfo for dion3::Backend"
while IFS= read -r want; do
  grep -qxF "$want" <<< "$exported" || { echo "not exported: $want" >&2; fail=1; }
done <<< "$required"

echo "$(wc -l <<< "$exported") exported symbols, $(wc -l <<< "$required") required ones checked"
exit $fail
