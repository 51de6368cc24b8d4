"""Corrupt model directories: every broken file is one ValueError (or FileNotFoundError)
whose one-line message names the file and what is wrong, never an exception from deep inside
json, safetensors, tokenizers or torch.

The corrupted directories are copies of the bundled draft model, each with one thing broken.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
import safetensors.torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.model.config import ModelConfig
from minillm.model.loader import BUNDLED_MODELS_DIR, load_model

DRAFT = BUNDLED_MODELS_DIR / "minillm-stdlib-draft"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.fixture
def model_copy(tmp_path) -> pathlib.Path:
    """A copy of the draft model's loadable files, to break."""
    out = tmp_path / "model"
    out.mkdir()
    for name in MODEL_FILES:
        shutil.copyfile(DRAFT / name, out / name)
    return out


def truncate(name: str, size: int | None = None) -> Callable[[pathlib.Path], None]:
    """Cut a file to `size` bytes (half of it when None)."""

    def mutate(path: pathlib.Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: len(data) // 2 if size is None else size])

    return mutate


def write(name: str, content: str | bytes) -> Callable[[pathlib.Path], None]:
    def mutate(path: pathlib.Path) -> None:
        if isinstance(content, bytes):
            (path / name).write_bytes(content)
        else:
            (path / name).write_text(content)

    return mutate


def edit_json(name: str, **changes) -> Callable[[pathlib.Path], None]:
    """Set keys of a JSON file; a value of ... deletes the key."""

    def mutate(path: pathlib.Path) -> None:
        data = json.loads((path / name).read_text())
        for key, value in changes.items():
            if value is ...:
                del data[key]
            else:
                data[key] = value
        (path / name).write_text(json.dumps(data))

    return mutate


def edit_weights(change: Callable[[dict], None]) -> Callable[[pathlib.Path], None]:
    def mutate(path: pathlib.Path) -> None:
        state = safetensors.torch.load_file(path / "model.safetensors")
        change(state)
        safetensors.torch.save_file(state, path / "model.safetensors")

    return mutate


def remove(*names: str) -> Callable[[pathlib.Path], None]:
    def mutate(path: pathlib.Path) -> None:
        for name in names:
            (path / name).unlink()

    return mutate


def shard(change_index: Callable[[dict], None]) -> Callable[[pathlib.Path], None]:
    """Split the weights over two shards with an index, then change the index."""

    def mutate(path: pathlib.Path) -> None:
        state = safetensors.torch.load_file(path / "model.safetensors")
        (path / "model.safetensors").unlink()
        names = sorted(state)
        weight_map = {}
        for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            file = f"model-{i + 1:05d}-of-00002.safetensors"
            safetensors.torch.save_file({n: state[n] for n in part}, path / file)
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {}, "weight_map": weight_map}
        change_index(index)
        (path / "model.safetensors.index.json").write_text(json.dumps(index))

    return mutate


def then(*mutations: Callable[[pathlib.Path], None]) -> Callable[[pathlib.Path], None]:
    def mutate(path: pathlib.Path) -> None:
        for mutation in mutations:
            mutation(path)

    return mutate


def set_key(key: str, value: object) -> Callable[[dict], None]:
    return lambda d: d.__setitem__(key, value)


def pop_norm(state: dict) -> None:
    del state["model.norm.weight"]


def narrow_norm(state: dict) -> None:
    state["model.norm.weight"] = state["model.norm.weight"][:-1].clone()


