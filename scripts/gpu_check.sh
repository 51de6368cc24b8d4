#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command and within a time budget, from the
# repository root:
#
#   scripts/gpu_check.sh [--budget SECONDS]      (default 540: a 10-minute slot, minus margin)
#
# The phases run most important first, each under its own time limit, and the results are
# written as each one ends, so that a run cut short still leaves what it measured:
#   1. kernels    the kernels' GPU-marked tests: real sizes, the GPU's tiles, split-K and
#                 split-KV at decode sizes, tensors past 2^31 elements
#   2. bench      the kernel benchmark, quick: the three goals and the CUDA-graph steps
#                 (benchmarks/results/kernels_<device>.json, the file chapter 5 shows)
#   3. gpu-tests  every other GPU-marked test (CUDA graphs, the engine on the GPU)
#   4. oracles    the kernels' hypothesis oracle tests, compiled for the GPU (few examples)
#   5. sweeps     other tile, warp, pipeline and split-K configurations, timed
#                 (benchmarks/results/sweeps/)
#   6. bench-full the full kernel benchmark, replacing the quick file only if it completes
# Out: benchmarks/results/gpu_check_<device>.log (every phase's output) and
# benchmarks/results/gpu_check_<device>.json (the GPU, date, versions, and per phase its
# status, time and failed tests), copied into $OUT as well when that folder exists.
# Exit status: 0 when every phase that ran passed, 1 otherwise, 2 without a CUDA GPU.
#
# Python: the project's .venv when it has CUDA, else $PYTHON or python3 with a CUDA build
# of torch and triton (pytest and hypothesis for the test phases; without them those phases
# are skipped and say so). GPU_CHECK_DEPS names a folder of extra pure-Python packages
# (`pip install --target DIR pytest hypothesis`) for a machine that cannot install them.
# GPU_CHECK_RESULTS names another results folder; GPU_CHECK_ALLOW_CPU=1 runs the phases
# without a GPU: both only for testing this script.
set -uo pipefail
cd "$(dirname "$0")/.."

budget=540
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) budget="$2"; shift 2 ;;
        *) echo "usage: scripts/gpu_check.sh [--budget SECONDS]" >&2; exit 2 ;;
    esac
done
start=$(date +%s)
deadline=$((start + budget))

. scripts/find_python.sh  # (the working directory is the repository root)
export PYTHONPATH="$PWD${GPU_CHECK_DEPS:+:$GPU_CHECK_DEPS}${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET  # compile the kernels for the GPU

if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ] \
    && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "scripts/gpu_check.sh needs a CUDA GPU (torch.cuda.is_available() is False)" >&2
    exit 2
fi

