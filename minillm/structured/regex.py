"""A regular-expression compiler: pattern -> syntax tree -> byte NFA -> minimal byte DFA.

The automaton runs over UTF-8 *bytes*, not characters: a byte-level BPE token may end in the
middle of a multi-byte character, and a byte DFA walks such a token exactly as it walks any
other. A character class becomes the UTF-8 byte sequences of its code points (`utf8_ranges`),
so the DFA accepts the UTF-8 encoding of exactly the strings the pattern matches.

The supported subset, with Python's `re.fullmatch(pattern, text, re.ASCII)` meaning:

- literals, and escaped metacharacters `\\.` `\\*` `\\(` ...; `\\n \\t \\r \\f \\v`, `\\xHH`,
  `\\uHHHH`, `\\UHHHHHHHH`;
- classes `[abc]`, ranges `[a-z]`, negated classes `[^...]`, and the escapes `\\d \\w \\s`
  (ASCII: `[0-9]`, `[A-Za-z0-9_]`, `[ \\t\\n\\r\\f\\v]`) and their negations `\\D \\W \\S`;
- `.` (any character but a newline), alternation `|`, groups `(...)` and `(?:...)`;
- the quantifiers `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}` (counts up to MAX_REPEAT).

The whole text must match (there are no anchors: `^` and `$` are rejected, as are
backreferences, lookarounds and lazy or possessive quantifiers). Anything outside the subset
is a `RegexError` (a ValueError) that says where and what.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

MAX_UNICODE = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # no UTF-8 text holds these code points
MAX_REPEAT = 256  # the largest count in {m,n}: each copy of the body is states in the NFA
MAX_DFA_STATES = 20_000  # a guard against patterns whose DFA explodes
# Bounds on the work of compiling one pattern, so that a request cannot hold the engine (or a
# server's request thread) for minutes or exhaust its memory: the pattern's length, the NFA's
# states, and the steps of subset construction (NFA edges and epsilon moves visited), which
# bound its time. A pattern over any of them is a CompileLimitError naming the limit. The
# largest JSON schemas and regexes in the book and tests take under a quarter of each.
MAX_PATTERN_LENGTH = 65_536
MAX_NFA_STATES = 200_000
MAX_COMPILE_STEPS = 10_000_000
SHOWN_PATTERN_CHARS = 120  # how much of a pattern an error message quotes

DIGIT = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = ((0x09, 0x0D), (0x20, 0x20))  # \t \n \v \f \r and the space
META = set("\\.^$|?*+()[]{}")
SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}


class RegexError(ValueError):
    """A pattern outside the supported subset, or one that matches nothing."""


class CompileLimitError(RegexError):
    """A pattern, or a JSON schema's pattern, that would take more than the compile limits
    (MAX_PATTERN_LENGTH, MAX_NFA_STATES, MAX_DFA_STATES, MAX_COMPILE_STEPS) to compile: a
    bad request (a server answers it with HTTP 400), not an engine fault."""


def shown(pattern: str) -> str:
    """`pattern` quoted for an error message, its middle cut when it is long."""
    if len(pattern) <= SHOWN_PATTERN_CHARS:
        return repr(pattern)
    half = SHOWN_PATTERN_CHARS // 2
    return f"{pattern[:half]!r}...{pattern[-half:]!r} ({len(pattern)} characters)"


# ---------------------------------------------------------------------------------------
# character sets: sorted, disjoint, non-adjacent lists of inclusive code-point ranges


def normalize(ranges) -> tuple[tuple[int, int], ...]:
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def complement(ranges) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for lo, hi in normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_UNICODE:
        out.append((start, MAX_UNICODE))
    return normalize(out)


ANY_BUT_NEWLINE = complement([(0x0A, 0x0A)])


# ---------------------------------------------------------------------------------------
# the syntax tree


@dataclass(frozen=True, slots=True)
class Chars:
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Concat:
    parts: tuple


@dataclass(frozen=True, slots=True)
class Alternation:
    options: tuple


@dataclass(frozen=True, slots=True)
class Repeat:
    body: object
    min: int
    max: int | None  # None: unbounded


EMPTY = Concat(())


class _Parser:
    """Recursive descent: alternation > concatenation > quantified atom."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0

    def error(self, message: str, pos: int | None = None) -> RegexError:
        where = self.pos if pos is None else pos
        return RegexError(f"regex {shown(self.pattern)}: {message} at position {where}")

    def peek(self) -> str | None:
        return self.pattern[self.pos] if self.pos < len(self.pattern) else None

    def take(self) -> str:
        char = self.pattern[self.pos]
        self.pos += 1
        return char

    def parse(self):
        tree = self.alternation()
        if self.pos != len(self.pattern):
            raise self.error(f"unbalanced {self.peek()!r}")
        return tree

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.take()
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else Alternation(tuple(options))

    def concatenation(self):
        parts = []
        while self.peek() is not None and self.peek() not in "|)":
            parts.append(self.quantified())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def quantified(self):
        start = self.pos
        atom = self.atom()
        while self.peek() is not None and self.peek() in "*+?{":
            char = self.peek()
            if char == "{" and not self._is_counted_repeat():
                break  # a literal "{", as Python reads one that starts no {m,n}
            self.take()
            if char == "*":
                atom = Repeat(atom, 0, None)
            elif char == "+":
                atom = Repeat(atom, 1, None)
            elif char == "?":
                atom = Repeat(atom, 0, 1)
            else:
                low, high = self._counts()
                atom = Repeat(atom, low, high)
            if self.peek() in ("?", "+"):
                raise self.error("lazy and possessive quantifiers are not supported")
            if self.peek() is not None and self.peek() in "*+?" or self._is_counted_repeat():
                raise self.error("multiple repeat", start)
        return atom

    def _is_counted_repeat(self) -> bool:
        rest = self.pattern[self.pos :]
        if not rest.startswith("{"):
            return False
        end = rest.find("}")
        if end == -1:
            return False
        body = rest[1:end]
        low, comma, high = body.partition(",")
        return (
            low.isdigit()
            and (not comma or high == "" or high.isdigit())
            or (low == "" and comma and high.isdigit())
        )

    def _counts(self) -> tuple[int, int | None]:
        end = self.pattern.index("}", self.pos)
        body = self.pattern[self.pos : end]
        self.pos = end + 1
        low_text, comma, high_text = body.partition(",")
        low = int(low_text) if low_text else 0
        high = (int(high_text) if high_text else None) if comma else low
        if high is not None and high < low:
            raise self.error(f"bad repeat interval {{{body}}}: {high} < {low}")
        if low > MAX_REPEAT or (high is not None and high > MAX_REPEAT):
            raise self.error(f"repeat counts above {MAX_REPEAT} are not supported")
        return low, high

    def atom(self):
        char = self.take()
        if char == "(":
            if self.pattern.startswith("?:", self.pos):
                self.pos += 2
            elif self.peek() == "?":
                raise self.error("only plain groups (...) and (?:...) are supported")
            start = self.pos - 1
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ), unterminated subpattern", start)
            self.take()
            return inner
        if char == "[":
            return Chars(self.char_class())
        if char == ".":
            return Chars(ANY_BUT_NEWLINE)
        if char == "\\":
            return Chars(self.escape(in_class=False))
        if char in "^$":
            raise self.error(f"anchors ({char!r}) are not supported: the whole text must match")
        if char in "*+?":
            raise self.error("nothing to repeat", self.pos - 1)
        if char == ")":
            raise self.error("unbalanced parenthesis", self.pos - 1)
        code = ord(char)
        return Chars(((code, code),))

    def escape(self, in_class: bool) -> tuple[tuple[int, int], ...]:
        if self.peek() is None:
            raise self.error("bad escape (end of pattern)")
        char = self.take()
        classes = {"d": DIGIT, "w": WORD, "s": SPACE}
        if char in classes:
            return normalize(classes[char])
        if char.lower() in classes and char.isupper():
            return complement(classes[char.lower()])
        if char in SIMPLE_ESCAPES:
            code = ord(SIMPLE_ESCAPES[char])
            return ((code, code),)
        if char == "b" and in_class:
            return ((8, 8),)
        hex_digits = {"x": 2, "u": 4, "U": 8}.get(char)
        if hex_digits is not None:
            digits = self.pattern[self.pos : self.pos + hex_digits]
            if len(digits) != hex_digits or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad escape \\{char}{digits}")
            self.pos += hex_digits
            code = int(digits, 16)
            if code > MAX_UNICODE:
                raise self.error(f"bad escape \\{char}{digits}: not a code point")
            return ((code, code),)
        if char.isalnum():
            raise self.error(f"bad or unsupported escape \\{char}", self.pos - 2)
        code = ord(char)
        return ((code, code),)

    def char_class(self) -> tuple[tuple[int, int], ...]:
        start = self.pos - 1
        negate = self.peek() == "^"
        if negate:
            self.take()
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.peek() is None:
                raise self.error("unterminated character set", start)
            if self.peek() == "]" and not first:
                self.take()
                break
            first = False
            low = self._class_item()
            if (
                self.peek() == "-"
                and self.pos + 1 < len(self.pattern)
                and self.pattern[self.pos + 1] != "]"
            ):
                self.take()
                high = self._class_item()
                if len(low) != 1 or len(high) != 1 or low[0][0] != low[0][1]:
                    raise self.error("bad character range")
                if high[0][0] != high[0][1] or high[0][0] < low[0][0]:
                    raise self.error("bad character range")
                ranges.append((low[0][0], high[0][0]))
            else:
                ranges.extend(low)
        result = normalize(ranges)
        return complement(result) if negate else result

    def _class_item(self) -> tuple[tuple[int, int], ...]:
        char = self.take()
        if char == "\\":
            return self.escape(in_class=True)
        return ((ord(char), ord(char)),)


