"""The training pipeline on a corpus small enough to train in seconds."""

from __future__ import annotations

import ast
import csv
import dataclasses
import hashlib
import io
import json
import math
import pathlib
import tokenize

import numpy as np
import pytest
import torch

from minillm.model.loader import load_model
from minillm.training import corpus, train

TINY_SPEC = train.ModelSpec("tiny", 32, 1, 2, 1, 64, 1e-2)


def write(root: pathlib.Path, relative: str, data: bytes) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_read_stdlib_sorted_utf8_without_site_packages(tmp_path):
    write(tmp_path, "b.py", b"b = 1\n")
    write(tmp_path, "a/z.py", b"z = 2\n")
    write(tmp_path, "a/notes.txt", b"not python\n")
    write(tmp_path, "site-packages/pkg/x.py", b"x = 3\n")
    write(tmp_path, "latin.py", "s = 'caf\u00e9'\n".encode("latin-1"))
    documents = corpus.read_stdlib(tmp_path)
    assert [d.path for d in documents] == ["a/z.py", "b.py"]
    assert documents[0].text == "z = 2\n"


def test_site_packages_leave_out_the_foreign_code_and_its_vendored_copies(tmp_path):
    files = {
        "zlib_like/core.py": "x = 1\n",
        "aaa.py": "a = 1\n",
        "click/core.py": "foreign = 1\n",
        "attr/_make.py": "foreign = 1\n",
        "pip/_vendor/packaging/version.py": "vendored = 1\n",
        "attrs-25.1.0.dist-info/helper.py": "meta = 1\n",
        "__editable___minillm_0_1_0_finder.py": "MAPPING = {'minillm': '/some/checkout'}\n",
        "big/table.py": "t = 0\n" * (corpus.SITE_MAX_FILE_BYTES // 6 + 1),
        "pkg/sub/mod.py": "b = 2\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "pkg" / "latin1.py").write_bytes(b"s = '\xe9'\n")
    documents = corpus.read_site_packages(tmp_path)
    assert [d.path for d in documents] == ["aaa.py", "pkg/sub/mod.py", "zlib_like/core.py"]
    assert documents[1].text == "b = 2\n"
    # the default leaves out exactly the import directories of the foreign evaluation set
    assert {"packaging", "attr", "attrs", "click"} == {
        m for ms in corpus.FOREIGN_PACKAGES.values() for m in ms
    }
    only_click = corpus.read_site_packages(tmp_path, exclude={"click"})
    assert "attr/_make.py" in [d.path for d in only_click]
    assert "click/core.py" not in [d.path for d in only_click]
    assert corpus.files_per_package(documents) == {"aaa": 1, "pkg": 1, "zlib_like": 1}
    more = [corpus.Document(path, "") for path in ("z/a.py", "z/b/c.py", "y.py", "x/d.py")]
    assert list(corpus.files_per_package(more).items()) == [("z", 2), ("x", 1), ("y", 1)]


DOCUMENTED = '''"""Module docstring."""
import os  # a comment stays


class Empty:
    """Only a docstring: the body becomes pass."""


class Point:
    r"""Two lines,
    one with caf\u00e9 in it."""

    def norm(self) -> float:
        'A method.'
        return (self.x**2 + self.y**2) ** 0.5

    async def wait(self):
        "Short."
        def inner():
            """Nested."""
            return "not a docstring"
        "a later string is not a docstring"
        return inner()


def one_line(): "shares its line, so it stays"
def with_comment():
    """Then a comment."""  # on the same line: stays
    return 1
'''

STRIPPED = '''import os  # a comment stays


class Empty:
    pass


class Point:

    def norm(self) -> float:
        return (self.x**2 + self.y**2) ** 0.5

    async def wait(self):
        def inner():
            return "not a docstring"
        "a later string is not a docstring"
        return inner()


def one_line(): "shares its line, so it stays"
def with_comment():
    """Then a comment."""  # on the same line: stays
    return 1
'''


def test_without_docstrings_cuts_their_lines_and_keeps_the_rest():
    assert corpus.without_docstrings(DOCUMENTED) == STRIPPED
    assert corpus.without_docstrings(STRIPPED) == STRIPPED
    for untouched in ['def f(:\n    """x"""\n', '"""doc"""\r\nx = 1\r\n', ""]:
        assert corpus.without_docstrings(untouched) == untouched


def docstrings_cut_from_the_tree(source: str) -> str:
    """The oracle: drop, in the syntax tree, each docstring that has its lines to itself.

    "To itself" is read off the token stream: only indentation before the string token on
    its line and a NEWLINE right after it.
    """
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    alone = set()
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.STRING or tokens[i + 1].type != tokenize.NEWLINE:
            continue
        before = [t for t in tokens[:i] if t.end[0] == tok.start[0]]
        if all(t.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NL) for t in before):
            alone.add(tok.start)
    tree = ast.parse(source)
    for node in ast.walk(tree):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None:
            doc = node.body[0]
            if (doc.lineno, doc.col_offset) in alone:
                node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree)


