"""`minillm serve`: its options reach the engine, and the command serves until interrupted."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from minillm.cli.main import build_parser, main
from minillm.cli.serve import engine_options


def test_engine_options_pass_through_with_vllms_flag_names():
    args = build_parser("serve").parse_args(
        [
            "serve",
            "some/model",
            "--port",
            "9001",
            "--block-size",
            "32",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "512",
            "--max-model-len",
            "128",
            "--no-enable-prefix-caching",
        ]
    )
    assert (args.model, args.port, args.host) == ("some/model", 9001, "127.0.0.1")
    assert engine_options(args) == {
        "block_size": 32,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 512,
        "max_model_len": 128,
        "enable_prefix_caching": False,
    }


def test_parallel_sizes_pass_through_to_the_engine():
    args = build_parser("serve").parse_args(
        ["serve", "--tensor-parallel-size", "2", "--enable-expert-parallel"]
    )
    assert engine_options(args) == {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    args = build_parser("serve").parse_args(["serve", "--pipeline-parallel-size", "2"])
    assert engine_options(args) == {"pipeline_parallel_size": 2}


def test_a_bad_parallel_size_is_a_one_line_error(capsys):
    assert main(["serve", "--tensor-parallel-size", "0", "--port", "1"]) == 2
    assert "tensor_parallel_size must be an int >= 1" in capsys.readouterr().err


def test_a_bad_engine_option_is_a_one_line_error(capsys):
    assert main(["serve", "--max-num-seqs", "0", "--port", "1"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_serves_on_loopback_until_interrupted():
    port = free_port()
    env = {**os.environ, "MINILLM_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "minillm.cli.main", "serve", "--port", str(port)]
    command += ["--max-model-len", "128", "--served-model-name", "stdlib", "--log-level", "error"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["stdlib"]
        assert models["data"][0]["max_model_len"] == 128
        body = {"model": "stdlib", "prompt": "def f(x):", "max_tokens": 3}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err.decode()
    assert f"http://127.0.0.1:{port}" in out.decode()


def test_a_port_in_use_fails_before_the_model_loads(monkeypatch):
    from minillm.serve import server as server_module

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was bound")

    monkeypatch.setattr(server_module, "make_server_app", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError):
            server_module.serve_forever(port=port)
