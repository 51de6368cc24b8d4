"""Which recorded results measured which weights.

A number in `benchmarks/results/` that depends on the bundled models' weights (a perplexity,
an acceptance rate, how often two caches agree) is true only of the weights it measured. Each
such record stores the SHA-256 of the safetensors files it ran (`weights_record`), and
`stale_results` lists the records whose weights are no longer the bundled ones, with the
command that records each again. Retraining a bundled model without re-recording them fails
minillm's tests.

Timing records of the same models (offline throughput, the traced decode step, overlap) are
not in the list: they depend on the architecture and the engine, not on the weights' values.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

from minillm.model.loader import resolve_model_path

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# result file -> the command that records it again
WEIGHT_DEPENDENT = {
    "quantization_cpu.json": "python -m minillm.lab.quant_bench",
    "kv_fp8_cpu.json": "python -m minillm.lab.kv_fp8_agreement",
    "batch_invariance_cpu.json": "python -m minillm.lab.batch_invariance",
    "spec_decode_cpu.json": "python -m minillm.lab.spec_bench --repeats 5 "
    "--json benchmarks/results/spec_decode_cpu.json",
}
# results of a bundled model whose numbers are times, not functions of the weights
TIMING_ONLY = {
    "offline_cpu.json",
    "offline_cpu_before.json",
    "offline_cpu_quiet.json",
    "offline_cpu_quiet_rerun.json",
    "offline_cpu_traced.json",
    "decode_trace_cpu.json",
    "overlap_cpu.json",
}
MODEL_KEYS = ("model", "target", "draft")  # where a record names the models it ran


def weights_fingerprint(model: str | pathlib.Path) -> str:
    """SHA-256 of a model directory's `*.safetensors` files, read in name order."""
    path = resolve_model_path(model)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors files")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()


def weights_record(*models: str) -> dict:
    """The `weights_sha256` entry of a record that ran `models`."""
    return {"weights_sha256": {model: weights_fingerprint(model) for model in models}}


def models_named(record: dict) -> list[str]:
    """The model names a record gives under MODEL_KEYS."""
    return [record[key] for key in MODEL_KEYS if isinstance(record.get(key), str)]


def stale_results(results_dir: pathlib.Path = RESULTS_DIR) -> list[str]:
    """One line per weight-dependent record that did not measure today's weights."""
    problems = []
    for name, command in WEIGHT_DEPENDENT.items():
        path = results_dir / name
        if not path.exists():
            continue  # a checkout without recorded results
        record = json.loads(path.read_text())
        recorded = record.get("weights_sha256", {})
        for model in models_named(record):
            if model not in recorded:
                problems.append(f"{name} names {model} but not its weights; run {command}")
            elif recorded[model] != weights_fingerprint(model):
                problems.append(f"{name} measured other weights of {model}; run {command}")
    return problems
