"""LoRA adapters served by name (vLLM's --lora-modules): a completion whose `model` names an
adapter runs with it, and gives the tokens the engine gives offline with that adapter; the
base model's name runs without one; /v1/models lists both; an unknown name is a 404, and a
malformed module list is refused where it enters."""

from __future__ import annotations

import json
import pathlib
import sys
import time

import httpx
import pytest

from minillm import LLM, LoRARequest, SamplingParams
from minillm.model.lora import save_lora_adapter
from minillm.serve import run_server
from minillm.serve.server import lora_module_requests

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "engine"))  # the tiny model builder
from tiny_llama import build_tiny_llama, random_lora_weights  # noqa: E402

PROMPT = [5, 17, 42, 9, 77, 3, 11]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    from minillm.model.loader import load_model

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny"))
    model = load_model(model_dir, "float32").model
    weights = random_lora_weights(model, ("q_proj", "v_proj"), rank=4, seed=4)
    path = save_lora_adapter(tmp_path_factory.mktemp("adapter") / "attn", weights, 8.0)
    return model_dir, path


def complete(server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_an_adapter_is_selected_by_model_name(adapter_dir):
    model_dir, path = adapter_dir
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=4, max_loras=1)
    offline = LLM(model_dir, **options)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    lora = LoRARequest("attn", 1, str(path))
    [with_adapter] = offline.generate([PROMPT], params, lora_request=lora, use_tqdm=False)
    [without] = offline.generate([PROMPT], params, use_tqdm=False)
    assert with_adapter.outputs[0].text != without.outputs[0].text  # the adapter matters
    with run_server(model_dir, port=0, served_model_name="base", lora_modules=[f"attn={path}"],
                    **options) as server:  # fmt: skip
        adapted = complete(server, "attn")
        assert adapted.status_code == 200, adapted.text
        assert adapted.json()["model"] == "attn"
        assert adapted.json()["choices"][0]["text"] == with_adapter.outputs[0].text
        base = complete(server, "base")
        assert base.json()["choices"][0]["text"] == without.outputs[0].text
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("base", None), ("attn", "base")]
        # no path of the server's filesystem: the directory's name, the adapter's name
        assert [m["root"] for m in models] == [model_dir.name, "attn"]
        listing = httpx.get(server.url + "/v1/models").text
        assert str(path.parent) not in listing and str(model_dir.parent) not in listing
        missing = complete(server, "other")
        assert missing.status_code == 404
        assert "'base', 'attn'" in json.loads(missing.text)["error"]["message"]
        assert complete(server, "attn").status_code == 200  # still serving


def test_an_adapter_that_finds_every_slot_busy_is_a_503_to_retry(adapter_dir):
    """max_cpu_loras=1 and two adapters: while a stream runs on one, a request for the other
    cannot load it; it is answered 503 with Retry-After (not the client's fault), and served
    once the stream is done."""
    model_dir, path = adapter_dir
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=4, max_loras=1)
    modules = [f"one={path}", f"two={path}"]
    with run_server(model_dir, port=0, lora_modules=modules, **options) as server:
        step = server.engine.step

        def slow_step():  # the tiny model would finish the stream before the second request
            time.sleep(0.05)
            return step()

        server.engine.step = slow_step
        body = {"model": "one", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        url = server.url + "/v1/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the stream
            next(line for line in lines if line.startswith("data: {"))
            busy = complete(server, "two")
        assert busy.status_code == 503, busy.text
        assert busy.headers["retry-after"] == "1"
        error = busy.json()["error"]
        assert error["code"] == "lora_slots_busy" and "max_cpu_loras=1" in error["message"]
        deadline = time.monotonic() + 30  # the stream's abort reaches the engine thread
        while server.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert complete(server, "two").status_code == 200


def test_bad_lora_modules_are_refused_where_they_enter(adapter_dir, tmp_path):
    model_dir, path = adapter_dir
    with pytest.raises(ValueError, match="name=path"):
        lora_module_requests(["attn"], "base")
    with pytest.raises(ValueError, match="named twice"):
        lora_module_requests([f"a={path}", f"a={path}"], "base")
    with pytest.raises(ValueError, match="the base model's name"):
        lora_module_requests({"base": str(path)}, "base")
    assert lora_module_requests({"a": path, "b": path}, "base")["b"].lora_int_id == 2
    from minillm.serve.server import make_server_app

    with pytest.raises(ValueError, match="enable_lora=True"):
        make_server_app(model_dir, lora_modules=[f"a={path}"])
    with pytest.raises(ValueError, match="not a LoRA adapter directory"):
        make_server_app(model_dir, enable_lora=True, lora_modules=[f"a={tmp_path}"])


def test_the_command_line_takes_vllms_lora_flags():
    from minillm.cli.main import build_parser
    from minillm.cli.serve import engine_options

    args = build_parser("serve").parse_args(
        ["serve", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
         "--max-cpu-loras", "4", "--lora-modules", "sql=/a", "chat=/b"]
    )  # fmt: skip
    assert engine_options(args) == {
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4
    }  # fmt: skip
    assert args.lora_modules == ["sql=/a", "chat=/b"]
