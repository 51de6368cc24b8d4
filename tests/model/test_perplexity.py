"""Perplexity against an independent computation: transformers' Llama loaded from the same
bundled directory, with the cross-entropy written out by hand."""

import math

import pytest
import torch

from minillm.model.loader import BUNDLED_MODELS_DIR, load_model
from minillm.model.perplexity import heldout_windows, mean_cross_entropy, perplexity

TARGET = BUNDLED_MODELS_DIR / "minillm-stdlib-target"


def test_perplexity_matches_transformers_and_a_hand_written_cross_entropy():
    transformers = pytest.importorskip("transformers")
    windows = heldout_windows(TARGET)[:4]
    hf = transformers.LlamaForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits.double()
    log_probs = logits - logits.logsumexp(dim=-1, keepdim=True)
    nll = -log_probs.gather(2, windows[:, 1:, None]).mean()
    expected = math.exp(float(nll))

    model = load_model("minillm-stdlib-target", dtype="float32").model
    assert perplexity(model, windows, batch_size=3) == pytest.approx(expected, rel=1e-4)
    assert 5 < expected < 40  # a trained model, not a uniform guess over 4096 tokens


def test_windows_and_arguments():
    windows = heldout_windows(TARGET)
    assert windows.shape == (64, 257) and windows.dtype == torch.int64
    model = load_model("minillm-stdlib-target", dtype="float32").model
    # one window or in batches: the same mean over every predicted token
    both = mean_cross_entropy(model, windows[:2], batch_size=2)
    apart = [mean_cross_entropy(model, windows[i : i + 1]) for i in range(2)]
    assert both == pytest.approx(sum(apart) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="window_len >= 2"):
        perplexity(model, windows[:, :1])
    with pytest.raises(ValueError, match="batch_size"):
        perplexity(model, windows[:1], batch_size=0)
    with pytest.raises(FileNotFoundError, match="heldout_tokens.json"):
        heldout_windows(BUNDLED_MODELS_DIR)