def parse(pattern: str):
    """The syntax tree of `pattern`; RegexError when it is outside the subset."""
    if not isinstance(pattern, str):
        raise RegexError(f"a regex must be a str, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise CompileLimitError(
            f"regex {shown(pattern)}: longer than MAX_PATTERN_LENGTH={MAX_PATTERN_LENGTH} "
            "characters"
        )
    return _Parser(pattern).parse()


# ---------------------------------------------------------------------------------------
# code points -> UTF-8 byte sequences


def utf8_ranges(lo: int, hi: int) -> list[tuple[tuple[int, int], ...]]:
    """The code points lo..hi (surrogates left out) as UTF-8 byte-range sequences.

    Each sequence ((l1, h1), (l2, h2), ...) stands for every byte string b1 b2 ... with
    l_i <= b_i <= h_i; together they encode exactly the code points of the range. The range is
    split where the encoded length changes and until all but the first byte of a piece span
    whole continuation ranges (the construction of RE2 and Rust's utf8-ranges).
    """
    out = []
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        if lo > hi:
            continue
        if lo <= SURROGATES[1] and hi >= SURROGATES[0]:
            stack += [(lo, SURROGATES[0] - 1), (SURROGATES[1] + 1, hi)]
            continue
        split = next((m for m in (0x7F, 0x7FF, 0xFFFF) if lo <= m < hi), None)
        if split is not None:
            stack += [(lo, split), (split + 1, hi)]
            continue
        if hi <= 0x7F:
            out.append(((lo, hi),))
            continue
        for i in (1, 2, 3):
            mask = (1 << (6 * i)) - 1
            if lo & ~mask != hi & ~mask:
                if lo & mask:
                    stack += [(lo, lo | mask), ((lo | mask) + 1, hi)]
                    break
                if hi & mask != mask:
                    stack += [(lo, (hi & ~mask) - 1), (hi & ~mask, hi)]
                    break
        else:
            first, last = chr(lo).encode(), chr(hi).encode()
            out.append(tuple(zip(first, last, strict=True)))
    return out


