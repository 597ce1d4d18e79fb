#!/bin/sh
# probe.sh - can xgrammar's C++ core be built here from the PyPI sdist, without Python,
# and used from C over SmolLM2's vocabulary?  (issue #17, structured outputs; a probe,
# not part of the build.)  Needs cmake, ninja, g++, libjansson-dev and the demo model.
#   tests/probe/xgrammar/probe.sh [WORKDIR]
#
# Result on the 2-core AMD EPYC dev machine, xgrammar 0.2.8 sdist (sha256 8305646f...):
# the core (29 C++ files + picojson + dlpack from the sdist, no Python, no tvm-ffi,
# no nanobind) builds with cmake + ninja in ~18 min at -j2 (-O3 -flto=auto); the shim
# and this probe link against libxgrammar.a.  Over SmolLM2's 49152 tokens: tokenizer
# info 118 ms, compile of schema.json 753 ms (again: 0.007 ms, cached), bitmask fill
# mean 5.7 us / p99 53 us over 140 steps, the walk ends terminated with JSON that
# satisfies the schema, and a bad schema is refused with a message (no crash).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
work=${1:-/tmp/xgrammar-probe}
mkdir -p "$work" "$repo/.cache/xgrammar"
# The sdist only (its build dependencies are for the Python wheel, not the core).
ls "$repo"/.cache/xgrammar/xgrammar-*.tar.gz >/dev/null 2>&1 ||
        "$repo/.venv/bin/pip" download --no-deps --no-binary xgrammar xgrammar==0.2.8 -d "$repo/.cache/xgrammar"
tar xzf "$repo"/.cache/xgrammar/xgrammar-0.2.8.tar.gz -C "$work"
src="$work/xgrammar-0.2.8"
# The sdist's cmake/config.cmake turns the Python bindings (nanobind + tvm-ffi) on; a
# config.cmake in the build folder takes precedence and builds the static core alone.
mkdir -p "$src/build"
printf 'set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)\nset(XGRAMMAR_BUILD_CXX_TESTS OFF)\n' > "$src/build/config.cmake"
cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release
ninja -C "$src/build" -j2 xgrammar
g++ -std=c++17 -O2 -c "$here/xgr_shim.cc" -I"$src/include" -I"$src/3rdparty/dlpack/include" \
        -I"$src/3rdparty/picojson" -o "$work/xgr_shim.o"
gcc -std=gnu11 -O2 "$here/probe.c" "$work/xgr_shim.o" "$src/build/libxgrammar.a" -I"$here" -ljansson -lstdc++ \
        -lpthread -o "$work/probe"
stop=$("$repo/.venv/bin/python" "$here/dump_vocab.py" "$repo/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
        "$work/vocab.json")
"$work/probe" "$work/vocab.json" "$here/schema.json" "$stop"
