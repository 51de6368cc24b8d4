"""n-gram drafting (prompt lookup): propose what followed the last n tokens earlier on.

vLLM's rule (`vllm/v1/spec_decode/ngram_proposer.py`): among n in [prompt_lookup_min,
prompt_lookup_max], take the longest n for which the request's last n tokens occurred before
(an occurrence that is not the suffix itself; it may overlap it); of the occurrences of that
n-gram, the earliest; propose the up to k tokens that followed it, fewer when the sequence ends
first, and never past max_model_len. No match: no proposal, and the request decodes normally.
"""

from __future__ import annotations

from collections.abc import Sequence


def ngram_propose(
    token_ids: Sequence[int], min_n: int, max_n: int, k: int, max_model_len: int | None = None
) -> list[int]:
    """The proposal for a request whose tokens (prompt and output) are `token_ids`."""
    num_tokens = len(token_ids)
    if max_model_len is not None:
        k = min(k, max_model_len - num_tokens)
    if k <= 0 or num_tokens < min_n:
        return []
    tokens = list(token_ids)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        first = suffix[0]
        # occurrences starting at i < num_tokens - n, earliest first
        for i in range(num_tokens - n):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


class NgramProposer:
    """Prompt lookup over each request's own tokens; no model, no KV cache."""

    def __init__(self, min_n: int, max_n: int, max_model_len: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return ngram_propose(token_ids, self.min_n, self.max_n, k, self.max_model_len)
