"""Text <-> token ids, and detokenization one generated token at a time.

`Tokenizer` wraps a Hugging Face `tokenizer.json` (the `tokenizers` library) and reads the
special tokens from `tokenizer_config.json`. `IncrementalDetokenizer` turns a stream of
generated ids into text without ever emitting half of a multi-byte character.
"""

from __future__ import annotations

import os
import pathlib

import tokenizers

from minillm.model.config import read_json

# Prompt tokens decoded with the first output tokens, so that decoders which treat the
# start of a text specially (a leading-space marker, for one) see the same context.
INITIAL_PREFIX_TOKENS = 5


def _token_content(value: object, key: str, source: pathlib.Path) -> str | None:
    """A special token in tokenizer_config.json: "<s>" or {"content": "<s>", ...}, or null."""
    content = value.get("content") if isinstance(value, dict) else value
    if content is not None and not isinstance(content, str):
        raise ValueError(
            f'{source}: {key} must be null, a string or {{"content": string}}, got {value!r}'
        )
    return content


class Tokenizer:
    """A `tokenizer.json` tokenizer with its bos/eos/pad token ids."""

    def __init__(self, path: str | os.PathLike) -> None:
        """path: a tokenizer.json file, or the directory holding it (and tokenizer_config.json)."""
        path = pathlib.Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"expected a tokenizer.json file at {file}")
        self.path = file
        try:
            self.backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as err:  # the tokenizers library raises a bare Exception
            message = str(err).strip().replace("\n", " ")
            raise ValueError(f"{file} is not a valid tokenizer.json: {message}") from None
        special: dict[str, tuple[object, pathlib.Path]] = {}  # key -> (value, file naming it)
        # special_tokens_map.json first, so tokenizer_config.json wins where both name a token
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            extra = file.parent / name
            if extra.is_file():
                special.update((key, (value, extra)) for key, value in read_json(extra).items())
        self.bos_token_id = self._special_id(special, "bos_token")
        self.eos_token_id = self._special_id(special, "eos_token")
        self.pad_token_id = self._special_id(special, "pad_token")
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def _special_id(self, special: dict[str, tuple[object, pathlib.Path]], key: str) -> int | None:
        if key not in special:
            return None
        value, source = special[key]
        token = _token_content(value, key, source)
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{source}: {key} {token!r} is not a token of {self.path}")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """text -> token ids. Raises ValueError for a non-str, or a str that is not valid
        Unicode (a lone surrogate such as "\\ud800", which no UTF-8 text can hold)."""
        if not isinstance(text, str):
            raise ValueError(f"the prompt must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            bad = text[err.start]
            why = "half of a UTF-16 pair"
            if 0xDC80 <= ord(bad) <= 0xDCFF:  # how Python's "surrogateescape" keeps a bad byte
                why = f"the byte {ord(bad) - 0xDC00:#04x} of text that was not UTF-8"
            raise ValueError(
                f"the prompt is not valid Unicode: {bad!r} at index {err.start} is a lone "
                f"surrogate ({why}), which no UTF-8 text can hold"
            ) from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


class IncrementalDetokenizer:
    """Text of a generation, one token at a time, never ending in a partial character.

    A byte-level BPE token can hold part of a UTF-8 character (an emoji is 4 bytes, often
    split over 2 tokens). Decoding such a token alone gives U+FFFD, the replacement
    character. As in vLLM's `detokenize_incrementally`, we keep two offsets into the
    tokens: text is decoded from `prefix_offset`, and everything up to `read_offset` has
    already been emitted. A new token's text is the decode of [prefix_offset, end) minus
    the decode of [prefix_offset, read_offset); while it ends in U+FFFD we hold it back
    and wait for the tokens that complete the character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - INITIAL_PREFIX_TOKENS, 0)
        self._pieces: list[str] = []

    def add_token(self, token_id: int) -> str:
        """Append one generated token; returns the text it completes (maybe "")."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        new_text = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        piece = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All output text so far (the prompt excluded)."""
        return "".join(self._pieces)
