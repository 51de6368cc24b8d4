"""Context-free grammars: an EBNF subset -> a byte-level CFG -> an Earley recognizer whose
state after a prefix gives the bytes, and through a vocabulary trie the tokens, allowed next.

A regular expression cannot say "as many closing brackets as opening ones": a DFA has finitely
many states, so it cannot count without bound. A context-free grammar can; the recognizer keeps
a stack of the rules it is inside (here an Earley chart, which holds every stack the prefix is
consistent with at once, so ambiguous and left-recursive grammars are fine).

The grammar syntax is a subset of Lark's EBNF (the seed's SQL example is written in it):

    ?start: select_statement                  // a rule: name ':' alternatives
    select_statement: "SELECT " columns " FROM " NAME
    columns: NAME ("," NAME)*                 // groups, and the quantifiers * + ?
    NAME: /[a-zA-Z_][a-zA-Z0-9_]*/            // a terminal as a regex (minillm.structured.regex)
    opt: [ "x" ]                               // [ ... ] is an optional group

Rules are `name: alternatives` (`::=` is accepted too); a leading `?` or `!` on a name (Lark's
tree-shaping marks) is allowed and ignored; alternatives continue on lines that start with `|`;
`//` starts a comment. Strings take the escapes `\\" \\\\ \\n \\t \\r \\xHH \\uHHHH`. The start
symbol is `start`, else `root`, else the first rule. The language is the plain context-free
one: a regex terminal matches any of its matches at any position (as Lark's `dynamic_complete`
lexer and xgrammar read a grammar), with no longest-match lexing and no `%ignore`.

Each string and regex becomes one *terminal*, a minimal byte DFA (`compile_regex`): an Earley
item inside a terminal carries the terminal's DFA state, so a 20-byte identifier is 20 DFA
steps, not 20 nested rules. `*`, `+`, `?` and groups become fresh left-recursive rules.

Bounded work: the grammar's text, its rules after expansion and its terminals' DFA states are
capped (a `CompileLimitError`, the regex compiler's, naming the limit); at run time an Earley
set larger than MAX_EARLEY_ITEMS (an ambiguous grammar and a long output) is a
`GrammarLimitError` for that request.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from minillm.structured.regex import DFA, CompileLimitError, RegexError, compile_regex, escape

MAX_GRAMMAR_LENGTH = 65_536  # characters of grammar text
MAX_GRAMMAR_RULES = 4_096  # rules after the EBNF operators are expanded
MAX_TERMINAL_STATES = 100_000  # DFA states of all terminals together
MAX_EARLEY_ITEMS = 20_000  # items in one Earley set (one position of the output)
MAX_FORCED_BYTES = 256  # the longest forced run `forced_bytes` returns


class GrammarError(ValueError):
    """A grammar outside the supported subset, or one that derives no string."""


class GrammarLimitError(GrammarError):
    """Recognizing the output took an Earley set over MAX_EARLEY_ITEMS items."""


# ---------------------------------------------------------------------------------------
# the EBNF syntax tree


@dataclass(frozen=True, slots=True)
class Ref:
    name: str
    pos: int  # where it appears in the text, for an error message


@dataclass(frozen=True, slots=True)
class Term:
    pattern: str  # a regex in minillm.structured.regex's subset (a string is escaped)
    label: str = ""  # as written in the grammar: "..." or /.../


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple


@dataclass(frozen=True, slots=True)
class Alt:
    options: tuple


@dataclass(frozen=True, slots=True)
class Quant:
    body: object
    op: str  # "*", "+" or "?"


_NAME_START = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_NAME_CHARS = _NAME_START | set("0123456789")
_STRING_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r", "/": "/"}


class _Parser:
    """Recursive descent over the grammar text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str, pos: int | None = None) -> GrammarError:
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        column = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return GrammarError(f"line {line}, column {column}: {message}")

    def skip(self) -> None:
        """Whitespace (newlines included) and // comments."""
        text = self.text
        while self.pos < len(text):
            if text[self.pos].isspace():
                self.pos += 1
            elif text.startswith("//", self.pos):
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            else:
                break

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def name(self) -> str:
        start = self.pos
        if self.pos >= len(self.text) or self.text[self.pos] not in _NAME_START:
            raise self.error("expected a rule name")
        while self.pos < len(self.text) and self.text[self.pos] in _NAME_CHARS:
            self.pos += 1
        return self.text[start : self.pos]

    def at_rule_start(self) -> bool:
        """Whether a rule definition (`?name:` or `name ::=`) starts here."""
        saved = self.pos
        try:
            if self.peek() in "?!" and self.peek():
                self.pos += 1
            self.name()
            self.skip()
            return self.text.startswith(":", self.pos)
        except GrammarError:
            return False
        finally:
            self.pos = saved

    def rules(self) -> list[tuple[str, object, int]]:
        out = []
        while self.peek():
            if not self.at_rule_start():
                raise self.error("expected a rule `name: ...`")
            if self.peek() in "?!":
                self.pos += 1
            pos = self.pos
            name = self.name()
            self.skip()
            if self.text.startswith("::=", self.pos):
                self.pos += 3
            else:
                self.pos += 1  # ":"
            out.append((name, self.alternatives(), pos))
        return out

    def alternatives(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self):
        items = []
        while True:
            char = self.peek()
            if not char or char in "|)]" or self.at_rule_start():
                break
            items.append(self.quantified())
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantified(self):
        atom = self.atom()
        while self.pos < len(self.text) and self.text[self.pos] in "*+?":
            atom = Quant(atom, self.text[self.pos])
            self.pos += 1
        return atom

    def atom(self):
        char = self.peek()
        start = self.pos
        if char in "([":
            self.pos += 1
            inner = self.alternatives()
            close = ")" if char == "(" else "]"
            if self.peek() != close:
                raise self.error(f"expected {close!r} to close the group opened here", start)
            self.pos += 1
            return inner if char == "(" else Quant(inner, "?")
        if char == '"':
            text = self.string()
            return Term(escape(text), '"' + text.replace("\n", "\\n") + '"')
        if char == "/":
            pattern = self.regex()
            return Term(pattern, f"/{pattern}/")
        if char in _NAME_START:
            return Ref(self.name(), start)
        raise self.error(f"unexpected {char!r}" if char else "unexpected end of grammar")

    def string(self) -> str:
        start = self.pos
        self.pos += 1
        out = []
        text = self.text
        while True:
            if self.pos >= len(text) or text[self.pos] == "\n":
                raise self.error("unterminated string", start)
            char = text[self.pos]
            self.pos += 1
            if char == '"':
                return "".join(out)
            if char != "\\":
                out.append(char)
                continue
            code = text[self.pos : self.pos + 1]
            self.pos += 1
            if code in _STRING_ESCAPES:
                out.append(_STRING_ESCAPES[code])
            elif code in ("x", "u"):
                width = 2 if code == "x" else 4
                digits = text[self.pos : self.pos + width]
                if len(digits) != width or any(c not in "0123456789abcdefABCDEF" for c in digits):
                    raise self.error(f"\\{code} needs {width} hex digits", self.pos - 2)
                value = int(digits, 16)
                if 0xD800 <= value <= 0xDFFF:
                    raise self.error("a surrogate code point is not text", self.pos - 2)
                out.append(chr(value))
                self.pos += width
            else:
                raise self.error(f"unsupported escape \\{code} in a string", self.pos - 2)

    def regex(self) -> str:
        start = self.pos
        self.pos += 1
        text = self.text
        out = []
        while True:
            if self.pos >= len(text) or text[self.pos] == "\n":
                raise self.error("unterminated regex", start)
            char = text[self.pos]
            self.pos += 1
            if char == "/":
                break
            if char == "\\" and text[self.pos : self.pos + 1] == "/":
                out.append("/")
                self.pos += 1
                continue
            out.append(char)
            if char == "\\" and self.pos < len(text):
                out.append(text[self.pos])
                self.pos += 1
        if self.pos < len(text) and text[self.pos] in _NAME_CHARS:
            raise self.error("regex flags are not supported", self.pos)
        pattern = "".join(out)
        try:
            compile_regex(pattern)
        except RegexError as err:
            if isinstance(err, CompileLimitError):
                raise
            raise self.error(f"bad regex: {err}", start) from None
        return pattern


