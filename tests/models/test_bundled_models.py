"""The bundled stdlib models: transformers loads them unchanged, and their cards tell the truth.

`transformers` is the oracle throughout: its Llama and its tokenizer share no code with
minillm's. The held-out loss is recomputed with it and compared with the number that
`python -m minillm.training.train card` wrote into training_summary.json and the README.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import math
import os
import pathlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import SamplingParams
from minillm.llm import LLM
from minillm.model.loader import BUNDLED_MODELS_DIR, DEFAULT_MODEL, load_model, resolve_model_path
from minillm.model.tokenizer import Tokenizer

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

NAMES = ["minillm-stdlib-target", "minillm-stdlib-draft"]
MODELS_DIR = BUNDLED_MODELS_DIR
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:'
# Recomputing the loss with another implementation changes float32 summation order only.
HELDOUT_LOSS_ATOL = 2e-3


@pytest.fixture(scope="module", params=NAMES)
def model_dir(request) -> pathlib.Path:
    return MODELS_DIR / request.param


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def summary(model_dir) -> dict:
    return json.loads((model_dir / "training_summary.json").read_text())


def test_bundled_names_resolve():
    assert DEFAULT_MODEL == "minillm-stdlib-target"
    for name in NAMES:
        assert resolve_model_path(name) == BUNDLED_MODELS_DIR / name


def test_hf_files(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    assert generation["do_sample"] is False
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_training_writes_the_shipped_tokenizer_config(model_dir):
    # a retrained model keeps what the shipped one has, the chat template included
    from minillm.training.corpus import tokenizer_config

    shipped = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config() == shipped
    assert "{% for message in messages %}" in shipped["chat_template"]


def test_models_fit_in_the_package():
    sizes = [p.stat().st_size for n in NAMES for p in (MODELS_DIR / n).iterdir()]
    assert sum(sizes) < 40 * 2**20
    # every file is package data: pyproject's glob must match it, or a wheel would lack it
    pyproject = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert 'minillm = ["bundled/*/*"]' in pyproject
    for name in NAMES:
        for path in (MODELS_DIR / name).iterdir():
            assert path.is_file(), f"{path}: a subdirectory is not matched by models/*/*"
            assert fnmatch.fnmatch(f"models/{name}/{path.name}", "models/*/*")


def test_same_logits_as_transformers(model_dir, hf_model, hf_tokenizer):
    ids = hf_tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 0  # BOS first, as in training
    ours = load_model(model_dir, dtype="float32").model
    with torch.no_grad():
        expected = hf_model(ids).logits
        actual = ours.forward_causal(ids)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@settings(max_examples=50)
@given(text=st.text())
def test_tokenizer_round_trips_and_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode(text) == hf_tokenizer(text).input_ids
    assert tokenizer.encode(text) == [0] + ids


def test_newline_is_its_own_token(tokenizer):
    ids = tokenizer.encode("import os\n    x", add_special_tokens=False)
    assert tokenizer.decode(ids[2:3]) == "\n"


def oracle_loss(hf_model, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy over the windows, by `transformers` and plain torch."""
    total = 0.0
    with torch.no_grad():
        for chunk in windows.split(16):
            logits = hf_model(chunk[:, :-1]).logits
            total += F.cross_entropy(
                logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
            ).item()
    return total / windows[:, 1:].numel()


def test_heldout_loss_matches_card(model_dir, hf_model, summary):
    windows = torch.tensor(json.loads((model_dir / "heldout_tokens.json").read_text())["token_ids"])
    loss = oracle_loss(hf_model, windows)
    evaluation = summary["evaluation"]
    assert loss == pytest.approx(evaluation["heldout_loss"], abs=HELDOUT_LOSS_ATOL)
    assert math.exp(loss) == pytest.approx(evaluation["heldout_perplexity"], rel=HELDOUT_LOSS_ATOL)
    card = (model_dir / "README.md").read_text()
    assert f"{evaluation['heldout_loss']:.4f} nats/token" in card
    assert f"{summary['num_parameters']:,}" in card


