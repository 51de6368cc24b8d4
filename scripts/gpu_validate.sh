#!/usr/bin/env bash
# The GPU validation of the kernels, in one command, from a cold compile cache in under
# 8 minutes on one H200 (the default budget, 470 s):
#
#   scripts/gpu_validate.sh [--budget SECONDS] [--smoke]
#
#   1. preflight and probes  (python -m minillm.lab.gpu_probes, at most 90 s): CUDA, the
#      versions, a line for each missing package and what it skips; then each kernel once
#      at a real serving size in bfloat16 and float16 against a float64 oracle, the first
#      runs of the low-precision paths (the CPU tests compute in float32)
#   2. scripts/gpu_check.sh with the rest of the budget: the goals, each in its own
#      process (W4A16 against dense fp16 on several shapes, decode >= 70% of HBM bandwidth
#      at 64 x 4k, prefill within 1.5x of SDPA's FlashAttention, a mixed prefill + decode
#      step, CUDA graphs), then the kernels' GPU tests and the oracles compiled for the GPU
#
# Everything is written to $OUT when it is set (a remote run hands back that folder), else
# to benchmarks/results: gpu_probes_<device>.json, gpu_check_<device>.jsonl and a folder
# per gpu_check phase (kernels_<device>.json inside each benchmark phase's).
# It runs on the GPU image's own python3 (torch and Triton with CUDA; pytest and hypothesis
# for the test phases, which are skipped and say so without them; no Jupyter needed).
#
# Without CUDA it refuses with one line (exit 2). --smoke runs it on a CPU to check the
# script itself: the probes under Triton's interpreter at small sizes in float32, and
# gpu_check's phases recorded as skipped; its results go to a temporary folder unless $OUT
# is set. Exit status: 0 when everything that ran passed, 1 otherwise, 2 without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."

budget=470
smoke=0
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) budget="$2"; shift 2 ;;
        --smoke) smoke=1; shift ;;
        *) echo "usage: scripts/gpu_validate.sh [--budget SECONDS] [--smoke]" >&2; exit 2 ;;
    esac
done
start=$(date +%s)

. scripts/find_python.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$smoke" = 0 ]; then
    unset TRITON_INTERPRET  # compile the kernels for the GPU
    if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        2>/dev/null; then
        echo "scripts/gpu_validate.sh needs a CUDA GPU ($PYTHON: torch.cuda.is_available() is not True)" >&2
        exit 2
    fi
    results=${OUT:-benchmarks/results}
else
    export TRITON_INTERPRET=1
    results=${OUT:-$(mktemp -d)}
fi
mkdir -p "$results"

probe_args=(--out "$results")
[ "$smoke" = 1 ] && probe_args+=(--smoke)
echo "== probes: up to 90 s"
timeout --signal=TERM --kill-after=10 90 "$PYTHON" -m minillm.lab.gpu_probes "${probe_args[@]}"
probes=$?
case $probes in
    0) echo "== probes: passed" ;;
    124|137) echo "== probes: timeout" ;;
    *) echo "== probes: failed (exit $probes)" ;;
esac

left=$((budget - ($(date +%s) - start)))
if [ "$smoke" = 1 ]; then
    GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_RESULTS="$results" OUT="$results" \
        bash scripts/gpu_check.sh --budget 30
else
    GPU_CHECK_RESULTS="$results" bash scripts/gpu_check.sh --budget "$left"
fi
check=$?
echo "== gpu_validate: done in $(($(date +%s) - start)) s of $budget; results in $results"
[ "$probes" -eq 0 ] && [ "$check" -eq 0 ]
