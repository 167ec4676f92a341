#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-server, llama-speculative-simple) for side-by-side
# benchmarks, from the llama.cpp tree inside the pinned llama-cpp-python sdist, with the same
# flags as scripts/setup.sh (CMAKE_ARGS included: a CUDA build of specdec is compared with a CUDA
# build of llama.cpp). Nothing of llama.cpp enters this repository: the source is
# unpacked and built under the cache.
#
#   scripts/build_llama_cpp_tools.sh        # prints the directory holding the binaries
#
# About 5 minutes on 2 cores, once; later calls reuse the build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=setup.sh
source "$ROOT/scripts/setup.sh"
VENV="${SPECDEC_VENV:-$ROOT/.venv}"
WORK="$CACHE/llama-cpp-tools-$LLAMA_CPP_PYTHON_VERSION"
BIN="$WORK/build/bin"
FLAGS="$(llama_cmake_args)"
# A build made with other flags is built again.
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-speculative-simple" ] &&
    [ "$(cat "$WORK/build/specdec-flags" 2>/dev/null)" = "$FLAGS" ]; then
    echo "$BIN"
    exit 0
fi
mkdir -p "$WORK"
if [ ! -d "$WORK/src" ]; then
    log "fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
    "$VENV/bin/pip" download --quiet --no-deps --no-binary :all: --no-build-isolation \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$WORK/sdist" >&2
    mkdir -p "$WORK/src"
    tar -xzf "$WORK"/sdist/llama_cpp_python-*.tar.gz -C "$WORK/src" --strip-components=1
fi
log "building llama-server and llama-speculative-simple (several minutes, once) with: $FLAGS"
# The flags first: the options after them (the tools need the examples) take precedence.
# shellcheck disable=SC2086 # the flags are words
cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/build" $FLAGS -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF >&2
cmake --build "$WORK/build" -j "$(nproc)" --target llama-server llama-speculative-simple >&2
echo "$FLAGS" > "$WORK/build/specdec-flags"
echo "$BIN"
