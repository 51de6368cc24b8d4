"""Recorded results that depend on the bundled weights say which weights they measured."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from minillm.lab import recorded
from minillm.model.loader import BUNDLED_MODELS_DIR


def test_every_weight_dependent_result_measured_the_bundled_weights():
    assert recorded.stale_results() == []


def test_each_result_of_a_bundled_model_is_classified():
    """A new result that names a bundled model must say whether its numbers follow the weights."""
    bundled = {p.name for p in BUNDLED_MODELS_DIR.iterdir() if p.is_dir()}
    assert not set(recorded.WEIGHT_DEPENDENT) & recorded.TIMING_ONLY
    naming = set()
    for path in recorded.RESULTS_DIR.glob("*.json"):
        record = json.loads(path.read_text())
        if isinstance(record, dict) and set(recorded.models_named(record)) & bundled:
            naming.add(path.name)
    assert naming == set(recorded.WEIGHT_DEPENDENT) | recorded.TIMING_ONLY
    for name in recorded.WEIGHT_DEPENDENT:
        assert "weights_sha256" in json.loads((recorded.RESULTS_DIR / name).read_text())


def test_fingerprint_is_the_sha256_of_the_safetensors_files_in_name_order(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"second")
    (tmp_path / "a.safetensors").write_bytes(b"first")
    (tmp_path / "config.json").write_text("{}")
    assert recorded.weights_fingerprint(tmp_path) == hashlib.sha256(b"firstsecond").hexdigest()
    (tmp_path / "config.json").write_text('{"changed": 1}')  # not weights
    assert recorded.weights_fingerprint(tmp_path) == hashlib.sha256(b"firstsecond").hexdigest()
    (tmp_path / "b.safetensors").write_bytes(b"secone")
    assert recorded.weights_fingerprint(tmp_path) != hashlib.sha256(b"firstsecond").hexdigest()


def test_a_directory_without_weights_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no .safetensors"):
        recorded.weights_fingerprint(tmp_path)


def test_other_or_missing_weights_are_named_with_the_command(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(recorded.RESULTS_DIR, results)
    spec = json.loads((results / "spec_decode_cpu.json").read_text())
    spec["weights_sha256"]["minillm-stdlib-draft"] = "0" * 64
    (results / "spec_decode_cpu.json").write_text(json.dumps(spec))
    quant = json.loads((results / "quantization_cpu.json").read_text())
    del quant["weights_sha256"]
    (results / "quantization_cpu.json").write_text(json.dumps(quant))
    (results / "kv_fp8_cpu.json").unlink()  # not recorded in this checkout: nothing to check
    problems = recorded.stale_results(results)
    assert problems == [
        "quantization_cpu.json names minillm-stdlib-target but not its weights; run "
        + recorded.WEIGHT_DEPENDENT["quantization_cpu.json"],
        "spec_decode_cpu.json measured other weights of minillm-stdlib-draft; run "
        + recorded.WEIGHT_DEPENDENT["spec_decode_cpu.json"],
    ]
