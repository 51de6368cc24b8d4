"""Tokenizer wrapper and incremental detokenization on a byte-level BPE trained here."""

from __future__ import annotations

import json

import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from minillm.model.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "数据中心的推理服务器 每秒生成很多令牌。大语言模型",
    "Emoji: 🙂🚀👍🏽 and flags 🇫🇷🇯🇵, accents: café naïve façade.",
    "Ελληνικά, русский язык, العربية, हिन्दी",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    out = tmp_path_factory.mktemp("tokenizer")
    backend.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return Tokenizer(tokenizer_dir)


def test_special_token_ids_from_tokenizer_config(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert tokenizer.id_to_token(1) == "</s>"
    assert tokenizer.vocab_size == 400


def test_without_tokenizer_config_special_ids_are_none(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir / "tokenizer.json")
    assert tok.eos_token_id == 1  # same directory: the config is still found
    alone = tokenizer_dir.parent / "bare"
    alone.mkdir(exist_ok=True)
    (alone / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    bare = Tokenizer(alone)
    assert (bare.bos_token_id, bare.eos_token_id, bare.pad_token_id) == (None, None, None)


def test_errors(tokenizer_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|eot\\|>'"):
        Tokenizer(tmp_path)


def test_skip_special_tokens(tokenizer):
    ids = [tokenizer.bos_token_id, *tokenizer.encode("fox"), tokenizer.eos_token_id]
    assert tokenizer.decode(ids) == "fox"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>fox</s>"


@given(st.text())
def test_encode_decode_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_emoji_split_over_byte_tokens_is_emitted_whole(tokenizer):
    # not in the corpus: its 4 UTF-8 bytes are 3 tokens, the first two shared with 🙂 and 🚀
    ids = tokenizer.encode("🦀")
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("crab: "))
    assert [detok.add_token(i) for i in ids] == ["", "", "🦀"]
    assert detok.text == "🦀"


@given(prompt=st.text(max_size=20), output=st.text(max_size=40))
def test_pieces_concatenate_to_the_decoded_output(tokenizer, prompt, output):
    output_ids = tokenizer.encode(output)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    pieces = [detok.add_token(i) for i in output_ids]
    assert "".join(pieces) == tokenizer.decode(output_ids) == output == detok.text
    if "\ufffd" not in output:
        assert not any("\ufffd" in piece for piece in pieces)


@given(
    prompt=st.text(max_size=10),
    output_ids=st.lists(st.integers(0, 399), max_size=30),
    skip_special_tokens=st.booleans(),
)
def test_arbitrary_ids_hold_back_only_an_unfinished_tail(
    tokenizer, prompt, output_ids, skip_special_tokens
):
    # a model may emit any ids, including bytes that never form a valid character
    prompt_ids = tokenizer.encode(prompt)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    for token_id in output_ids:
        detok.add_token(token_id)
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens)
    rest = full[len(tokenizer.decode(prompt_ids, skip_special_tokens)) :]
    assert rest.startswith(detok.text)
    assert rest == detok.text or rest.endswith("\ufffd")
