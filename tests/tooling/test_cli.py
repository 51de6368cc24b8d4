"""The `minillm` entry point: subcommands from several modules, exit codes passed through."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from minillm.cli.main import SUBCOMMANDS, build_parser, main

from .conftest import SOLUTION_CELLS, notebook, write_notebook


def test_each_subcommand_sets_its_handler():
    for argv in (["grade", "x.ipynb"], ["exercises", "release"], ["exercises", "check"]):
        assert callable(build_parser(argv[0]).parse_args(argv).func)


def test_every_listed_subcommand_module_adds_the_subcommand_it_is_listed_under():
    import argparse
    import importlib

    for name, (module, _help) in SUBCOMMANDS.items():
        subparsers = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).add_parser(subparsers)
        assert list(subparsers.choices) == [name], module


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )


NOTEBOOK_TOOLING = ("nbformat", "nbclient", "IPython", "ipywidgets", "matplotlib", "myst_nb")


def test_generate_imports_no_notebook_tooling():
    code = (
        "import sys\n"
        "from minillm.cli.main import main\n"
        "status = main(['generate', 'def f(x):', '--max-tokens', '2', '--no-stream'])\n"
        f"print(status, sorted(m for m in {NOTEBOOK_TOOLING!r} if m in sys.modules))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "0 []"


def test_user_errors_print_one_line_and_exit_2(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    script = pathlib.Path(sys.executable).parent / "minillm"
    for argv in (
        ["generate", "x", "--temperature", "-1"],
        ["generate", "x", "--model", str(tmp_path)],
        ["generate", "x", "--model", str(tmp_path / "missing")],
        ["generate", "x", "--max-tokens", "0"],
    ):
        result = subprocess.run(
            [str(script), *argv], capture_output=True, text=True, timeout=300, check=False
        )
        assert result.returncode == 2, (argv, result.stderr)
        assert "Traceback" not in result.stderr, argv
        assert len(result.stderr.strip().splitlines()) == 1, (argv, result.stderr)


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
