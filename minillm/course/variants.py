"""Class variants of the exercise checks: inputs and expected values that differ per class.

The public edition's checks are visible to every student, and with them each worked
example and its expected value. A check that draws its worked example through
`variant` keeps the public value in the public edition and draws another, from a class
seed, in a class's private copy:

    # GRADED: 3 points
    from minillm.course.variants import variant

    num_tokens = variant("num_tokens", 1000, lambda rng: rng.randrange(600, 4000, 8))
    assert kv_cache_bytes(config, num_tokens) == reference_bytes(config, num_tokens)

`variant` reads the name `CLASS_SEED` of the cell that calls it. The public edition
defines none, and `variant` returns the public value, 1000. `minillm exercises release
--seed S --out DIR` writes a private copy of the exercises in which every check starts
with `CLASS_SEED = 'S'`; there `variant` returns `draw(rng)`, `rng` seeded from the class
seed and the value's name, so each class and each named value gets its own input, the
same on every run, and never the public one. An answer that returns the public
example's expected value, rather than computing it, then fails the private check. The
seed is the secret: it lives in the instructor's private copy, never in the public
repository.

A check's Hypothesis examples are derandomized, so the public edition asks the same
questions on every run, and a student could collect them. `class_examples`, the outermost
decorator of a Hypothesis check, leaves that so in the public edition and, in a class's
copy, seeds Hypothesis from the class seed and the check's name:

    @class_examples
    @settings(max_examples=25, derandomize=True, database=None, deadline=None)
    @given(st.integers(min_value=0, max_value=10**13))
    def check(num_params): ...

The seed is a name in the check's own cell rather than a setting of this module, so
that a check changes no state of minillm (which grading treats as tampering) and each
check, run on its own, carries what it needs.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable)

SEED_NAME = "CLASS_SEED"  # the name a private check defines
MAX_DRAWS = 100


def _class_seed(frame_depth: int):
    """The `CLASS_SEED` of the cell `frame_depth` frames up, or None in the public edition."""
    seed = sys._getframe(frame_depth + 1).f_globals.get(SEED_NAME)
    if seed is not None and not str(seed).strip():
        raise ValueError(f"{SEED_NAME} must be a non-empty string or an integer")
    return seed


def variant(name: str, public: T, draw: Callable[[random.Random], T]) -> T:
    """`public` in the public edition; in a class's copy, where the calling cell defines
    `CLASS_SEED`, `draw` of a generator seeded by the class seed and `name` (two values of
    one check need two names).

    A draw equal to `public` is drawn again: a class's value always differs from the
    public one, so that the public expected value never passes a private check.
    """
    if not name:
        raise ValueError("a variant value needs a name: it seeds the value's generator")
    seed = _class_seed(1)
    if seed is None:
        return public
    # random.Random seeds a str through SHA-512: the same value in every process and run
    rng = random.Random(f"{seed}/{name}")
    for _ in range(MAX_DRAWS):
        value = draw(rng)
        if value != public:
            return value
    raise ValueError(
        f"the draw of variant {name!r} gave its public value {public!r} {MAX_DRAWS} times: "
        "draw from a range that holds other values"
    )


def class_examples(test: F) -> F:
    """A Hypothesis check, unchanged in the public edition (its settings derandomize it);
    in a class's copy, seeded from the class seed and the check's name, so that each class
    gets its own examples, the same on every run."""
    seed = _class_seed(1)
    if seed is None:
        return test
    from hypothesis import seed as hypothesis_seed

    # an int from the same SHA-512 seeding as `variant`: stable across processes and runs
    value = random.Random(f"{seed}/hypothesis/{test.__name__}").getrandbits(64)
    return hypothesis_seed(value)(test)