# ---------------------------------------------------------------------------------------
# the byte-level CFG and its Earley recognizer

# A symbol on a right-hand side is an int: a nonterminal n >= 0, or a terminal t as ~t (< 0).


@dataclass(eq=False)
class ContextFreeGrammar:
    """A compiled grammar: rules over nonterminals and DFA terminals, ready for Earley.

    Rule 0 is the augmented start `S' -> start`; `rules[r] = (lhs, rhs)`.
    """

    source: str
    names: list[str]  # nonterminal names (expanded EBNF operators get `name~k`)
    rules: list[tuple[int, tuple[int, ...]]]
    terminals: list[DFA]
    labels: list[str]  # each nonterminal as a reader knows it: its name, or the EBNF it expands
    terminal_labels: list[str]
    by_lhs: list[list[int]] = field(init=False)
    nullable: frozenset[int] = field(init=False)
    # terminal t: per DFA state, the bitmask (bit b set) of the bytes with a move
    byte_masks: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_lhs = [[] for _ in self.names]
        for index, (lhs, _) in enumerate(self.rules):
            self.by_lhs[lhs].append(index)
        self.byte_masks = [
            [sum(1 << b for b, s in enumerate(row) if s >= 0) for row in dfa.transitions]
            for dfa in self.terminals
        ]
        self.nullable = frozenset(self._nullable())
        self._check_productive()

    def _nullable(self) -> set[int]:
        nullable: set[int] = set()
        changed = True
        while changed:
            changed = False
            for lhs, rhs in self.rules:
                if lhs not in nullable and all(self.symbol_nullable(s, nullable) for s in rhs):
                    nullable.add(lhs)
                    changed = True
        return nullable

    def symbol_nullable(self, symbol: int, nullable=None) -> bool:
        if symbol < 0:
            return 0 in self.terminals[~symbol].accepting
        return symbol in (self.nullable if nullable is None else nullable)

    def _check_productive(self) -> None:
        """Every rule reachable from the start must derive some finite string; otherwise a
        prefix could look viable and have no completion."""
        productive: set[int] = set()
        changed = True
        while changed:
            changed = False
            for lhs, rhs in self.rules:
                if lhs not in productive and all(s < 0 or s in productive for s in rhs):
                    productive.add(lhs)
                    changed = True
        reachable, todo = {0}, [0]
        while todo:
            for rule in self.by_lhs[todo.pop()]:
                for s in self.rules[rule][1]:
                    if s >= 0 and s not in reachable:
                        reachable.add(s)
                        todo.append(s)
        dead = sorted(self.names[n] for n in reachable - productive if "~" not in self.names[n])
        if 0 not in productive:
            raise GrammarError(
                "the grammar derives no finite string"
                + (f" (rules that never end: {', '.join(dead)})" if dead else "")
            )
        if dead:
            raise GrammarError(f"rules that derive no finite string: {', '.join(dead)}")
        # an unproductive expanded operator (e.g. `x*` of a dead x) is caught through its owner

    def symbol_label(self, symbol: int) -> str:
        return self.terminal_labels[~symbol] if symbol < 0 else self.labels[symbol]

    def item_label(self, item: tuple[int, int, int, int]) -> str:
        """An item as `lhs → matched • rest`."""
        rule, dot = item[0], item[1]
        lhs, rhs = self.rules[rule]
        parts = [self.symbol_label(s) for s in rhs]
        return f"{self.labels[lhs]} → " + " ".join([*parts[:dot], "•", *parts[dot:]])

    def parse_stacks(self, chart: list[EarleySet], limit: int = 4) -> list[list[tuple]]:
        """Up to `limit` of the stacks the chart holds at its last position, each from the top
        (an item about to read a terminal) down to the start rule: each item's parent is an
        item of the set at its origin that waits for its rule."""
        rules = self.rules
        stacks: list[list[tuple]] = []

        def down(stack: list[tuple]) -> None:
            if len(stacks) >= limit:
                return
            rule, _, origin, _ = stack[-1]
            if rule == 0:
                stacks.append(list(stack))
                return
            for parent in chart[origin].waiting.get(rules[rule][0], ()):
                if parent not in stack:
                    stack.append(parent)
                    down(stack)
                    stack.pop()

        for item in chart[-1].scanners:
            down([item])
        return stacks

    # -- the recognizer -------------------------------------------------------------------

    def initial_set(self) -> EarleySet:
        earley = EarleySet(self, 0)
        earley.add((0, 0, 0, 0), [])
        return earley.close([])

    def scan(self, chart: list[EarleySet], byte: int) -> EarleySet | None:
        """The Earley set after `byte` (chart holds the sets so far), or None when no item
        can read it: the prefix then leaves the language."""
        last = chart[-1]
        if not last.byte_mask >> byte & 1:
            return None
        nxt = EarleySet(self, len(chart))
        rules, terminals = self.rules, self.terminals
        for rule, dot, origin, state in last.scanners:
            target = terminals[~rules[rule][1][dot]].transitions[state][byte]
            if target >= 0:
                nxt.add((rule, dot, origin, target), chart)
        return nxt.close(chart)

    def accepts(self, data: bytes) -> bool:
        """Whether `data` is a sentence of the grammar (a whole match)."""
        chart = [self.initial_set()]
        for byte in data:
            nxt = self.scan(chart, byte)
            if nxt is None:
                return False
            chart.append(nxt)
        return chart[-1].accepting

    def accepts_prefix(self, data: bytes) -> bool:
        """Whether `data` can be continued into a sentence."""
        chart = [self.initial_set()]
        for byte in data:
            nxt = self.scan(chart, byte)
            if nxt is None:
                return False
            chart.append(nxt)
        return True