# (what is broken, the file whose path the message starts with, the exception, the rest)
CASES = [
    ("config.json truncated", truncate("config.json"), "config.json", ValueError,
     " is not valid JSON: Unterminated string"),
    ("config.json empty", truncate("config.json", 0), "config.json", ValueError,
     " is not valid JSON: Expecting value: line 1 column 1"),
    ("config.json not UTF-8", write("config.json", b"\xff\xfe{}"), "config.json", ValueError,
     " is not valid JSON: 'utf-8' codec can't decode byte 0xff"),
    ("config.json a list", write("config.json", "[1, 2]"), "config.json", ValueError,
     " must hold a JSON object, got list"),
    ("hidden_size missing", edit_json("config.json", hidden_size=...), "config.json",
     ValueError, ": required keys are missing: ['hidden_size']"),
    ("vocab_size a string", edit_json("config.json", vocab_size="4096"), "config.json",
     ValueError, ": vocab_size must be an int in [1, 2**31 - 1], got '4096'"),
    ("vocab_size negative", edit_json("config.json", vocab_size=-5), "config.json", ValueError,
     ": vocab_size must be an int in [1, 2**31 - 1], got -5"),
    ("num_attention_heads 0", edit_json("config.json", num_attention_heads=0), "config.json",
     ValueError, ": num_attention_heads must be an int in [1, 2**31 - 1], got 0"),
    ("rope_theta null", edit_json("config.json", rope_theta=None), "config.json", ValueError,
     ": rope_theta must be a finite number > 0, got None"),
    ("rope_scaling a list", edit_json("config.json", rope_scaling=[8]), "config.json",
     ValueError, ": rope_scaling must be null or a JSON object, got [8]"),
    ("llama3 rope without factor",
     edit_json("config.json", rope_scaling={"rope_type": "llama3", "low_freq_factor": 1}),
     "config.json", ValueError, ": rope_scaling['factor'] must be a finite number > 0"),
    ("tie_word_embeddings a string", edit_json("config.json", tie_word_embeddings="yes"),
     "config.json", ValueError, ": tie_word_embeddings must be true or false, got 'yes'"),
    ("torch_dtype a list", edit_json("config.json", torch_dtype=["bfloat16"]), "config.json",
     ValueError, ": torch_dtype must be one of ['bfloat16', 'float16', 'float32']"),
    ("eos_token_id beyond the vocabulary", edit_json("config.json", eos_token_id=99999),
     "config.json", ValueError, ": eos_token_id must be ids in [0, vocab_size=4096), got [99999]"),
    ("bos_token_id a float", edit_json("config.json", bos_token_id=0.5), "config.json",
     ValueError, ": bos_token_id must be null or an int in [0, vocab_size=4096), got 0.5"),
    ("architectures a string", edit_json("config.json", architectures="LlamaForCausalLM"),
     "config.json", ValueError, ": 'architectures' must name exactly one architecture"),
    ("weights truncated", truncate("model.safetensors"), "model.safetensors", ValueError,
     " is not a valid safetensors file: Error while deserializing header: incomplete metadata"),
    ("weights empty", truncate("model.safetensors", 0), "model.safetensors", ValueError,
     " is not a valid safetensors file: Error while deserializing header: header too small"),
    ("weights garbage", write("model.safetensors", b"garbage" * 100), "model.safetensors",
     ValueError, " is not a valid safetensors file: Error while deserializing header"),
    ("a tensor missing", edit_weights(pop_norm), "model.safetensors", ValueError,
     " lacks tensors the config requires: ['model.norm.weight']"),
    ("a tensor of the wrong shape", edit_weights(narrow_norm), "model.safetensors", ValueError,
     ": tensor model.norm.weight has shape (127,), expected (128,) from config.json"),
    ("index truncated", then(shard(lambda index: None), truncate("model.safetensors.index.json")),
     "model.safetensors.index.json", ValueError, " is not valid JSON: "),
    ("index without weight_map", shard(lambda index: index.clear()),
     "model.safetensors.index.json", ValueError,
     ": weight_map must be a non-empty object of tensor name -> shard file, got None"),
    ("index weight_map a list", shard(set_key("weight_map", ["a"])),
     "model.safetensors.index.json", ValueError, ": weight_map must be a non-empty object"),
    ("index shard outside the directory",
     shard(lambda index: index["weight_map"].update({"model.norm.weight": "../x.safetensors"})),
     "model.safetensors.index.json", ValueError,
     ": shard '../x.safetensors' is not a file name in"),
    ("tokenizer.json truncated", truncate("tokenizer.json"), "tokenizer.json", ValueError,
     " is not a valid tokenizer.json: EOF while parsing"),
    ("tokenizer.json empty", truncate("tokenizer.json", 0), "tokenizer.json", ValueError,
     " is not a valid tokenizer.json: EOF while parsing"),
    ("tokenizer.json not a tokenizer", write("tokenizer.json", '{"vocab": 1}'),
     "tokenizer.json", ValueError, " is not a valid tokenizer.json: "),
    ("tokenizer_config.json truncated", truncate("tokenizer_config.json"),
     "tokenizer_config.json", ValueError, " is not valid JSON: "),
    ("special token an int", edit_json("tokenizer_config.json", eos_token=5),
     "tokenizer_config.json", ValueError,
     ': eos_token must be null, a string or {"content": string}, got 5'),
    ("special_tokens_map.json truncated", truncate("special_tokens_map.json"),
     "special_tokens_map.json", ValueError, " is not valid JSON: "),
    ("generation_config.json truncated", truncate("generation_config.json"),
     "generation_config.json", ValueError, " is not valid JSON: "),
    ("generation_config.json a list", write("generation_config.json", "[]"),
     "generation_config.json", ValueError, " must hold a JSON object, got list"),
    ("generation eos a string", edit_json("generation_config.json", eos_token_id="</s>"),
     "generation_config.json", ValueError,
     ": eos_token_id must be null, a token id (an int >= 0) or a list of them, got '</s>'"),
    ("generation eos beyond the vocabulary",
     edit_json("generation_config.json", eos_token_id=[1, 5000]), "generation_config.json",
     ValueError, ": eos_token_id must be ids in [0, vocab_size=4096), got [5000]"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "file", "error_type", "rest"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_a_corrupt_file_is_one_error_naming_it(model_copy, mutate, file, error_type, rest):
    mutate(model_copy)
    with pytest.raises(Exception) as info:
        load_model(model_copy)
    error = info.value
    assert type(error) is error_type
    message = str(error)
    assert message.startswith(f"{model_copy / file}{rest}"), message
    assert "\n" not in message
    # raised where the file is read, not chained to an exception from a library
    assert error.__cause__ is None
    assert error.__context__ is None or error.__suppress_context__


def test_the_tokenizer_must_fit_the_model_vocabulary(model_copy):
    edit_json("config.json", vocab_size=4000)(model_copy)
    edit_weights(
        lambda state: state.update(
            {"model.embed_tokens.weight": state["model.embed_tokens.weight"][:4000].clone()}
        )
    )(model_copy)
    with pytest.raises(ValueError) as info:
        load_model(model_copy)
    assert str(info.value) == (
        f"{model_copy / 'tokenizer.json'} has 4096 tokens, more than the vocab_size=4000 of "
        f"{model_copy / 'config.json'}: they are not from one model"
    )


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        (MODEL_FILES, "expected config.json in {path}"),
        (("config.json",), "expected config.json in {path}"),
        (
            ("model.safetensors",),
            "expected model.safetensors or model.safetensors.index.json with its shards in {path}",
        ),
        (("tokenizer.json",), "expected a tokenizer.json file at {path}/tokenizer.json"),
    ],
)
def test_a_missing_file_is_a_file_not_found_error(model_copy, missing, message):
    remove(*missing)(model_copy)
    with pytest.raises(FileNotFoundError) as info:
        load_model(model_copy)
    assert str(info.value) == message.format(path=model_copy)