results=${GPU_CHECK_RESULTS:-benchmarks/results}
mkdir -p "$results"
device=$("$PYTHON" -c "import torch; from minillm.lab.kernel_bench import device_slug
print(device_slug(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'))") \
    || { echo "$PYTHON cannot import torch and minillm" >&2; exit 2; }
log="$results/gpu_check_${device}.log"
json="$results/gpu_check_${device}.json"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
: > "$log"

# the results file: created now, one entry appended per phase (python, for the JSON)
"$PYTHON" - "$json" "$budget" <<'PY'
import datetime, importlib, json, platform, subprocess, sys
import torch
path, budget = sys.argv[1], int(sys.argv[2])
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
have = {}
for name in ("triton", "numpy", "tqdm", "safetensors", "tokenizers", "pytest", "hypothesis",
             "xdist", "transformers"):
    try:
        have[name] = getattr(importlib.import_module(name), "__version__", "present")
    except Exception as exc:
        have[name] = None
cuda = torch.cuda.is_available()
props = torch.cuda.get_device_properties(0) if cuda else None
result = {
    "gpu": torch.cuda.get_device_name() if cuda else None,
    "compute_capability": f"{props.major}.{props.minor}" if cuda else None,
    "sm_count": props.multi_processor_count if cuda else None,
    "memory_bytes": props.total_memory if cuda else None,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "versions": {"python": platform.python_version(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "packages": have,
                 "driver": run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
                 "minillm_commit": run("git", "rev-parse", "HEAD")},
    "budget_s": budget,
    "phases": [],
}
json.dump(result, open(path, "w"), indent=2)
print(json.dumps({k: result[k] for k in ("gpu", "compute_capability", "date", "versions")}))
PY
[ $? -eq 0 ] || { echo "could not start: $PYTHON lacks torch?" >&2; exit 2; }
cat "$json" >> "$log"

# record NAME STATUS EXIT SECONDS [REPORT]: one phase's entry in the results file (REPORT.xml
# from pytest, or REPORT.jsonl test by test when pytest was cut short)
record() {
    "$PYTHON" - "$json" "$@" <<'PY'
import json, sys
import xml.etree.ElementTree as ET
path, name, status, code, seconds = sys.argv[1:6]
entry = {"phase": name, "status": status, "exit_code": int(code), "seconds": int(seconds)}
if len(sys.argv) > 6:
    try:
        root = ET.parse(sys.argv[6] + ".xml").getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        counts = {key: sum(int(s.get(key, 0)) for s in suites)
                  for key in ("tests", "failures", "errors", "skipped")}
        failed = []
        for case in root.iter("testcase"):
            for problem in list(case.findall("failure")) + list(case.findall("error")):
                test = f"{case.get('classname')}::{case.get('name')}"
                failed.append({"test": test, "message": (problem.get("message") or "")[:500]})
        entry |= {"tests": counts, "failed": failed}
    except (OSError, ET.ParseError):  # cut short: the lines written test by test
        try:
            lines = [json.loads(line) for line in open(sys.argv[6] + ".jsonl")]
        except OSError:
            lines = []
        outcomes = [line["outcome"] for line in lines]
        entry["tests"] = {o: outcomes.count(o) for o in ("passed", "failed", "skipped")}
        entry["tests"]["report"] = "incomplete: cut short"
        entry["failed"] = [line for line in lines if line["outcome"] == "failed"]
result = json.load(open(path))
result["phases"].append(entry)
json.dump(result, open(path, "w"), indent=2)
print(f"== {name}: {status} (exit {code}, {seconds} s)")
PY
}

# copy what exists so far into $OUT (a remote run hands back only that folder)
sync_out() {
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        cp -r "$results"/gpu_check_"$device".* "$OUT"/ 2>/dev/null
        cp "$results"/kernels_"$device".json "$OUT"/ 2>/dev/null
        [ -d "$results/sweeps" ] && cp -r "$results/sweeps" "$OUT"/ 2>/dev/null
    fi
    return 0
}

failures=0
# phase NAME CAP_SECONDS [--junit] COMMAND...: run under min(CAP, time left), log, record
phase() {
    local name=$1 cap=$2 junit=""
    shift 2
    if [ "$1" = --junit ]; then  # pytest's report at the end, and test by test as it goes
        junit="$work/$name"
        shift
        set -- env MINILLM_TEST_REPORT="$junit.jsonl" "$@" --junitxml="$junit.xml"
    fi
    local left=$((deadline - $(date +%s) - 15))  # 15 s kept for the last record
    [ "$cap" -gt "$left" ] && cap=$left
    if [ "$cap" -lt 20 ]; then
        record "$name" "skipped: no time left" 0 0 | tee -a "$log"
        sync_out
        return 0
    fi
    echo "== $name: up to $cap s: $*" | tee -a "$log"
    local t0=$(date +%s)
    timeout --signal=TERM --kill-after=10 "$cap" "$@" >> "$log" 2>&1
    local code=$?
    local seconds=$(($(date +%s) - t0)) status=passed
    case $code in
        0) ;;
        5) status="passed: no tests selected"; code=0 ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    [ "$code" -ne 0 ] && failures=$((failures + 1))
    record "$name" "$status" "$code" "$seconds" ${junit:+"$junit"} | tee -a "$log"
    sync_out
}

has() { "$PYTHON" -c "import $1" 2>/dev/null; }
pytest_args=(-q -p no:cacheprovider -rfE --continue-on-collection-errors)
# compiling kernel variants is CPU work: spread it over processes when xdist is there
has xdist && pytest_args+=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))")
# every new shape class is a compile of its own: few hypothesis examples per test
export MINILLM_KERNEL_EXAMPLES=${MINILLM_KERNEL_EXAMPLES:-8}
benchmark_tests=(
    --deselect tests/kernels/test_benchmark.py::test_quick_benchmark_writes_its_results
    --deselect tests/kernels/test_benchmark.py::test_run_only_some_kernels
)
# the modules outside tests/kernels that hold GPU tests (others may need packages, the
# book's, that a GPU image lacks)
mapfile -t gpu_modules < <(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include="test_*.py" \
    | grep -v -e "^tests/kernels/" | sort)

if has pytest && has hypothesis; then
    phase kernels $((budget * 30 / 100)) --junit \
        "$PYTHON" -m pytest "${pytest_args[@]}" -m gpu tests/kernels "${benchmark_tests[@]}"
else
    record kernels "skipped: pytest or hypothesis missing" 0 0 | tee -a "$log"
fi
phase bench $((budget * 25 / 100)) \
    "$PYTHON" -m minillm.lab.kernel_bench --quick --out "$results"
if has pytest && has hypothesis && [ "${#gpu_modules[@]}" -gt 0 ]; then
    phase gpu-tests $((budget * 15 / 100)) --junit \
        "$PYTHON" -m pytest "${pytest_args[@]}" -m gpu "${gpu_modules[@]}"
    phase oracles $((budget * 15 / 100)) --junit \
        "$PYTHON" -m pytest "${pytest_args[@]}" -m "not gpu and not slow" tests/kernels \
        --ignore=tests/kernels/test_gpu_compile.py "${benchmark_tests[@]}"
else
    record gpu-tests "skipped: pytest or hypothesis missing" 0 0 | tee -a "$log"
fi
phase sweeps $((budget * 20 / 100)) \
    "$PYTHON" -m minillm.lab.kernel_bench --only --no-graphs --sweeps --out "$results/sweeps"
# the full benchmark replaces the quick file only once it is complete
mkdir -p "$work/full"
phase bench-full "$budget" "$PYTHON" -m minillm.lab.kernel_bench --out "$work/full" \
    && [ -f "$work/full/kernels_$device.json" ] \
    && "$PYTHON" -c "import json, sys; sys.exit(not json.load(open(sys.argv[1]))['complete'])" \
        "$work/full/kernels_$device.json" \
    && cp "$work/full/kernels_$device.json" "$results/" && sync_out

echo "== done in $(($(date +%s) - start)) s of $budget; results: $json, $log" | tee -a "$log"
sync_out
[ "$failures" -eq 0 ]
