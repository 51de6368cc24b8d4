"""From a byte DFA to token masks, and the per-request state that walks it.

A token is allowed in DFA state s when reading its bytes from s never leaves the automaton:
then some continuation still completes a match. The mask of a state marks every such token of
the vocabulary; it is computed the first time a request reaches the state, by walking a trie of
the vocabulary's byte strings alongside the DFA (a prefix that dies prunes every token below
it), and cached on the compiled grammar, which all requests with the same constraint share.

Stop tokens (EOS, and the request's stop_token_ids) are allowed exactly in accepting states;
when an accepting state has no way on, they are the only tokens allowed, so the request ends.

A context-free grammar (`minillm.structured.cfg`) has no finite set of states: its matcher
(`CFGMatcher`) keeps the Earley chart of the output, walks the same trie beside the
recognizer, and caches masks by the parser state's key (`EarleySet.state_key`) instead.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.model.tokenizer import Tokenizer
from minillm.structured.cfg import MAX_FORCED_BYTES, ContextFreeGrammar, EarleySet
from minillm.structured.regex import DFA, compile_regex

# compiled grammars an engine keeps for reuse, least recently used dropped first: each holds a
# [vocab] mask per DFA state it has reached, which adds up over many distinct constraints (a
# request still using a dropped grammar keeps it through its matcher)
MAX_CACHED_GRAMMARS = 32
# token masks a context-free grammar keeps, by parser state (each a [vocab] bool tensor)
MAX_CACHED_CFG_MASKS = 1024


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id stands for; None for special tokens and ids with no token.

    Byte-level BPE vocabularies (GPT-2's alphabet) are read back byte by byte, so a token
    holding part of a UTF-8 character keeps its exact bytes; other vocabularies decode each
    token alone.
    """
    decoder = _byte_decoder()
    special = {
        token.content
        for token in tokenizer.backend.get_added_tokens_decoder().values()
        if token.special
    }
    out: list[bytes | None] = []
    for token_id in range(vocab_size):
        piece = tokenizer.id_to_token(token_id)
        if piece is None or piece in special:
            out.append(None)
        elif all(char in decoder for char in piece):
            out.append(bytes(decoder[char] for char in piece))
        else:
            out.append(tokenizer.decode([token_id], skip_special_tokens=False).encode())
    return out


class TokenTrie:
    """The vocabulary's byte strings as a trie: node i's children by byte, and the ids of the
    tokens that end at node i."""

    def __init__(self, vocab: Sequence[bytes | None]) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.token_ids: list[list[int]] = [[]]
        for token_id, data in enumerate(vocab):
            if not data:
                continue
            node = 0
            for byte in data:
                child = self.children[node].get(byte)
                if child is None:
                    child = len(self.children)
                    self.children[node][byte] = child
                    self.children.append({})
                    self.token_ids.append([])
                node = child
            self.token_ids[node].append(token_id)


