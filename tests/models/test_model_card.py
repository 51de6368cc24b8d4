"""The card's measurements of code the model never saw: the header-completion rule and the
foreign evaluation set, checked on hand-made completions and a tiny synthetic package."""

from __future__ import annotations

import json
import pathlib

import pytest

from minillm.model.loader import BUNDLED_MODELS_DIR
from minillm.model.tokenizer import Tokenizer
from minillm.training import corpus
from minillm.training.model_card import HEADERS, header_body, parses

HEADER = "def clamp(value, low, high):"
METHOD = "class Box:\n    def area(self):"


def test_body_that_parses_stops_at_eos():
    completion = "\n    if value < low:\n        return low\n    return min(value, high)\n"
    body, stop = header_body(HEADER, completion, stopped_at_eos=True)
    assert (body, stop) == (completion, "eos")
    assert parses(HEADER + body)


def test_eos_keeps_an_unfinished_body_and_it_fails_to_parse():
    completion = "\n    return min(value,"
    body, stop = header_body(HEADER, completion, stopped_at_eos=True)
    assert (body, stop) == (completion, "eos")
    assert not parses(HEADER + body)


def test_token_limit_drops_the_cut_line():
    # the limit struck inside the second statement: only the whole first line stays
    completion = "\n    low = max(low, 0)\n    return min(max(value, lo"
    body, stop = header_body(HEADER, completion, stopped_at_eos=False)
    assert (body, stop) == ("\n    low = max(low, 0)", "limit")
    assert parses(HEADER + body)
    # a wrong rule that keeps the cut line would not parse
    assert not parses(HEADER + completion)


def test_token_limit_inside_an_open_block_does_not_parse():
    completion = "\n    for x in range(3):\n        if x:\n            y = x +"
    body, stop = header_body(HEADER, completion, stopped_at_eos=False)
    assert body == "\n    for x in range(3):\n        if x:"
    assert not parses(HEADER + body)


def test_dedent_into_new_top_level_code_cuts_there():
    completion = "\n    return max(low, min(value, high))\n\n\nclamp(1, 2,"
    body, stop = header_body(HEADER, completion, stopped_at_eos=False)
    assert (body, stop) == ("\n    return max(low, min(value, high))\n\n", "dedent")
    assert parses(HEADER + body)
    assert not parses(HEADER + completion)


def test_blank_and_deeper_lines_do_not_end_the_body():
    completion = "\n    x = 1\n\n        \n    return x\ny = 2"
    body, stop = header_body(HEADER, completion, stopped_at_eos=True)
    assert stop == "dedent"
    assert body == "\n    x = 1\n\n        \n    return x"


def test_method_body_ends_at_the_methods_own_indent():
    completion = "\n        return self.w * self.h\n\n    def volume(self):\n        return 0"
    body, stop = header_body(METHOD, completion, stopped_at_eos=False)
    assert (body, stop) == ("\n        return self.w * self.h\n", "dedent")
    assert parses(METHOD + body)  # the class line makes dedenting unnecessary


def test_an_empty_body_does_not_parse():
    body, stop = header_body(HEADER, "\nx = 1\n", stopped_at_eos=True)
    assert (body, stop) == ("", "dedent")
    assert not parses(HEADER + body)
    body, stop = header_body(HEADER, " return", stopped_at_eos=False)
    assert (body, stop) == ("", "limit")  # never left the header's line: nothing kept


def test_parses_rejects_null_bytes_without_raising():
    assert not parses("x = 1\0")


def test_headers_are_ten_distinct_valid_headers():
    assert len(HEADERS) == len(set(HEADERS)) == 10
    for header in HEADERS:
        assert parses(header + "\n" + " " * (len(header.split("\n")[-1]) + 4) + "pass")
        assert not parses(header)  # nothing but the header: the body must come from the model


