"""The checks of the conventions exercise reject plausible wrong answers.

The check cells run in this process (no kernel): the solution's cells define the
functions, then each graded cell runs once with the solution (it must pass), once with
the stub (NotImplementedError), and once per wrong answer (it must fail).
"""

from __future__ import annotations

from .conftest import ROOT
from .exercise_checks import ExerciseChecks

WRONG_ANSWERS = {
    "weight_bytes_bf16": {
        "bits instead of bytes": lambda n: 16 * n,
        "float32 bytes": lambda n: 4 * n,
        "one byte per weight": lambda n: n,
        "a float": lambda n: n * 2.0,
    },
    "to_gb_and_gib": {
        "both decimal": lambda b: (b / 1e9, b / 1e9),
        "both binary": lambda b: (b / 2**30, b / 2**30),
        "swapped": lambda b: (b / 2**30, b / 1e9),
        "1024 * 1000 * 1000": lambda b: (b / 1e9, b / (1024 * 1000 * 1000)),
        "bits": lambda b: (8 * b / 1e9, 8 * b / 2**30),
    },
    "packed_bytes": {
        "bits instead of bytes": lambda n, bits: n * bits,
        "rounded down": lambda n, bits: n * bits // 8,
        "not rounded": lambda n, bits: n * bits / 8,
        "at least a byte per element": lambda n, bits: n * max(bits // 8, 1),
    },
    "fp16_elements_in": {
        "GB instead of GiB": lambda g: g * 10**9 // 2,
        "bytes, not elements": lambda g: g * 2**30,
        "divided by 16 bits": lambda g: g * 2**30 // 16,
        "1024 * 1000 * 1000": lambda g: g * 1024 * 1000 * 1000 // 2,
        "a float": lambda g: g * 2**30 / 2,
    },
    "decode_rates": {
        "seconds per token": lambda n, d: (n / d, d / n),
        "tokens per ms": lambda n, d: (n / d / 1000, 1000 * d / n),
        "swapped": lambda n, d: (1000 * d / n, n / d),
        "tokens per minute": lambda n, d: (60 * n / d, 1000 * d / n),
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch00_conventions.ipynb"
    EXERCISE = ROOT / "exercises" / "ch00_conventions.ipynb"
    POINTS = [2, 3, 2, 2, 3]
    WRONG_ANSWERS = WRONG_ANSWERS