@dataclass(eq=False)
class TokenGrammar:
    """A compiled constraint over one vocabulary: its DFA, and the token masks of the states
    reached so far."""

    dfa: DFA
    vocab: Sequence[bytes | None]
    trie: TokenTrie
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # [vocab_size] bool, by state
    allowed_ids: dict[int, list[int]] = field(default_factory=dict)

    def allowed_token_ids(self, state: int) -> list[int]:
        """The (non-stop) tokens allowed in `state`, in id order."""
        cached = self.allowed_ids.get(state)
        if cached is not None:
            return cached
        transitions = self.dfa.transitions
        children, ends = self.trie.children, self.trie.token_ids
        allowed: list[int] = []
        stack = [(0, state)]
        while stack:
            node, dfa_state = stack.pop()
            row = transitions[dfa_state]
            for byte, child in children[node].items():
                target = row[byte]
                if target >= 0:
                    allowed.extend(ends[child])
                    if children[child]:
                        stack.append((child, target))
        allowed.sort()
        self.allowed_ids[state] = allowed
        return allowed

    def token_mask(self, state: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed in `state`, stop tokens not included."""
        mask = self.masks.get(state)
        if mask is None:
            mask = torch.zeros(len(self.vocab), dtype=torch.bool)
            mask[self.allowed_token_ids(state)] = True
            self.masks[state] = mask
        return mask

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`, or -1 when the token is not allowed."""
        if not 0 <= token_id < len(self.vocab) or not self.vocab[token_id]:
            return -1
        return self.dfa.walk(state, self.vocab[token_id])


@dataclass(slots=True, eq=False)
class GrammarMatcher:
    """One request's place in its grammar: the DFA state after the tokens accepted so far."""

    grammar: TokenGrammar
    state: int = 0
    num_tokens: int = 0  # output tokens accepted
    terminated: bool = False  # a stop token was accepted in an accepting state

    def accept_token(self, token_id: int, stop_token_ids: frozenset[int]) -> None:
        """Advance over one output token. A token the grammar does not allow (it cannot happen
        when the masks were applied) is a ValueError."""
        self.num_tokens += 1
        if self.terminated:
            return
        if token_id in stop_token_ids and self.state in self.grammar.dfa.accepting:
            self.terminated = True
            return
        state = self.grammar.next_state(self.state, token_id)
        if state < 0:
            raise ValueError(f"token {token_id} is not allowed by the request's grammar here")
        self.state = state

    def is_accepting(self) -> bool:
        return self.terminated or self.state in self.grammar.dfa.accepting

    def token_mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed next, stop tokens not included."""
        return self.grammar.token_mask(self.state)

    def forced_bytes(self) -> bytes:
        return self.grammar.dfa.forced_bytes(self.state)

    def walk_tokens(self, token_ids: Sequence[int]) -> bool:
        """Whether the grammar allows `token_ids` from here (the matcher does not move)."""
        state = self.state
        for token_id in token_ids:
            state = self.grammar.next_state(state, token_id)
            if state < 0:
                return False
        return True


@dataclass(eq=False)
class TokenCFG:
    """A compiled context-free grammar over one vocabulary, and the token masks of the parser
    states reached so far (by `EarleySet.state_key`: the stack, not the position; at most
    MAX_CACHED_CFG_MASKS, the cache starts over when full)."""

    cfg: ContextFreeGrammar
    vocab: Sequence[bytes | None]
    trie: TokenTrie
    masks: dict[frozenset, torch.Tensor] = field(default_factory=dict)

    def new_matcher(self) -> CFGMatcher:
        return CFGMatcher(self, [self.cfg.initial_set()])


@dataclass(slots=True, eq=False)
class CFGMatcher:
    """One request's place in a context-free grammar: the Earley chart of its output bytes
    (one set per byte; the stacks the output is consistent with, all at once)."""

    grammar: TokenCFG
    chart: list[EarleySet]
    num_tokens: int = 0
    terminated: bool = False
    _mask: torch.Tensor | None = None  # the mask at the current position, once computed

    def accept_token(self, token_id: int, stop_token_ids: frozenset[int]) -> None:
        """Advance over one output token; ValueError for a token the grammar does not allow."""
        self.num_tokens += 1
        if self.terminated:
            return
        if token_id in stop_token_ids and self.chart[-1].accepting:
            self.terminated = True
            return
        vocab = self.grammar.vocab
        data = vocab[token_id] if 0 <= token_id < len(vocab) else None
        grown = self._walk(data) if data else None
        if grown is None:
            raise ValueError(f"token {token_id} is not allowed by the request's grammar here")
        self.chart.extend(grown)
        self._mask = None

    def _walk(self, data: bytes) -> list[EarleySet] | None:
        chart, scan = self.chart, self.grammar.cfg.scan
        grown: list[EarleySet] = []
        try:
            for byte in data:
                nxt = scan(chart, byte)
                if nxt is None:
                    return None
                chart.append(nxt)
                grown.append(nxt)
        finally:
            del chart[len(chart) - len(grown) :]
        return grown

    def is_accepting(self) -> bool:
        return self.terminated or self.chart[-1].accepting

    def allowed_token_ids(self) -> list[int]:
        """The (non-stop) tokens whose bytes the grammar allows next, in id order: a walk of
        the vocabulary trie beside the Earley recognizer, a byte no item can read pruning the
        whole subtree below it."""
        chart, scan = self.chart, self.grammar.cfg.scan
        children, ends = self.grammar.trie.children, self.grammar.trie.token_ids
        allowed: list[int] = []

        def walk(node: int) -> None:
            byte_mask = chart[-1].byte_mask
            for byte, child in children[node].items():
                if not byte_mask >> byte & 1:
                    continue
                allowed.extend(ends[child])
                if children[child]:
                    chart.append(scan(chart, byte))
                    walk(child)
                    chart.pop()

        walk(0)
        allowed.sort()
        return allowed

    def token_mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed next, stop tokens not included."""
        if self._mask is None:
            masks = self.grammar.masks
            key = self.chart[-1].state_key(self.chart)
            mask = masks.get(key)
            if mask is None:
                mask = torch.zeros(len(self.grammar.vocab), dtype=torch.bool)
                mask[self.allowed_token_ids()] = True
                if len(masks) >= MAX_CACHED_CFG_MASKS:
                    masks.clear()
                masks[key] = mask
            self._mask = mask
        return self._mask

    def forced_bytes(self) -> bytes:
        """The bytes every sentence must read next: while the output is not a sentence and
        exactly one byte can follow (at most MAX_FORCED_BYTES)."""
        chart, scan = self.chart, self.grammar.cfg.scan
        out = bytearray()
        try:
            while len(out) < MAX_FORCED_BYTES and not chart[-1].accepting:
                mask = chart[-1].byte_mask
                if mask == 0 or mask & (mask - 1):
                    break
                byte = mask.bit_length() - 1
                chart.append(scan(chart, byte))
                out.append(byte)
        finally:
            del chart[len(chart) - len(out) :]
        return bytes(out)

    def walk_tokens(self, token_ids: Sequence[int]) -> bool:
        """Whether the grammar allows `token_ids` from here (the matcher does not move)."""
        vocab = self.grammar.vocab
        data = b"".join(vocab[t] or b"" if 0 <= t < len(vocab) else b"" for t in token_ids)
        ok = all(0 <= t < len(vocab) and vocab[t] for t in token_ids)
        return ok and self._walk(data) is not None


class StructuredOutputManager:
    """The compiled grammars of an engine (shared by requests with the same constraint) and
    each request's matcher, by request id (vLLM V1's class of the same name)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._vocab: list[bytes | None] | None = None
        self._trie: TokenTrie | None = None
        self.grammars: OrderedDict[str, TokenGrammar] = OrderedDict()
        self.matchers: dict[str, GrammarMatcher] = {}

    @property
    def vocab(self) -> list[bytes | None]:
        if self._vocab is None:
            self._vocab = token_bytes(self.tokenizer, self.vocab_size)
            self._trie = TokenTrie(self._vocab)
        return self._vocab

    def grammar(self, pattern: str | ContextFreeGrammar) -> TokenGrammar | TokenCFG:
        """The grammar of a regex (or a compiled context-free grammar) over this vocabulary,
        compiled once."""
        grammar = self.grammars.get(pattern)
        if grammar is None:
            vocab = self.vocab
            if isinstance(pattern, ContextFreeGrammar):
                grammar = TokenCFG(pattern, vocab, self._trie)
            else:
                grammar = TokenGrammar(compile_regex(pattern), vocab, self._trie)
            self.grammars[pattern] = grammar
            if len(self.grammars) > MAX_CACHED_GRAMMARS:
                self.grammars.popitem(last=False)
        else:
            self.grammars.move_to_end(pattern)
        return grammar

    def matcher(
        self,
        request_id: str,
        pattern: str | ContextFreeGrammar,
        output_token_ids: Sequence[int],
        stop_ids,
    ) -> GrammarMatcher | CFGMatcher:
        """The request's matcher, advanced over any output tokens it has not seen (sampled or
        jumped over since the last step). One kept for an earlier request of the same id (ids
        may be used again at once), of another grammar or further along, is made anew."""
        matcher = self.matchers.get(request_id)
        grammar = self.grammar(pattern)
        if (
            matcher is None
            or matcher.grammar is not grammar
            or matcher.num_tokens > len(output_token_ids)
        ):
            matcher = grammar.new_matcher()
            self.matchers[request_id] = matcher
        for token_id in output_token_ids[matcher.num_tokens :]:
            matcher.accept_token(token_id, stop_ids)
        return matcher

    def allowed_mask(
        self,
        request_id: str,
        pattern: str | ContextFreeGrammar,
        output_token_ids: Sequence[int],
        stop_token_ids: Sequence[int],
    ) -> torch.Tensor:
        """[vocab_size] bool: the tokens the request may sample next, stop tokens included
        where the text so far is a complete match."""
        stop_ids = frozenset(stop_token_ids)
        matcher = self.matcher(request_id, pattern, output_token_ids, stop_ids)
        if matcher.terminated:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        else:
            mask = matcher.token_mask().clone()
        if matcher.is_accepting() or not mask.any():
            ids = [t for t in stop_ids if 0 <= t < self.vocab_size]
            mask[ids] = True
        return mask

    def jump_forward_tokens(
        self,
        request_id: str,
        pattern: str | ContextFreeGrammar,
        output_token_ids: Sequence[int],
        stop_token_ids: Sequence[int],
        max_tokens: int,
    ) -> list[int]:
        """The tokens of the text the grammar forces next, to append without a forward each.

        The forced run (`DFA.forced_bytes`) is cut to whole UTF-8 characters and tokenized
        alone. The token-boundary caveat: the model would not necessarily split that text the
        same way, and the run's last token could merge with the text that follows it. So the
        last token of the run is left for the model to sample (it sees the run's prefix and
        picks the boundary itself), a run that re-tokenizes differently after decoding is not
        jumped over, and every token must walk the DFA from the current state.
        """
        if max_tokens < 1:
            return []
        matcher = self.matcher(request_id, pattern, output_token_ids, frozenset(stop_token_ids))
        if matcher.terminated:
            return []
        forced = matcher.forced_bytes()
        text = forced.decode("utf-8", "ignore")  # drops a partial character at the end
        if not text or text.encode() != forced[: len(text.encode())]:
            return []
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        if self.tokenizer.decode(tokens, skip_special_tokens=False) != text:
            return []
        tokens = tokens[:-1][:max_tokens]
        return tokens if matcher.walk_tokens(tokens) else []

    def free(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
