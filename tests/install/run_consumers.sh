#!/usr/bin/env bash
# tests/install/run_consumers.sh BUILD_DIR WORK_DIR CC CXX GENERATOR — installs the build into
# WORK_DIR/prefix with `cmake --install`, then builds and runs the consumer programs of
# consumer/ against that tree: with find_package(dion3) (shared and static library; the static
# one from a C++-only project too, consumer_cxx/; the shared one with its dependencies hidden,
# consumer_shared/), a project holding dion3 as its subdirectory (configured only) and with
# pkg-config and the compilers called directly (shared, and static with --static).
set -euo pipefail
build=$1
work=$2
cc=$3
cxx=$4
generator=$5
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { printf '[consumers] %s\n' "$*"; }

rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
shared=$(find "$prefix" -name 'libdion3.so' -type l)
[ -n "$shared" ] || { echo "no libdion3.so installed under $prefix" >&2; exit 1; }
soname=$(readelf -d "$shared" | sed -nE 's/.*\(SONAME\).*\[(.*)\]/\1/p')
[ -f "$(dirname "$shared")/$soname" ] || { echo "soname '$soname' is not installed" >&2; exit 1; }
log "installed $soname -> $(readlink -f "$shared" | xargs basename)"

# Which library a program ended up with.
uses_shared() { readelf -d "$1" | grep -q "(NEEDED).*\[$soname\]"; }
expect() {  # expect shared|static PROGRAM
  if [ "$1" = shared ]; then uses_shared "$2" || { echo "$2 does not load $soname" >&2; exit 1; }
  else ! uses_shared "$2" || { echo "$2 loads $soname instead of linking libdion3.a" >&2; exit 1; }; fi
  "$2"
}

log "find_package(dion3)"
cmake -S "$here/consumer" -B "$work/cmake" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/cmake" >/dev/null
expect shared "$work/cmake/consumer_c"
expect static "$work/cmake/consumer_c_static"
expect shared "$work/cmake/consumer_cpp"
log "find_package(dion3), shared only, with BLAS, OpenMP and MPI hidden"
cmake -S "$here/consumer_shared" -B "$work/cmake_shared" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_DISABLE_FIND_PACKAGE_BLAS=ON -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON >/dev/null
cmake --build "$work/cmake_shared" >/dev/null
expect shared "$work/cmake_shared/consumer_c"
expect shared "$work/cmake_shared/consumer_cpp"
log "find_package(dion3) from a C++-only project, static"
cmake -S "$here/consumer_cxx" -B "$work/cmake_cxx" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/cmake_cxx" >/dev/null
expect static "$work/cmake_cxx/consumer_cpp_static"

log "add_subdirectory(dion3): configured only"
cmake -S "$here/consumer_subdir" -B "$work/subdir" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DDION3_SOURCE="$(cd "$here/../.." && pwd)" >/dev/null
grep -q '^DION3_TESTS:BOOL=OFF' "$work/subdir/CMakeCache.txt" || { echo "a subproject dion3 builds its tests" >&2; exit 1; }
[ -f "$prefix/share/doc/dion3/LICENSE" ] || { echo "cmake --install put no LICENSE under share/doc/dion3" >&2; exit 1; }

log "pkg-config dion3"
PKG_CONFIG_PATH=$(dirname "$(find "$prefix" -name dion3.pc)")
export PKG_CONFIG_PATH
libdir=$(pkg-config --variable=libdir dion3)
# shellcheck disable=SC2046  # pkg-config prints several flags
"$cc" -std=c99 "$here/consumer/consumer.c" -o "$work/pc_c" $(pkg-config --cflags --libs dion3) -Wl,-rpath,"$libdir"
# shellcheck disable=SC2046
"$cxx" -std=c++20 "$here/consumer/consumer.cpp" -o "$work/pc_cpp" $(pkg-config --cflags --libs dion3) \
  -Wl,-rpath,"$libdir"
static_libs=$(pkg-config --static --libs dion3 | sed -E 's/-ldion3( |$)/-l:libdion3.a\1/')
# shellcheck disable=SC2046,SC2086
"$cc" -std=c99 "$here/consumer/consumer.c" -o "$work/pc_c_static" $(pkg-config --cflags dion3) $static_libs
expect shared "$work/pc_c"
expect shared "$work/pc_cpp"
expect static "$work/pc_c_static"
log "all consumers ran"
