#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command, from the repository root:
#   1. the kernel and CUDA-graph tests compiled for the GPU (the interpreter tests' shapes,
#      plus their GPU-marked real-size cases),
#   2. every other GPU-marked test,
#   3. the kernel benchmarks, which write results/kernels_<device>.json.
# The test logs go to results/gpu_tests_<device>.txt. Exit status: non-zero if a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "scripts/gpu_check.sh needs a CUDA GPU (torch.cuda.is_available() is False)" >&2
    exit 2
fi
unset TRITON_INTERPRET  # compile the kernels for the GPU
mkdir -p results
device=$("$PYTHON" -c "import torch; from benchmarks.kernels import device_slug
print(device_slug(torch.cuda.get_device_name()))")
log="results/gpu_tests_${device}.txt"

run_tests() { "$PYTHON" -m pytest -q -p no:cacheprovider "$@"; }
{
    echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null)"
    run_tests tests/kernels tests/engine/test_cuda_graphs.py
} 2>&1 | tee "$log"
kernel_tests=${PIPESTATUS[0]}
run_tests -m gpu tests --ignore=tests/kernels --ignore=tests/engine/test_cuda_graphs.py 2>&1 \
    | tee -a "$log"
other_tests=${PIPESTATUS[0]}
[ "$other_tests" -eq 5 ] && other_tests=0  # pytest's "no test selected"

"$PYTHON" -m benchmarks.kernels --out results
benchmarks=$?
echo "kernel tests: exit $kernel_tests; other GPU tests: exit $other_tests; benchmarks: exit $benchmarks"
[ "$kernel_tests" -eq 0 ] && [ "$other_tests" -eq 0 ] && [ "$benchmarks" -eq 0 ]