class EarleySet:
    """The Earley items at one position of the output. An item (rule, dot, origin, state):
    `rule`'s right-hand side is matched up to `dot` from position `origin`; when the symbol
    after the dot is a terminal, `state` is its DFA state so far (0 when not started).

    The set is the stack in disguise: an item with origin j points back to the set at j, whose
    items wait for this rule to complete, and so on down to the start rule.
    """

    __slots__ = ("grammar", "position", "items", "seen", "waiting", "scanners", "byte_mask", "key")

    def __init__(self, grammar: ContextFreeGrammar, position: int) -> None:
        self.grammar = grammar
        self.position = position
        self.items: list[tuple[int, int, int, int]] = []
        self.seen: set[tuple[int, int, int, int]] = set()
        self.waiting: dict[int, list[tuple[int, int, int, int]]] = {}  # by nonterminal
        self.scanners: list[tuple[int, int, int, int]] = []  # items at a terminal
        self.byte_mask = 0  # the bytes some scanner can read next
        self.key: frozenset | None = None  # see state_key

    def state_key(self, chart: list[EarleySet]) -> frozenset:
        """What the future of the parse depends on, as a hashable value: this set's items with
        each origin replaced by the key of the set it points to. Two positions with equal keys
        (a column name after the first comma and after the fifth) allow the same continuations,
        so they share one token mask. Keys of earlier sets are computed first, so the recursion
        is a loop."""
        if self.key is None:
            for earley in chart[: self.position + 1]:
                if earley.key is None:
                    earley.key = frozenset(
                        (r, d, s, None if o == earley.position else chart[o].key)
                        for r, d, o, s in earley.items
                    )
        return self.key

    def add(self, item, chart) -> None:
        if item not in self.seen:
            if len(self.items) >= MAX_EARLEY_ITEMS:
                raise GrammarLimitError(
                    f"an Earley set grew past MAX_EARLEY_ITEMS={MAX_EARLEY_ITEMS} items "
                    f"at output byte {self.position} (a highly ambiguous grammar)"
                )
            self.seen.add(item)
            self.items.append(item)

    def close(self, chart: list[EarleySet]) -> EarleySet:
        """Prediction and completion until nothing new (Aycock and Horspool's rule for
        nullable nonterminals: predicting one also steps over it)."""
        grammar = self.grammar
        rules, by_lhs, nullable = grammar.rules, grammar.by_lhs, grammar.nullable
        terminals, byte_masks = grammar.terminals, grammar.byte_masks
        items, position = self.items, self.position
        i = 0
        while i < len(items):
            rule, dot, origin, state = item = items[i]
            i += 1
            lhs, rhs = rules[rule]
            if dot == len(rhs):  # complete: advance every item that waited for lhs
                source = self if origin == position else chart[origin]
                for r, d, o, _ in source.waiting.get(lhs, ()):
                    self.add((r, d + 1, o, 0), chart)
                continue
            symbol = rhs[dot]
            if symbol >= 0:  # predict
                waiting = self.waiting.setdefault(symbol, [])
                if not waiting:
                    for r in by_lhs[symbol]:
                        self.add((r, 0, position, 0), chart)
                waiting.append(item)
                if symbol in nullable:
                    self.add((rule, dot + 1, origin, 0), chart)
            else:  # a terminal: read bytes later; step over it where it can end here
                terminal = ~symbol
                self.scanners.append(item)
                self.byte_mask |= byte_masks[terminal][state]
                if state in terminals[terminal].accepting:
                    self.add((rule, dot + 1, origin, 0), chart)
        return self

    @property
    def accepting(self) -> bool:
        return (0, 1, 0, 0) in self.seen

    def allowed_bytes(self) -> list[int]:
        return [b for b in range(256) if self.byte_mask >> b & 1]


