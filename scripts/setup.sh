#!/usr/bin/env bash
# Sets up a virtual environment with llama-cpp-python (built once, wheel cached) and specdec.
#
#   scripts/setup.sh [--dev]
#
# Environment:
#   SPECDEC_VENV   where the virtual environment goes   (default: <repo>/.venv)
#   SPECDEC_CACHE  where built wheels and models go       (default: ~/.cache/specdec)
#   CMAKE_ARGS     passed to llama.cpp's build as is, e.g. CMAKE_ARGS="-DGGML_CUDA=on" for NVIDIA GPUs.
#                  When unset we build for this CPU *without* -march=native: some CPUs advertise AMX
#                  but fault on its instructions (SIGILL in tilezero), so features are listed explicitly.
set -euo pipefail
# A failing command inside $(...) stops the script too (a failed wheel build, say).
shopt -s inherit_errexit

LLAMA_CPP_PYTHON_VERSION=0.3.36
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECDEC_VENV:-$ROOT/.venv}"
CACHE="${SPECDEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec}"
PYTHON="${PYTHON:-python3}"
DEV=0
[ "${1:-}" = "--dev" ] && DEV=1

log() { printf '[setup] %s\n' "$*" >&2; }

cpu_has() { grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | grep -qw "$1"; }

# CPU feature flags for ggml, from what this CPU reports, with AMX always off.
cpu_cmake_args() {
    local args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    local pair flag opt
    for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI \
        avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        flag="${pair%%:*}"
        opt="${pair##*:}"
        if cpu_has "$flag"; then args="$args -DGGML_$opt=ON"; else args="$args -DGGML_$opt=OFF"; fi
    done
    echo "$args"
}

llama_cmake_args() {
    local base="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
    if [ -n "${CMAKE_ARGS:-}" ]; then
        echo "$base $CMAKE_ARGS"
    elif [ "$(uname -m)" = "x86_64" ]; then
        echo "$base $(cpu_cmake_args)"
    else
        echo "$base -DGGML_NATIVE=OFF"
    fi
}

# Building llama.cpp takes minutes; the wheel is cached under a key of everything that shapes it.
ensure_llama_wheel() {
    local args pyver key dir
    args="$(llama_cmake_args)"
    pyver="$("$VENV/bin/python" -c 'import sys; print(sys.implementation.cache_tag)')"
    key="$(printf '%s|%s|%s|%s' "$LLAMA_CPP_PYTHON_VERSION" "$args" "$pyver" "$(uname -m)" | sha256sum | cut -c1-16)"
    dir="$CACHE/wheels/llama-cpp-python-$key"
    if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        log "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (several minutes, once) with: $args"
        rm -rf "$dir.tmp"
        CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            "$VENV/bin/pip" wheel --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -w "$dir.tmp" >&2
        rm -rf "$dir"
        mv "$dir.tmp" "$dir"
    else
        log "using cached llama-cpp-python wheel in $dir"
    fi
    echo "$dir"
}

# pip sees the same version and keeps whatever build is installed, so a change of CMAKE_ARGS
# needs a forced reinstall; the installed build's cache key is kept in the venv.
install_llama_wheel() {
    local wheel_dir="$1" marker="$VENV/.llama-cpp-python-build"
    if [ "$(cat "$marker" 2>/dev/null)" != "$wheel_dir" ]; then
        "$VENV/bin/pip" install --quiet --force-reinstall --no-deps "$wheel_dir"/llama_cpp_python-*.whl >&2
        "$VENV/bin/pip" install --quiet "$wheel_dir"/llama_cpp_python-*.whl >&2  # its dependencies
        echo "$wheel_dir" > "$marker"
    fi
}

main() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating virtual environment $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    "$VENV/bin/pip" install --quiet --upgrade pip >&2
    local wheel_dir
    wheel_dir="$(ensure_llama_wheel)"
    install_llama_wheel "$wheel_dir"
    # Our build compiles against the llama-cpp-python installed above, so no build isolation:
    # an isolated build would compile llama.cpp a second time.
    "$VENV/bin/pip" install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja >&2
    local extras=""
    # The test suite's build also has the test hooks (specdec_native._core.testing).
    [ "$DEV" = 1 ] && extras="[dev]" && export SPECDEC_TEST_HOOKS=ON
    log "building and installing specdec"
    "$VENV/bin/pip" install --quiet --no-build-isolation --editable "$ROOT$extras" >&2
    log "ready: $VENV"
}

# Sourced (scripts/build_llama_cpp_tools.sh uses the CPU flags above): define, do not run.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