def write(root: pathlib.Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def tiny_packages(tmp_path) -> list[corpus.PackageSource]:
    for i in range(40):
        write(tmp_path / "alpha", f"mod_{i:02d}.py", f"def f{i}(x):\n    return x + {i}\n")
        write(tmp_path / "beta", f"sub/mod_{i:02d}.py", f"class C{i}:\n    n = {i}\n")
    write(tmp_path / "alpha", "notes.txt", "not python\n")
    return [
        corpus.PackageSource("alpha", "1.0", "MIT", [tmp_path / "alpha"]),
        corpus.PackageSource("beta-dist", "2.0", "BSD-3-Clause", [tmp_path / "beta"]),
    ]


@pytest.fixture(scope="module")
def tokenizer():
    documents = [corpus.Document(f"m{i}.py", f"def f{i}(x):\n    return x\n") for i in range(50)]
    return corpus.train_tokenizer(documents, vocab_size=300)


def test_foreign_set_is_deterministic_and_picks_by_path(tiny_packages, tokenizer):
    first = corpus.build_foreign_set(tokenizer, tiny_packages, 4, 17, fraction=0.5)
    second = corpus.build_foreign_set(tokenizer, tiny_packages, 4, 17, fraction=0.5)
    assert first == second
    assert first["sources"] == [
        {"name": "alpha", "version": "1.0", "license": "MIT"},
        {"name": "beta-dist", "version": "2.0", "license": "BSD-3-Clause"},
    ]
    # the pick is the path hash alone, in sorted order per package, packages in order
    expected = [f"alpha/mod_{i:02d}.py" for i in range(40)]
    expected += [f"beta/sub/mod_{i:02d}.py" for i in range(40)]
    expected = [p for p in expected if corpus.is_validation(p, 0.5)]
    assert first["files"] == expected
    assert 0 < len(expected) < 80
    assert [len(w) for w in first["token_ids"]] == [17] * 4


def test_foreign_windows_come_from_the_bos_text_eos_stream(tiny_packages, tokenizer):
    foreign = corpus.build_foreign_set(tokenizer, tiny_packages, 3, 9, fraction=0.5)
    eos = tokenizer.token_to_id(corpus.EOS_TOKEN)
    stream = []
    for path in foreign["files"]:
        package, relative = path.split("/", 1)
        root = tiny_packages[0].roots[0] if package == "alpha" else tiny_packages[1].roots[0]
        text = (root / relative).read_text()
        stream += tokenizer.encode(text).ids + [eos]  # encode adds BOS in front
    assert stream[0] == tokenizer.token_to_id(corpus.BOS_TOKEN)
    last = len(stream) - 9
    starts = [0, last // 2, last]
    assert foreign["token_ids"] == [stream[s : s + 9] for s in starts]


def test_foreign_set_too_short_and_excluded_files(tiny_packages, tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="too short"):
        corpus.build_foreign_set(tokenizer, tiny_packages, 64, 257, fraction=0.5)
    picked = corpus.build_foreign_set(tokenizer, tiny_packages, 2, 5, fraction=0.5)["files"]
    monkeypatch.setattr(corpus, "FOREIGN_EXCLUDED", {picked[0]})
    files = corpus.build_foreign_set(tokenizer, tiny_packages, 2, 5, fraction=0.5)["files"]
    assert files == picked[1:]


def test_the_bundled_foreign_set_is_rebuilt_from_the_pinned_packages():
    model_dir = BUNDLED_MODELS_DIR / "minillm-stdlib-target"
    foreign = json.loads((model_dir / "foreign_tokens.json").read_text())
    draft = BUNDLED_MODELS_DIR / "minillm-stdlib-draft" / "foreign_tokens.json"
    assert json.loads(draft.read_text()) == foreign
    constraints = (pathlib.Path(__file__).parents[2] / "constraints.txt").read_text().split()
    for source in foreign["sources"]:
        assert f"{source['name']}=={source['version']}" in constraints
        assert source["license"] in {"MIT", "BSD-3-Clause", "Apache-2.0 OR BSD-2-Clause"}
    # nothing of the standard library: every file lies under one of the named packages
    roots = {m for modules in corpus.FOREIGN_PACKAGES.values() for m in modules}
    assert {f.split("/")[0] for f in foreign["files"]} <= roots
    sources = [corpus.installed_package(n, m) for n, m in corpus.FOREIGN_PACKAGES.items()]
    rebuilt = corpus.build_foreign_set(Tokenizer(model_dir).backend, sources, 64, 257)
    assert rebuilt == foreign


def test_a_card_of_two_stages_names_both_and_reproduces_them_in_order():
    from minillm.training.model_card import render_card

    summary_path = BUNDLED_MODELS_DIR / "minillm-stdlib-target" / "training_summary.json"
    summary = json.loads(summary_path.read_text())
    first_cfg = dict(summary["train_config"], time_budget_s=4500.0, seed=0)
    second_cfg = dict(summary["train_config"], time_budget_s=3000.0, seed=1)
    summary["train_config"] = second_cfg
    summary["steps"], summary["train_time_s"] = 8000, 7500.0
    summary["stages"] = [
        {"init_from_sha256": None, "steps": 5000, "tokens_seen": 1, "train_time_s": 4500.0,
         "learning_rate": 0.002, "train_config": first_cfg},
        {"init_from_sha256": "ab" * 32, "steps": 3000, "tokens_seen": 1, "train_time_s": 3000.0,
         "learning_rate": 0.001, "train_config": second_cfg},
    ]  # fmt: skip
    card = render_card(summary, summary["evaluation"])
    assert "| wall-clock time | 125.0 min (75.0 + 50.0) |" in card
    assert "| steps | 8,000 (5,000 + 3,000) of 16 x 256 tokens |" in card
    assert "2 stages" in card and "peak learning rates 0.002, 0.001 |" in card
    assert "| seed | 0, 1 (the batch order of each stage) |" in card
    fits = [line for line in card.splitlines() if line.startswith("python -m") and " fit " in line]
    assert len(fits) == 2
    assert "--time-budget-s 4500" in fits[0] and "--seed 0" in fits[0]
    assert fits[0].endswith("--out-dir stage1") and "--init-from" not in fits[0]
    assert "--time-budget-s 3000" in fits[1] and "--seed 1" in fits[1]
    assert "--init-from stage1/minillm-stdlib-target --peak-lr 0.001" in fits[1]
    assert "--out-dir" not in fits[1]


def test_a_card_of_a_corpus_without_docstrings_says_so_and_reproduces_it():
    from minillm.training.model_card import render_card

    summary_path = BUNDLED_MODELS_DIR / "minillm-stdlib-target" / "training_summary.json"
    summary = json.loads(summary_path.read_text())
    summary["corpus"] = dict(summary["corpus"], no_docstrings=False)
    plain = render_card(summary, summary["evaluation"])
    summary["corpus"] = dict(
        summary["corpus"],
        no_docstrings=True,
        num_train_bytes=28_600_000,
        num_docstring_bytes_removed=2_400_000,
    )
    card = render_card(summary, summary["evaluation"])
    assert "docstrings" not in plain
    assert "with the docstrings cut out" in card
    assert "2.4 MB of the split's 31.0 MB" in card and "28.6 MB" in card
    fits = [line for line in card.splitlines() if line.startswith("python -m") and " fit " in line]
    assert len(fits) == 1 and "--no-docstrings" in fits[0]


def test_the_header_table_shows_each_bodys_first_line():
    from minillm.training.model_card import render_card

    summary_path = BUNDLED_MODELS_DIR / "minillm-stdlib-target" / "training_summary.json"
    summary = json.loads(summary_path.read_text())
    evaluation = dict(summary["evaluation"])
    evaluation["headers"] = [
        {"header": "def merge(a, b):", "body": "\n\n    return a | b\n", "stop": "dedent",
         "parses": True},
        {"header": "class C:\n    def f(self):", "body": "", "stop": "limit", "parses": False},
        {"header": "def g():", "body": "\n    return '" + "x" * 80, "stop": "limit",
         "parses": False},
    ]  # fmt: skip
    rows = [line for line in render_card(summary, evaluation).splitlines() if "| `def " in line]
    assert rows == [
        "| `def merge(a, b):` | `return a \\| b` | dedent | yes |",
        "| `def f(self):` | (empty) | limit | no |",
        f"| `def g():` | `return '{'x' * 52} ...` | limit | no |",
    ]
