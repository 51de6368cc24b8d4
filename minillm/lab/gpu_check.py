"""The GPU check: everything that needs a CUDA GPU, in phases that fit one time budget.

    python -m minillm.lab.gpu_check [--budget SECONDS] [--out DIR] [--dry-run]

(`scripts/gpu_check.sh` runs it.) The default budget, 480 s, leaves a 15-minute GPU lease
room for the machine's start and a second try. The plan gives each phase a share of the
budget after a fixed reserve for the start; the shares sum to at most the budget, and a
phase never runs past its own. Each phase is its own process: a CUDA fault (an illegal
address, a device-side assert) poisons only that process's context, so it loses that phase
and no other. The goals come first, one per process, then the tests.

Out, in DIR (default benchmarks/results), written as each phase ends:
- gpu_check_<device>.jsonl: a first line with the device's state (nvidia-smi: clocks, power
  limit, MIG mode, other processes; torch's device properties; versions), then one line
  per phase: its name, status (passed, failed, timeout, skipped), exit code, seconds, budget.
- <phase>/: what the phase wrote (kernels_<device>.json for the benchmarks) and its log.
Exit status: 0 when every phase passed, 1 otherwise, 2 without a CUDA GPU (nothing run).

GPU_CHECK_FAIL_PHASE=<name> replaces that phase's command by a process that aborts as a
CUDA fault would (SIGABRT), to check that the phases after it still run and that the
failure is recorded. GPU_CHECK_ALLOW_CPU=1 runs the plan without a GPU: both for testing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

DEFAULT_BUDGET_S = 480
RESERVE_S = 20  # the start: imports, nvidia-smi, the results file
MIN_PHASE_S = 20  # a phase given less is skipped: a cold start alone takes that long
BENCH = [sys.executable, "-m", "minillm.lab.kernel_bench", "--quick", "--no-graphs"]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
PYTEST += ["--continue-on-collection-errors"]
if importlib.util.find_spec("xdist") is not None:  # compiling kernel variants is CPU work
    PYTEST += ["-n", str(min(8, os.cpu_count() or 1))]
BENCH_TESTS = [  # the benchmark's own GPU tests: the bench phases run it already
    "--deselect",
    "tests/kernels/test_benchmark.py::test_quick_benchmark_writes_its_results",
    "--deselect",
    "tests/kernels/test_benchmark.py::test_run_only_some_kernels",
]


ROOT = pathlib.Path(__file__).resolve().parents[2]


def gpu_test_modules(tests: pathlib.Path = ROOT / "tests") -> list[str]:
    """The test modules outside tests/kernels that hold GPU-marked tests (collecting only
    those keeps the book's packages, which a GPU image may lack, out of the run)."""
    marked = re.compile(r"@pytest\.mark\.gpu\b|pytestmark\s*=.*mark\.gpu")
    return sorted(
        str(path.relative_to(tests.parent))
        for path in tests.rglob("test_*.py")
        if "kernels" not in path.relative_to(tests).parts[:1] and marked.search(path.read_text())
    )


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    share: float  # of the budget left after RESERVE_S
    measures: str
    command: tuple[str, ...]  # "{out}" is replaced by the phase's output folder


PHASES = (
    Phase(
        "w4a16",
        0.16,
        "W4A16 (symmetric and with zero points) vs the dense fp16 matmul: decode GEMV M=1 "
        "and GEMM M=16 on the MLP up projection of Qwen3-0.6B, Llama 3.1 8B, Llama 3.3 70B",
        (*BENCH, "--only", "w4a16_decision", "quant_matmul", "--out", "{out}"),
    ),
    Phase(
        "decode",
        0.08,
        "paged decode attention at 64 x 4k, % of HBM bandwidth (goal >= 70%)",
        (*BENCH, "--only", "decode", "--out", "{out}"),
    ),
    Phase(
        "prefill",
        0.08,
        "FlashAttention prefill at 4 x 2048 vs SDPA's flash backend (goal <= 1.5x)",
        (*BENCH, "--only", "prefill", "--out", "{out}"),
    ),
    Phase(
        "mixed-step",
        0.10,
        "a model forward on a mixed batch (31 decodes + a 512-token chunk) and on each half",
        (*BENCH, "--only", "mixed_step", "--out", "{out}"),
    ),
    Phase(
        "cuda-graphs",
        0.08,
        "Qwen3-0.6B-shaped decode step, eager vs CUDA graph, batch 1 and 32",
        (sys.executable, "-m", "minillm.lab.kernel_bench", "--quick", "--only", "--out", "{out}"),
    ),
    Phase(
        "kernel-tests",
        0.25,
        "the kernels' GPU-marked tests: real sizes, split-K and split-KV, > 2^31 elements",
        (*PYTEST, "-m", "gpu", "tests/kernels", *BENCH_TESTS, "--junitxml={out}/report.xml"),
    ),
    Phase(
        "gpu-tests",
        0.08,
        "every other GPU-marked test: CUDA graphs, the engine and quantized models on the GPU",
        (*PYTEST, "-m", "gpu", *gpu_test_modules(), "--junitxml={out}/report.xml"),
    ),
    Phase(
        "oracles",
        0.10,
        "the kernels' hypothesis oracle tests compiled for the GPU (8 examples each)",
        (
            *PYTEST,
            "-m",
            "not gpu and not slow",
            "tests/kernels",
            "--ignore=tests/kernels/test_gpu_compile.py",
            *BENCH_TESTS,
            "--junitxml={out}/report.xml",
        ),
    ),
)


def plan(budget_s: int) -> list[dict]:
    """Each phase with its budget in whole seconds: its share of what the reserve leaves,
    or 0 (skipped) below MIN_PHASE_S. The budgets sum to at most budget_s - RESERVE_S."""
    usable = max(0, budget_s - RESERVE_S)
    rows = []
    for phase in PHASES:
        seconds = int(usable * phase.share)
        rows.append(
            {
                "phase": phase.name,
                "budget_s": seconds if seconds >= MIN_PHASE_S else 0,
                "measures": phase.measures,
            }
        )
    return rows


def print_plan(budget_s: int) -> None:
    rows = plan(budget_s)
    print(f"GPU check plan for a budget of {budget_s} s (start reserve {RESERVE_S} s):")
    for row in rows:
        budget = f"{row['budget_s']:4d} s" if row["budget_s"] else "skipped (too little time)"
        print(f"  {row['phase']:13s} {budget:>8s}  {row['measures']}")
    total = min(RESERVE_S, budget_s) + sum(row["budget_s"] for row in rows)
    print(f"total at most {total} s of {budget_s} s")


def run_command(command: list[str], timeout_s: int) -> subprocess.CompletedProcess | None:
    """The command's completed process, or None when it could not be run."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None


def device_state() -> dict:
    """What the results depend on besides the code: clocks, power limit, MIG mode, other
    processes on the GPU (nvidia-smi), and torch's view of the device."""
    import torch

    fields = (
        "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,"
        "power.limit,power.max_limit,enforced.power.limit,temperature.gpu,mig.mode.current,"
        "memory.total,memory.used,compute_mode,persistence_mode"
    )
    state: dict = {"nvidia_smi": None, "processes": None}
    smi = run_command(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"], 15)
    if smi is not None and smi.returncode == 0 and smi.stdout.strip():
        values = [v.strip() for v in smi.stdout.splitlines()[0].split(",")]
        state["nvidia_smi"] = dict(zip(fields.split(","), values, strict=False))
    apps = run_command(
        [
            "nvidia-smi",
            "--query-compute-apps=pid,process_name,used_memory",
            "--format=csv,noheader",
        ],
        15,
    )
    if apps is not None and apps.returncode == 0:
        state["processes"] = [line for line in apps.stdout.splitlines() if line.strip()]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        state |= {
            "gpu": torch.cuda.get_device_name(),
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "memory_bytes": props.total_memory,
        }
    git = run_command(["git", "rev-parse", "HEAD"], 15)
    state["versions"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "minillm_commit": git.stdout.strip() if git is not None and git.returncode == 0 else None,
    }
    return state


def append(path: pathlib.Path, entry: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_phase(phase: Phase, budget_s: int, out: pathlib.Path) -> dict:
    """Run one phase in its own process under its budget; its output goes to out/log.txt."""
    out.mkdir(parents=True, exist_ok=True)
    command = [part.replace("{out}", str(out)) for part in phase.command]
    if os.environ.get("GPU_CHECK_FAIL_PHASE") == phase.name:  # a CUDA fault, simulated
        command = [sys.executable, "-c", "import os; print('simulated fault'); os.abort()"]
    entry = {"phase": phase.name, "budget_s": budget_s, "command": command}
    start = time.monotonic()
    with (out / "log.txt").open("w") as log:
        # its own process group: at the deadline the phase's children (pytest's workers)
        # are stopped with it, and free the GPU for the next phase
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=budget_s)
            status = "passed" if code in (0, 5) else "failed"  # 5: pytest selected nothing
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            code, status = None, "timeout"
    entry |= {"status": status, "exit_code": code, "seconds": round(time.monotonic() - start, 1)}
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET_S, help="seconds in all")
    parser.add_argument("--out", default="benchmarks/results", help="results folder")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        print(f"--budget must be a positive number of seconds, got {args.budget}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_plan(args.budget)
        return 0
    import torch

    if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
        print(
            "the GPU check needs a CUDA GPU (torch.cuda.is_available() is False); "
            "--dry-run shows its plan",
            file=sys.stderr,
        )
        return 2
    from minillm.lab.kernel_bench import device_slug

    deadline = time.monotonic() + args.budget
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / f"gpu_check_{device_slug(name)}.jsonl"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results.write_text("")
    append(
        results,
        {
            "date": date,
            "budget_s": args.budget,
            "plan": plan(args.budget),
            "device": device_state(),
        },
    )
    failures = 0
    for phase, row in zip(PHASES, plan(args.budget), strict=True):
        budget_s = min(row["budget_s"], int(deadline - time.monotonic()))
        if budget_s < MIN_PHASE_S:
            entry = {"phase": phase.name, "budget_s": 0, "status": "skipped: no time left"}
        else:
            print(f"== {phase.name}: up to {budget_s} s: {phase.measures}", flush=True)
            entry = run_phase(phase, budget_s, out / phase.name)
            failures += entry["status"] != "passed"
        append(results, entry)
        print(f"== {phase.name}: {entry['status']}", flush=True)
    print(f"== done; results in {results}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
