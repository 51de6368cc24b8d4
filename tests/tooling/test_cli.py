"""The `minillm` entry point: subcommands from several modules, exit codes passed through."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from minillm.cli import build_parser, main

from .conftest import SOLUTION_CELLS, notebook, write_notebook


def test_each_subcommand_sets_its_handler():
    parser = build_parser()
    for argv in (["grade", "x.ipynb"], ["exercises", "release"], ["exercises", "check"]):
        assert callable(parser.parse_args(argv).func)


def test_help_exits_0_and_usage_errors_exit_2(capsys):
    assert main(["--help"]) == 0
    assert "exercises" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["no-such-command"]) == 2
    assert main(["exercises"]) == 2


def test_console_script_propagates_the_exit_status(project):
    write_notebook(project.solutions / "ch01.ipynb", notebook(SOLUTION_CELLS))
    script = pathlib.Path(sys.executable).parent / "minillm"
    check = [str(script), "exercises", "check", *project.cli_folders()]
    result = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "ch01.ipynb: missing" in result.stderr
    release = [str(script), "exercises", "release", *project.cli_folders()]
    assert subprocess.run(release, capture_output=True, timeout=120).returncode == 0
    assert (project.exercises / "ch01.ipynb").exists()
