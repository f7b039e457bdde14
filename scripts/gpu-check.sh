#!/usr/bin/env bash
# Every GPU check of cacheidx in one call, for a fresh CUDA machine with no network.
#
#   scripts/gpu-check.sh prepare          # here, with a package index: wheels into .whl/
#   scripts/gpu-check.sh run [OUT] [ARGS] # there: install from .whl/, check, measure
#
# `prepare` builds cacheidx's wheel and fetches the pure-Python wheels a GPU image lacks
# (array-api-compat, array-api-strict) into .whl/ beside this checkout. `run` installs them
# (no index, no network), then writes under OUT (default gpu-report/):
#   machine.txt            nvidia-smi, Python and library versions
#   conformance.json       the law suite on every backend and device, highest precision
#   conformance-default.json  the same on the GPUs under each library's default precision
#   extend.json, decode.json  the GPU benchmarks (benchmarks/gpu_extend.py, gpu_decode.py)
#   long_context.json      attend at 4k and 16k tokens against transformers' static cache
#                          (benchmarks/long_context.py --device cuda)
#   log.txt                everything printed
# ARGS go to both conformance runs (e.g. --backend torch). It never stops at a failing step:
# every step runs and the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=.whl

prepare() {
    set -e
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PYTHON" -m pip wheel -q --no-deps -w "$WHEELS" .
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" \
        "array-api-compat>=1.9" "array-api-strict>=2.2"
    ls "$WHEELS"
}

run() {
    local out=${1:-gpu-report}
    shift || true
    mkdir -p "$out"
    local site="${TMPDIR:-/tmp}/cacheidx-site" status=0
    exec > >(tee "$out/log.txt") 2>&1
    step() {  # step NAME TIMEOUT CMD...: run, time and keep going
        local name=$1 limit=$2
        shift 2
        echo "== $name: $*"
        local t0=$SECONDS
        timeout "$limit" "$@"
        local rc=$?
        echo "== $name: exit $rc after $((SECONDS - t0)) s"
        [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
        return 0
    }
    step install 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    {
        nvidia-smi 2>&1 || echo "no nvidia-smi"
        "$PYTHON" - <<'EOF'
import importlib, platform
print("python", platform.python_version(), platform.machine())
for name in ("cacheidx", "numpy", "array_api_compat", "array_api_strict", "torch", "jax",
             "cupy"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "absent:", type(e).__name__, e)
EOF
    } > "$out/machine.txt" 2>&1
    cat "$out/machine.txt"
    step conformance 240 "$PYTHON" -m cacheidx.conformance --json "$out/conformance.json" "$@"
    step conformance-default 120 "$PYTHON" -m cacheidx.conformance --device cuda \
        --precision default --json "$out/conformance-default.json" "$@"
    step extend 150 "$PYTHON" benchmarks/gpu_extend.py --json "$out/extend.json"
    step decode 150 "$PYTHON" benchmarks/gpu_decode.py --json "$out/decode.json"
    step long-context 240 "$PYTHON" benchmarks/long_context.py --device cuda \
        --contexts 4096 16384 --steps 8 --json "$out/long_context.json"
    echo "== done: status $status, files in $out"
    return "$status"
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 prepare | run [OUT] [conformance args]" >&2; exit 2 ;;
esac