def test_without_docstrings_matches_the_tree_with_them_cut_on_standard_library_files():
    documents = corpus.read_stdlib()[::40]
    changed = 0
    for document in documents:
        try:
            expected = docstrings_cut_from_the_tree(document.text)
        except (SyntaxError, tokenize.TokenError, ValueError):
            assert corpus.without_docstrings(document.text) == document.text
            continue
        stripped = corpus.without_docstrings(document.text)
        changed += stripped != document.text
        if "\r" not in document.text:
            assert ast.dump(ast.parse(stripped)) == expected, document.path
    assert changed > len(documents) // 2


def test_a_cached_corpus_built_otherwise_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"corpus": "stdlib"}))
    with pytest.raises(ValueError, match="site_packages=False"):
        train.prepare_corpus(tmp_path, seq_len=8, site_packages=True)


def test_split_depends_on_the_path_alone():
    paths = [f"pkg/module_{i}.py" for i in range(5000)]
    documents = [corpus.Document(p, "") for p in paths]
    train_docs, val_docs = corpus.split_documents(documents, 0.02)
    assert len(train_docs) + len(val_docs) == 5000
    assert 0.015 < len(val_docs) / 5000 < 0.025
    # reversing the input reverses each split, but moves no file across
    train_rev, val_rev = corpus.split_documents(documents[::-1], 0.02)
    assert [d.path for d in val_rev] == [d.path for d in val_docs][::-1]
    assert len(train_rev) == len(train_docs)
    with pytest.raises(ValueError, match="validation_fraction"):
        corpus.split_documents(documents, 1.5)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory) -> train.CorpusData:
    documents = [
        corpus.Document(f"m{i}.py", f"def f{i}(x):\n    return x * {i}\n\n\nprint(f{i}(2))\n")
        for i in range(200)
    ]
    work_dir = tmp_path_factory.mktemp("work")
    tokenizer = corpus.train_tokenizer(documents[:180], vocab_size=300)
    corpus.write_tokenizer_files(tokenizer, work_dir)
    val = corpus.encode_documents(tokenizer, documents[180:])
    return train.CorpusData(
        tokenizer_path=work_dir / "tokenizer.json",
        train_tokens=corpus.encode_documents(tokenizer, documents[:180]),
        heldout=torch.from_numpy(train.heldout_windows(val, 4, 17)),
        manifest={"corpus": "tiny", "validation_files": [d.path for d in documents[180:]]},
    )


def test_tokenizer_special_ids_and_document_stream(tiny_corpus):
    tokenizer = corpus.Tokenizer.from_file(str(tiny_corpus.tokenizer_path))
    assert [tokenizer.token_to_id(t) for t in corpus.SPECIAL_TOKENS] == [0, 1, 2]
    assert tokenizer.encode("x = 1").ids[0] == 0
    stream = corpus.encode_documents(tokenizer, [corpus.Document("a.py", "x = 1\n")] * 2)
    body = tokenizer.encode("x = 1\n", add_special_tokens=False).ids
    assert stream.tolist() == ([0] + body + [1]) * 2
    # the newline stays a token of its own, apart from the indentation after it
    tokens = tokenizer.encode("f(x):\n    return", add_special_tokens=False).tokens
    assert "\u010a" in tokens  # byte-level spelling of "\n"


def test_heldout_windows_spread_over_the_stream():
    stream = np.arange(100, dtype=np.uint16)
    windows = train.heldout_windows(stream, 3, 10)
    assert windows[:, 0].tolist() == [0, 45, 90]
    assert windows[-1, -1] == 99
    with pytest.raises(ValueError, match="too short"):
        train.heldout_windows(stream, 11, 10)


def test_learning_rate_warmup_then_cosine():
    cfg = train.TrainConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert train.learning_rate(0, 0.0, 1.0, cfg) == pytest.approx(0.1)
    assert train.learning_rate(9, 0.05, 1.0, cfg) == pytest.approx(1.0)
    assert train.learning_rate(50, 0.5, 1.0, cfg) == pytest.approx(0.55)
    assert train.learning_rate(100, 1.0, 1.0, cfg) == pytest.approx(0.1)


