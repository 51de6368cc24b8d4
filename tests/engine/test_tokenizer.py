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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("abc\ud800", r"'\\ud800' at index 3 is a lone surrogate \(half of a UTF-16 pair\)"),
        ("\udfffx", r"'\\udfff' at index 0 is a lone surrogate"),
        # how Python reads the byte 0xff of a command line that is not UTF-8
        (b"ab\xff".decode("utf-8", "surrogateescape"), r"the byte 0xff of text that was not"),
    ],
)
def test_a_lone_surrogate_is_a_value_error(tokenizer, text, message):
    with pytest.raises(ValueError, match="^the prompt is not valid Unicode: .*" + message):
        tokenizer.encode(text)


@given(st.text(), st.integers(0, 20), st.integers(0xD800, 0xDFFF))
def test_any_text_with_a_lone_surrogate_is_refused(tokenizer, text, at, surrogate):
    at = min(at, len(text))
    bad = text[:at] + chr(surrogate) + text[at:]
    with pytest.raises(ValueError, match=f"at index {at} is a lone surrogate"):
        tokenizer.encode(bad)


@pytest.mark.parametrize("value", [b"abc", None, 5, ["a"]])
def test_a_prompt_that_is_not_a_str_is_a_value_error(tokenizer, value):
    with pytest.raises(ValueError, match=f"^the prompt must be a str, got {type(value).__name__}$"):
        tokenizer.encode(value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is not a valid tokenizer.json: EOF while parsing"),
        (b'{"version": "1.0", "model": ', "is not a valid tokenizer.json: EOF while parsing"),
        (b'{"a": 1}', "is not a valid tokenizer.json: "),
        (b"\xff\xfe garbage", "is not a valid tokenizer.json: "),
    ],
)
def test_a_corrupt_tokenizer_json_is_one_value_error_naming_it(tmp_path, content, message):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError) as error:
        Tokenizer(tmp_path)
    assert type(error.value) is ValueError
    assert str(error.value).startswith(str(tmp_path / "tokenizer.json") + " " + message)
    assert "\n" not in str(error.value)
    assert error.value.__cause__ is None and error.value.__suppress_context__


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json"])
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"eos_token": "</s>"', " is not valid JSON: Expecting"),
        ('["</s>"]', " must hold a JSON object, got list"),
        ('{"eos_token": 5}', ': eos_token must be null, a string or {"content": string}, got 5'),
        ('{"bos_token": {"content": 1}}', ": bos_token must be null, a string or"),
    ],
)
def test_a_corrupt_special_tokens_file_is_one_value_error_naming_it(
    tokenizer_dir, tmp_path, name, content, message
):
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError) as error:
        Tokenizer(tmp_path)
    assert str(error.value).startswith(f"{tmp_path / name}{message}")


def test_tokenizer_config_wins_over_special_tokens_map(tokenizer_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    # a map naming a token the vocabulary lacks is fine when the config overrides it
    (tmp_path / "special_tokens_map.json").write_text('{"eos_token": "<eos>", "pad_token": "<s>"}')
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    tok = Tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (None, 1, 0)