# ---------------------------------------------------------------------------------------
# Thompson NFA over bytes


class _NFA:
    def __init__(self, pattern: str = "") -> None:
        self.pattern = pattern
        self.epsilon: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []  # (byte lo, byte hi, target)
        self.steps = 0  # subset construction's work so far (MAX_COMPILE_STEPS)

    def state(self) -> int:
        if len(self.epsilon) >= MAX_NFA_STATES:
            raise CompileLimitError(
                f"regex {shown(self.pattern)}: its automaton needs more than "
                f"MAX_NFA_STATES={MAX_NFA_STATES} NFA states"
            )
        self.epsilon.append([])
        self.edges.append([])
        return len(self.epsilon) - 1

    def build(self, node, start: int, end: int) -> None:
        """Add states so that the strings of `node` lead from start to end."""
        if isinstance(node, Chars):
            for lo, hi in node.ranges:
                for sequence in utf8_ranges(lo, hi):
                    current = start
                    for i, (b_lo, b_hi) in enumerate(sequence):
                        target = end if i == len(sequence) - 1 else self.state()
                        self.edges[current].append((b_lo, b_hi, target))
                        current = target
        elif isinstance(node, Concat):
            current = start
            for i, part in enumerate(node.parts):
                target = end if i == len(node.parts) - 1 else self.state()
                self.build(part, current, target)
                current = target
            if not node.parts:
                self.epsilon[start].append(end)
        elif isinstance(node, Alternation):
            for option in node.options:
                self.build(option, start, end)
        elif isinstance(node, Repeat):
            current = start
            for _ in range(node.min):
                target = self.state()
                self.build(node.body, current, target)
                current = target
            if node.max is None:
                loop = self.state()
                self.epsilon[current].append(loop)
                inner = self.state()
                self.build(node.body, loop, inner)
                self.epsilon[inner].append(loop)
                self.epsilon[loop].append(end)
            else:
                for _ in range(node.max - node.min):
                    target = self.state()
                    self.epsilon[current].append(end)
                    self.build(node.body, current, target)
                    current = target
                self.epsilon[current].append(end)
        else:  # pragma: no cover - the parser makes only the nodes above
            raise TypeError(node)

    def closure(self, states) -> frozenset[int]:
        seen = set(states)
        stack = list(states)
        while stack:
            for target in self.epsilon[stack.pop()]:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        self.spend(len(seen))
        return frozenset(seen)

    def spend(self, steps: int) -> None:
        """Count subset construction's work; CompileLimitError past MAX_COMPILE_STEPS."""
        self.steps += steps
        if self.steps > MAX_COMPILE_STEPS:
            raise CompileLimitError(
                f"regex {shown(self.pattern)}: compiling it takes more than "
                f"MAX_COMPILE_STEPS={MAX_COMPILE_STEPS} steps"
            )


