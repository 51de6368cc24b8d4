#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command, from the repository root:
#   1. the kernel and CUDA-graph tests compiled for the GPU (the interpreter tests' shapes,
#      plus their GPU-marked real-size cases),
#   2. every other GPU-marked test,
#   3. the kernel benchmarks, which write benchmarks/results/kernels_<device>.json (the
#      file chapter 5 shows); the script's
#      arguments go to them (`scripts/gpu_check.sh --quick` for fewer cases).
# The test logs go to benchmarks/results/gpu_tests_<device>.txt. Exit status: non-zero if a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# The project's venv when there is one; else a python3 that already holds a CUDA build of
# torch, triton, pytest, hypothesis and transformers, running minillm from this checkout.
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "scripts/gpu_check.sh needs a CUDA GPU (torch.cuda.is_available() is False)" >&2
    exit 2
fi
unset TRITON_INTERPRET  # compile the kernels for the GPU
results=benchmarks/results
mkdir -p "$results"
device=$("$PYTHON" -c "import torch; from minillm.lab.kernel_bench import device_slug
print(device_slug(torch.cuda.get_device_name()))")
log="$results/gpu_tests_${device}.txt"

# compiling many kernel variants is CPU work: spread it over processes when xdist is there
parallel=()
"$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))")
run_tests() { "$PYTHON" -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"; }
{
    echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null)"
    run_tests tests/kernels tests/engine/test_cuda_graphs.py
} 2>&1 | tee "$log"
kernel_tests=${PIPESTATUS[0]}
# only the modules that hold GPU tests: the others may need packages (nbformat, the book's)
# that a GPU image lacks, and would fail to import before any test is selected
mapfile -t gpu_modules < <(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include="test_*.py" \
    | grep -v -e "^tests/kernels/" -e "^tests/engine/test_cuda_graphs.py$" | sort)
if [ "${#gpu_modules[@]}" -gt 0 ]; then
    run_tests -m gpu "${gpu_modules[@]}" 2>&1 | tee -a "$log"
    other_tests=${PIPESTATUS[0]}
    [ "$other_tests" -eq 5 ] && other_tests=0  # pytest's "no test selected"
else
    other_tests=0
fi

"$PYTHON" -m minillm.lab.kernel_bench --out "$results" "$@"
benchmarks=$?
echo "kernel tests: exit $kernel_tests; other GPU tests: exit $other_tests; benchmarks: exit $benchmarks"
[ "$kernel_tests" -eq 0 ] && [ "$other_tests" -eq 0 ] && [ "$benchmarks" -eq 0 ]
