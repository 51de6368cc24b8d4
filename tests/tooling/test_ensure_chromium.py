"""scripts/ensure_chromium.sh: make test gets headless Chromium, or says the one command to run."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ensure_chromium.sh"
BASH = shutil.which("bash")


def fake_bin(tmp_path: pathlib.Path, **programs: str) -> pathlib.Path:
    """A PATH of small shell scripts standing in for id, sudo, apt-get and chromium."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in programs.items():
        path = bin_dir / name.replace("_", "-")
        path.write_text(f"#!{BASH}\n{body}\n")
        path.chmod(0o755)
    return bin_dir


def run(bin_dir: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BASH, str(SCRIPT)], env={"PATH": str(bin_dir)}, capture_output=True, text=True
    )


def test_present_chromium_is_left_alone(tmp_path):
    result = run(fake_bin(tmp_path, chromium="exit 0", id="echo 1000"))
    assert result.returncode == 0 and result.stdout == "" and result.stderr == ""


def test_without_rights_it_stops_with_the_command_to_run(tmp_path):
    result = run(fake_bin(tmp_path, id="echo 1000", apt_get="exit 0"))
    assert result.returncode == 1
    assert "sudo apt-get install chromium" in result.stderr


def test_as_root_it_installs_chromium(tmp_path):
    log = tmp_path / "apt.log"
    result = run(fake_bin(tmp_path, id="echo 0", apt_get=f'echo "$@" >> {log}'))
    assert result.returncode == 0
    assert "install -y --no-install-recommends chromium" in log.read_text()