# ---------------------------------------------------------------------------------------
# the DFA


@dataclass(frozen=True, slots=True, eq=False)
class DFA:
    """A minimal byte DFA: state 0 is the start; transitions[s][b] is the next state or -1.

    Every state can still reach an accepting state (dead states are removed), so a walk that
    stays off -1 is always a prefix of some matching text.
    """

    transitions: tuple[tuple[int, ...], ...]
    accepting: frozenset[int]

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state`, or -1 when it leaves the language."""
        transitions = self.transitions
        for byte in data:
            state = transitions[state][byte]
            if state < 0:
                return -1
        return state

    def fullmatch(self, text: str) -> bool:
        state = self.walk(0, text.encode("utf-8", "surrogatepass"))
        return state >= 0 and state in self.accepting

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every match must read next from `state`: the run of states that are not
        accepting and have exactly one way out (what jump-forward decoding skips)."""
        out = bytearray()
        seen = set()
        while state not in self.accepting and state not in seen:
            seen.add(state)
            ways = [b for b, target in enumerate(self.transitions[state]) if target >= 0]
            if len(ways) != 1:
                break
            out.append(ways[0])
            state = self.transitions[state][ways[0]]
        return bytes(out)


def _determinize(nfa: _NFA, start: int, end: int, pattern: str):
    first = nfa.closure([start])
    sets = {first: 0}
    order = [first]
    rows: list[list[int]] = []
    i = 0
    while i < len(order):
        current = order[i]
        edges = [edge for nfa_state in current for edge in nfa.edges[nfa_state]]
        # the bytes split into intervals on which the set of targets is the same
        cuts = sorted({0, 256} | {lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        nfa.spend(len(cuts) * len(edges))
        row = [-1] * 256
        by_set: dict[frozenset[int], int] = {}
        for low, high in zip(cuts, cuts[1:], strict=False):
            key = frozenset(t for lo, hi, t in edges if lo <= low <= hi)
            if not key:
                continue
            if key not in by_set:
                closed = nfa.closure(key)
                if closed not in sets:
                    if len(order) >= MAX_DFA_STATES:
                        raise CompileLimitError(
                            f"regex {shown(pattern)}: its automaton needs more than "
                            f"MAX_DFA_STATES={MAX_DFA_STATES} states"
                        )
                    sets[closed] = len(order)
                    order.append(closed)
                by_set[key] = sets[closed]
            row[low:high] = [by_set[key]] * (high - low)
        rows.append(row)
        i += 1
    accepting = {index for index, states in enumerate(order) if end in states}
    return rows, accepting


def _prune_and_minimize(rows: list[list[int]], accepting: set[int], nfa: _NFA):
    """Drop the states that cannot reach acceptance, then merge equivalent states (Moore's
    partition refinement, on a numpy table) and renumber from the start state.

    The refinement reads one column per class of bytes that every state treats alike (all of
    `.`'s continuation bytes, say): the same partition as all 256 columns, at a fraction of
    the work."""
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 256)
    num_states = len(rows)
    sources: list[set[int]] = [set() for _ in range(num_states)]
    for source, row in enumerate(rows):
        for target in set(row):
            if target >= 0:
                sources[target].add(source)
    live = np.zeros(num_states, dtype=bool)
    stack = list(accepting)
    live[stack] = True
    while stack:  # backwards from the accepting states
        for source in sources[stack.pop()]:
            if not live[source]:
                live[source] = True
                stack.append(source)
    if not live[0]:
        return None
    table = np.where((table >= 0) & live[np.maximum(table, 0)], table, -1)
    states = np.flatnonzero(live)
    is_accepting = np.zeros(num_states, dtype=bool)
    is_accepting[list(accepting)] = True
    # block of each state (dead states: -1); refine until the number of blocks stops growing
    block = np.full(num_states, -1, dtype=np.int64)
    block[states] = is_accepting[states].astype(np.int64)
    num_blocks = len(np.unique(block[states]))
    _, byte_classes = np.unique(table[states], axis=1, return_index=True)
    live_table = table[states][:, np.sort(byte_classes)]
    while True:
        nfa.spend(live_table.size // 16)  # vectorized: far cheaper per entry than a step
        targets = np.where(live_table >= 0, block[np.maximum(live_table, 0)], -1)
        new_block = block[states]
        for column in targets.T:  # ids of equal (block, targets...) rows, a column at a time
            pair = new_block * (len(states) + 2) + (column + 1)
            _, new_block = np.unique(pair, return_inverse=True)
        block[states] = new_block.reshape(-1)
        count = int(new_block.max()) + 1
        if count == num_blocks:
            break
        num_blocks = count
    # renumber blocks in breadth-first order from the start, so state 0 is the start
    number = {int(block[0]): 0}
    representative = [0]
    queue = [0]
    for s in queue:
        for t in table[s]:
            if t >= 0 and int(block[t]) not in number:
                number[int(block[t])] = len(number)
                representative.append(int(t))
                queue.append(int(t))
    transitions = tuple(
        tuple(number[int(block[t])] if t >= 0 else -1 for t in table[rep].tolist())
        for rep in representative
    )
    accept = frozenset(
        number[int(block[s])] for s in accepting if live[s] and int(block[s]) in number
    )
    return transitions, accept


@functools.lru_cache(maxsize=32)  # a DFA can hold MAX_DFA_STATES rows of 256
def compile_regex(pattern: str) -> DFA:
    """The minimal byte DFA of `pattern` (cached). RegexError for a pattern outside the subset
    or one that matches no text at all."""
    tree = parse(pattern)
    nfa = _NFA(pattern)
    start, end = nfa.state(), nfa.state()
    nfa.build(tree, start, end)
    rows, accepting = _determinize(nfa, start, end, pattern)
    minimized = _prune_and_minimize(rows, accepting, nfa)
    if minimized is None:
        raise RegexError(f"regex {shown(pattern)} matches no text at all")
    transitions, accept = minimized
    return DFA(transitions, accept)


def escape(text: str) -> str:
    """`text` as a pattern that matches exactly it."""
    return "".join("\\" + c if c in META or c in "-&~# " else c for c in text).replace("\n", "\\n")
