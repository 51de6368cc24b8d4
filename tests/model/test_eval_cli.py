"""`minillm eval ppl`: float and quantized perplexity from the command line."""

import re

import pytest

from minillm.cli import main as cli

EVAL = ("minillm.cli.eval", "measure a model: perplexity, weight bytes")


@pytest.fixture(autouse=True)
def eval_subcommand(monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "eval", EVAL)


def run(capsys, *argv):
    # 8 windows: on two, int4's small loss can fall inside the windows' noise
    status = cli.main(["eval", "ppl", "--num-windows", "8", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_float_and_int4_perplexity(capsys):
    status, out, _ = run(capsys)
    assert status == 0
    float_ppl, float_mib = map(
        float, re.search(r"perplexity ([\d.]+).* ([\d.]+) MiB", out).groups()
    )
    assert "minillm-stdlib-target (float32)" in out and "8 windows of 257 tokens" in out
    status, out, err = run(capsys, "--quantization", "int4")
    assert status == 0 and "(int4 rtn)" in out and "quantized in" in err
    int4_ppl, int4_mib = map(float, re.search(r"perplexity ([\d.]+).* ([\d.]+) MiB", out).groups())
    assert float_ppl < int4_ppl < 1.1 * float_ppl
    assert int4_mib < 0.35 * float_mib


def test_bad_options_exit_with_status_2(capsys):
    status, _, err = run(capsys, "--quantization", "int4", "--group-size", "48")
    assert status == 2 and "group_size must be one of" in err
    status, _, err = run(capsys, "--quantization", "fp8", "--quantization-method", "awq")
    assert status == 2 and "fp8" in err