def test_foreign_loss_and_headers_match_card(model_dir, hf_model, hf_tokenizer, summary):
    foreign = json.loads((model_dir / "foreign_tokens.json").read_text())
    windows = torch.tensor(foreign["token_ids"])
    assert windows.shape == (64, 257)
    loss = oracle_loss(hf_model, windows)
    evaluation = summary["evaluation"]
    assert evaluation["foreign_num_windows"] == 64
    assert evaluation["foreign_sources"] == foreign["sources"]
    assert loss == pytest.approx(evaluation["foreign_loss"], abs=HELDOUT_LOSS_ATOL)
    assert math.exp(loss) == pytest.approx(evaluation["foreign_perplexity"], rel=HELDOUT_LOSS_ATOL)
    # the card's count is the count of its own per-header verdicts, and each verdict is ast's
    headers = evaluation["headers"]
    assert len(headers) == 10
    assert evaluation["headers_parsed"] == sum(h["parses"] for h in headers)
    for h in headers:
        try:
            ast.parse(h["header"] + h["body"])
            ok = True
        except SyntaxError:
            ok = False
        assert h["parses"] == ok
        assert h["completion"].startswith(h["body"])
    # the first header's completion, redone with transformers' greedy generate
    first = headers[0]
    ids = hf_tokenizer(first["header"], return_tensors="pt").input_ids
    out = hf_model.generate(ids, max_new_tokens=96, do_sample=False, eos_token_id=1, pad_token_id=2)
    new = out[0, ids.shape[1] :].tolist()
    assert hf_tokenizer.decode(new, skip_special_tokens=True) == first["completion"]
    card = (model_dir / "README.md").read_text()
    assert f"{evaluation['foreign_loss']:.4f} nats/token" in card
    assert f"{evaluation['headers_parsed']} of 10" in card
    for source in foreign["sources"]:
        assert f"{source['name']} {source['version']} ({source['license']})" in card


def test_parameter_count_in_summary(model_dir, hf_model, summary):
    assert summary["num_parameters"] == sum(p.numel() for p in hf_model.parameters())


def test_draft_agreement_is_recorded():
    """The draft card's acceptance is the one the bundled pair gives now: a target or a draft
    retrained without re-recording its card fails here."""
    from minillm.training.model_card import draft_acceptance

    recorded = json.loads((MODELS_DIR / NAMES[1] / "training_summary.json").read_text())[
        "evaluation"
    ]["acceptance"]
    assert 0.0 < recorded["greedy_acceptance_rate"] <= 1.0
    assert recorded["mean_tokens_per_round"] == pytest.approx(
        recorded["mean_accepted_per_round"] + 1, abs=1e-3
    )
    target, draft = (load_model(MODELS_DIR / name, dtype="float32") for name in NAMES)
    tokenizer = target.tokenizer
    measured = draft_acceptance(draft.model, target.model, tokenizer, tokenizer.eos_token_id)
    assert measured["num_positions"] == recorded["num_positions"]
    # the same counts up to a greedy tie that another CPU's float32 sums may break otherwise
    for key in ("greedy_acceptance_rate", "mean_accepted_per_round"):
        assert measured[key] == pytest.approx(recorded[key], abs=0.02), key


def test_greedy_generation_is_deterministic_and_matches_transformers(model_dir, hf_model):
    llm = LLM(model_dir, dtype="float32", num_gpu_blocks=64, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["class Stack:", "for i in range("]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == second
    tokenizer = llm.get_tokenizer()
    for prompt, ids in zip(prompts, first, strict=True):
        prompt_ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            expected = hf_model.generate(
                prompt_ids, max_new_tokens=24, do_sample=False, eos_token_id=None
            )
        assert list(ids) == expected[0, prompt_ids.shape[1] :].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_card_is_rendered_from_the_summary(name):
    """Each README is `render_card` of its training_summary.json: no number is typed by hand,
    and a card for a corpus with installed packages names them and how to reproduce it."""
    from minillm.training.model_card import render_card

    summary = json.loads((MODELS_DIR / name / "training_summary.json").read_text())
    card = (MODELS_DIR / name / "README.md").read_text()
    assert card == render_card(summary, summary["evaluation"])
    corpus = summary["corpus"]
    if corpus.get("site_packages"):
        assert f"{corpus['num_site_packages_files']:,} `.py` files" in card
        assert "--site-packages" in card
        largest = next(iter(corpus["site_packages_files_per_package"]))
        assert largest in card
    assert ("--no-docstrings" in card) == bool(corpus.get("no_docstrings"))