def test_fit_learns_and_writes_a_loadable_directory(tiny_corpus, tmp_path):
    cfg = train.TrainConfig(
        seq_len=16, batch_size=8, max_steps=60, warmup_steps=5, eval_interval_steps=30, threads=1
    )
    summary = train.fit(TINY_SPEC, cfg, tiny_corpus, tmp_path)
    assert summary["steps"] == 60
    assert summary["tokens_seen"] == 60 * 8 * 16
    # far below a uniform guess over 300 tokens: this corpus is almost all repetition
    assert summary["heldout_loss_float32_weights"] < math.log(300) - 2
    with (tmp_path / "training_log.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows if r["heldout_loss"]] == ["30", "60", "60"]
    loaded = load_model(tmp_path)
    assert loaded.config.torch_dtype == "bfloat16"
    assert loaded.tokenizer.pad_token_id == 2
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    heldout = json.loads((tmp_path / "heldout_tokens.json").read_text())["token_ids"]
    assert heldout == tiny_corpus.heldout.tolist()


def test_fit_needs_a_budget(tiny_corpus, tmp_path):
    with pytest.raises(ValueError, match="max-steps"):
        train.fit(TINY_SPEC, train.TrainConfig(), tiny_corpus, tmp_path)


def test_fit_continues_an_earlier_run(tiny_corpus, tmp_path):
    cfg = train.TrainConfig(
        seq_len=16, batch_size=8, max_steps=20, warmup_steps=5, eval_interval_steps=10, threads=1
    )
    first = train.fit(TINY_SPEC, cfg, tiny_corpus, tmp_path / "a")
    # at a zero learning rate AdamW moves nothing: the continued weights are the loaded ones
    frozen = dataclasses.replace(TINY_SPEC, learning_rate=0.0)
    still = train.fit(frozen, cfg, tiny_corpus, tmp_path / "b", init_from=tmp_path / "a")
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (
        tmp_path / "a" / "model.safetensors"
    ).read_bytes()
    assert still["heldout_loss_float32_weights"] == pytest.approx(
        first["heldout_loss_float32_weights"], abs=1e-3
    )
    more = dataclasses.replace(cfg, max_steps=10, seed=1)
    second = train.fit(TINY_SPEC, more, tiny_corpus, tmp_path / "c", init_from=tmp_path / "a")
    assert second["steps"] == 30
    assert second["tokens_seen"] == 30 * 8 * 16
    assert second["train_time_s"] >= first["train_time_s"]
    sha = hashlib.sha256((tmp_path / "a" / "model.safetensors").read_bytes()).hexdigest()
    assert [(s["steps"], s["init_from_sha256"]) for s in second["stages"]] == [
        (20, None),
        (10, sha),
    ]
    assert second["stages"][1]["train_config"]["seed"] == 1
    with (tmp_path / "c" / "training_log.csv").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == [10, 20, 20, 30, 30]  # the earlier log, then this run's, counted on
    # started from trained weights, the first logged loss is far below a fresh start's
    with (tmp_path / "a" / "training_log.csv").open() as f:
        fresh_first = float(next(csv.DictReader(f))["train_loss"])
    with (tmp_path / "c" / "training_log.csv").open() as f:
        continued_first = float(list(csv.DictReader(f))[3]["train_loss"])
    assert continued_first < fresh_first - 0.5


def test_fit_refuses_to_continue_another_shape_or_tokenizer(tiny_corpus, tmp_path):
    cfg = train.TrainConfig(seq_len=16, batch_size=8, max_steps=2, warmup_steps=1, threads=1)
    train.fit(TINY_SPEC, cfg, tiny_corpus, tmp_path / "a")
    wider = dataclasses.replace(TINY_SPEC, intermediate_size=TINY_SPEC.intermediate_size * 2)
    with pytest.raises(ValueError, match="another shape.*intermediate_size"):
        train.fit(wider, cfg, tiny_corpus, tmp_path / "b", init_from=tmp_path / "a")
    other = corpus.train_tokenizer([corpus.Document("z.py", "y = 2\n" * 50)], vocab_size=300)
    corpus.write_tokenizer_files(other, tmp_path / "tok")
    renamed = dataclasses.replace(tiny_corpus, tokenizer_path=tmp_path / "tok" / "tokenizer.json")
    with pytest.raises(ValueError, match="another tokenizer"):
        train.fit(TINY_SPEC, cfg, renamed, tmp_path / "b", init_from=tmp_path / "a")