# ---------------------------------------------------------------------------------------
# from EBNF to the CFG


class _Builder:
    def __init__(self, source: str, definitions: list[tuple[str, object, int]]) -> None:
        self.source = source
        self.index: dict[str, int] = {}
        self.names: list[str] = ["start'"]
        self.labels: list[str] = ["start'"]
        self.terminal_labels: list[str] = []
        self.rules: list[tuple[int, tuple[int, ...]]] = []
        self.terminals: list[DFA] = []
        self.terminal_index: dict[str, int] = {}
        self.terminal_states = 0
        self.owner = ""
        self.fresh = 0
        self.bodies: dict[str, object] = {}
        for name, body, pos in definitions:
            if name in self.bodies:
                raise _Parser(source).error(f"rule {name!r} is defined twice", pos)
            self.bodies[name] = body
        for name in self.bodies:
            self.index[name] = len(self.names)
            self.names.append(name)
            self.labels.append(name)

    def terminal(self, pattern: str, label: str) -> int:
        if pattern not in self.terminal_index:
            self.terminal_labels.append(label or f"/{pattern}/")
            dfa = compile_regex(pattern)
            self.terminal_states += dfa.num_states
            if self.terminal_states > MAX_TERMINAL_STATES:
                raise CompileLimitError(
                    f"grammar: its terminals need more than MAX_TERMINAL_STATES="
                    f"{MAX_TERMINAL_STATES} DFA states"
                )
            self.terminal_index[pattern] = len(self.terminals)
            self.terminals.append(dfa)
        return ~self.terminal_index[pattern]

    def new_rule(self, lhs: int, rhs: list[int]) -> None:
        if len(self.rules) >= MAX_GRAMMAR_RULES:
            raise CompileLimitError(
                f"grammar: more than MAX_GRAMMAR_RULES={MAX_GRAMMAR_RULES} rules once its "
                "groups and quantifiers are expanded"
            )
        self.rules.append((lhs, tuple(rhs)))

    def helper(self, node) -> int:
        self.fresh += 1
        self.names.append(f"{self.owner}~{self.fresh}")
        self.labels.append(_ebnf(node))
        return len(self.names) - 1

    def symbols(self, node) -> list[int]:
        """The right-hand side for `node` (as a sequence), making helper rules on the way."""
        if isinstance(node, Seq):
            return [s for item in node.items for s in self.symbols(item)]
        if isinstance(node, Term):
            return [] if node.pattern == "" else [self.terminal(node.pattern, node.label)]
        if isinstance(node, Ref):
            if node.name not in self.index:
                raise _Parser(self.source).error(f"rule {node.name!r} is not defined", node.pos)
            return [self.index[node.name]]
        helper = self.helper(node)
        if isinstance(node, Alt):
            for option in node.options:
                self.new_rule(helper, self.symbols(option))
        elif node.op == "?":
            self.new_rule(helper, [])
            self.new_rule(helper, self.symbols(node.body))
        else:  # "*": h -> eps | h body; "+": h -> body | h body (left recursion suits Earley)
            body = self.symbols(node.body)
            self.new_rule(helper, [] if node.op == "*" else list(body))
            self.new_rule(helper, [helper, *body])
        return [helper]

    def build(self) -> ContextFreeGrammar:
        if not self.bodies:
            raise GrammarError("the grammar has no rules")
        start = next((n for n in ("start", "root") if n in self.bodies), None)
        start = start or next(iter(self.bodies))
        self.new_rule(0, [self.index[start]])
        for name, body in self.bodies.items():
            self.owner = name
            options = body.options if isinstance(body, Alt) else (body,)
            for option in options:
                self.new_rule(self.index[name], self.symbols(option))
        return ContextFreeGrammar(
            self.source,
            self.names,
            self.rules,
            self.terminals,
            self.labels,
            self.terminal_labels,
        )


def _ebnf(node) -> str:
    """A node of the syntax tree as EBNF text."""
    if isinstance(node, Ref):
        return node.name
    if isinstance(node, Term):
        return node.label or f"/{node.pattern}/"
    if isinstance(node, Seq):
        return " ".join(_ebnf(item) for item in node.items)
    if isinstance(node, Alt):
        return " | ".join(_ebnf(option) for option in node.options)
    return f"({_ebnf(node.body)}){node.op}"


@functools.lru_cache(maxsize=32)
def compile_grammar(source: str) -> ContextFreeGrammar:
    """The compiled grammar of an EBNF text (cached). GrammarError (a ValueError) for text
    outside the subset, an undefined rule, or rules that derive no string; CompileLimitError
    past the size limits."""
    if not isinstance(source, str):
        raise GrammarError(f"a grammar is EBNF text (a str), got {type(source).__name__}")
    if len(source) > MAX_GRAMMAR_LENGTH:
        raise CompileLimitError(
            f"grammar: longer than MAX_GRAMMAR_LENGTH={MAX_GRAMMAR_LENGTH} characters "
            f"({len(source)})"
        )
    return _Builder(source, _Parser(source).rules()).build()
