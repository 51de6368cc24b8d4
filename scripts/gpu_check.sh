#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command and within a time budget, from the
# repository root:
#
#   scripts/gpu_check.sh [--budget SECONDS] [--dry-run]     (default 480)
#
# The phases (minillm/lab/gpu_check.py) each get a share of the budget, the shares summing
# to at most the budget, and each runs in its own process, so that a CUDA fault loses only
# its phase. Goals first: W4A16 against dense fp16 on several shapes, decode attention,
# prefill attention, a mixed prefill + decode step, CUDA graphs; then the kernels' GPU
# tests and their oracle tests compiled for the GPU. --dry-run prints the plan (phases,
# budgets, what each measures) and its total, and runs on any machine.
#
# Out, written as each phase ends: gpu_check_<device>.jsonl (the device's clocks, power
# limit and MIG mode first, then a line per phase) and a folder per phase, in $OUT when it
# is set (a remote run hands back that folder), else benchmarks/results (GPU_CHECK_RESULTS
# overrides both). Exit status: 0 when every phase passed, 1 otherwise, 2 without a CUDA GPU.
#
# Python: the project's .venv when it has CUDA, else $PYTHON or python3 with a CUDA build of
# torch and triton (pytest and hypothesis for the test phases). GPU_CHECK_DEPS names a folder
# of extra pure-Python packages (`pip install --target DIR pytest hypothesis`).
set -uo pipefail
cd "$(dirname "$0")/.."

args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) [ $# -ge 2 ] || { echo "usage: scripts/gpu_check.sh [--budget SECONDS] [--dry-run]" >&2; exit 2; }
                  args+=(--budget "$2"); shift 2 ;;
        --dry-run) args+=(--dry-run); shift ;;
        *) echo "usage: scripts/gpu_check.sh [--budget SECONDS] [--dry-run]" >&2; exit 2 ;;
    esac
done

. scripts/find_python.sh  # (the working directory is the repository root)
export PYTHONPATH="$PWD${GPU_CHECK_DEPS:+:$GPU_CHECK_DEPS}${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
export MINILLM_KERNEL_EXAMPLES=${MINILLM_KERNEL_EXAMPLES:-8}  # few hypothesis examples
unset TRITON_INTERPRET  # compile the kernels for the GPU

exec "$PYTHON" -m minillm.lab.gpu_check "${args[@]}" \
    --out "${GPU_CHECK_RESULTS:-${OUT:-benchmarks/results}}"