def test_the_optional_files_may_be_absent(model_copy):
    remove("generation_config.json", "special_tokens_map.json", "tokenizer_config.json")(model_copy)
    loaded = load_model(model_copy)
    assert loaded.generation_config == {}
    assert loaded.eos_token_ids == [1]  # from config.json
    assert loaded.tokenizer.eos_token_id is None


def test_an_intact_copy_loads_and_a_sharded_one_too(model_copy):
    assert load_model(model_copy).eos_token_ids == [1]
    shard(lambda index: None)(model_copy)
    assert not (model_copy / "model.safetensors").exists()
    assert load_model(model_copy).config.vocab_size == 4096


# ---- config.json: any junk in any key is a ValueError naming the key, or loads ----

DRAFT_CONFIG = json.loads((DRAFT / "config.json").read_text())
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300)
    | st.floats()
    | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)


@given(key=st.sampled_from(sorted(DRAFT_CONFIG)), value=JSON_VALUES)
def test_junk_in_a_config_key_is_a_value_error_naming_it(key, value):
    cfg = {**DRAFT_CONFIG, key: value}
    try:
        config = ModelConfig.from_hf_config(cfg, source="/m/config.json")
    except ValueError as error:
        assert str(error).startswith("/m/config.json: ")
        assert key in str(error)
        return
    # accepted: the value was a valid one, an unused key's, or a null one that means the default
    if key in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
        assert getattr(config, key) == value
    if key == "rope_theta":
        assert config.rope_theta == value
    if key == "tie_word_embeddings":
        assert config.tie_word_embeddings is value


@given(key=st.sampled_from(sorted(DRAFT_CONFIG)))
def test_a_missing_config_key_is_a_value_error_naming_it_or_a_default(key):
    cfg = {k: v for k, v in DRAFT_CONFIG.items() if k != key}
    try:
        ModelConfig.from_hf_config(cfg, source="/m/config.json")
    except ValueError as error:
        assert str(error).startswith("/m/config.json: ")
        assert key in str(error)


# ---- the command line: one line on stderr, exit status 2 ----


@pytest.mark.parametrize(
    ("mutate", "file"),
    [
        (truncate("model.safetensors"), "model.safetensors"),
        (truncate("tokenizer.json"), "tokenizer.json"),
    ],
)
def test_minillm_generate_reports_a_corrupt_model_in_one_line(model_copy, mutate, file):
    mutate(model_copy)
    script = pathlib.Path(sys.executable).parent / "minillm"
    result = subprocess.run(
        [str(script), "generate", "--model", str(model_copy), "x"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"minillm generate: error: {model_copy / file} is not a valid ")
