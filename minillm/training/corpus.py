"""The training corpus: the Python standard library, its split, and its tokenizer.

The bundled models learn from the `.py` files of the interpreter that runs the training,
read in sorted order so that two runs see the same bytes. A file goes to the validation
split when a hash of its relative path says so; the split therefore never depends on the
order of files or on how many there are. The same rule picks the files of a few installed
packages from outside the standard library, the code on which the model cards measure how
the models do on Python they never saw.
"""

from __future__ import annotations

import ast
import collections
import hashlib
import importlib.metadata
import importlib.util
import json
import pathlib
import sys
import sysconfig
from dataclasses import dataclass

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2


@dataclass(slots=True)
class Document:
    path: str  # relative to the standard library root, with "/" separators
    text: str


def stdlib_root() -> pathlib.Path:
    """The running interpreter's standard library directory."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def corpus_description() -> str:
    """One line naming the corpus, for logs and model cards."""
    return f"CPython {sys.version.split()[0]} standard library ({stdlib_root()})"


def read_stdlib(root: pathlib.Path | None = None) -> list[Document]:
    """All `.py` files under `root` except third-party packages, sorted by relative path.

    Files that are not valid UTF-8 (a few tests carry deliberately broken encodings) are
    skipped rather than decoded with replacement characters the model would learn.
    """
    root = stdlib_root() if root is None else root
    documents = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root).as_posix()
        if "site-packages" in path.relative_to(root).parts:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        documents.append(Document(relative, text))
    if not documents:
        raise ValueError(f"no .py files found under {root}; expected a standard library directory")
    return documents


DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_nodes(tree: ast.Module) -> list[tuple[ast.AST, ast.Expr]]:
    """(owner, docstring statement) for the module and every class and function in it."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, DOCSTRING_OWNERS) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    found.append((node, first))
    return found


def without_docstrings(text: str) -> str:
    """`text` with the docstrings of its module, classes and functions cut out.

    A docstring's lines go; a body that held nothing else gets `pass` at the docstring's
    indentation, so the code still parses. Comments and every other line stay byte for
    byte. Left as they are: a file that does not parse, a file with carriage returns, and a
    docstring that shares a line with other code (`def f(): "doc"`).
    """
    if "\r" in text:
        return text
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return text
    lines = text.split("\n")
    cuts = []
    for owner, doc in docstring_nodes(tree):
        first, last = doc.lineno - 1, doc.end_lineno - 1
        before = lines[first].encode()[: doc.col_offset].decode()  # offsets count UTF-8 bytes
        after = lines[last].encode()[doc.end_col_offset :].decode()
        if before.strip() or after.strip():
            continue
        keep = [f"{before}pass"] if len(owner.body) == 1 else []
        cuts.append((first, last, keep))
    for first, last, keep in sorted(cuts, reverse=True):
        lines[first : last + 1] = keep
    return "\n".join(lines)


def is_validation(path: str, validation_fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(path) as a fraction of 2**64."""
    digest = hashlib.sha256(path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < validation_fraction


def split_documents(
    documents: list[Document], validation_fraction: float = 0.02
) -> tuple[list[Document], list[Document]]:
    """(train, validation), each in the input order."""
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    train = [d for d in documents if not is_validation(d.path, validation_fraction)]
    validation = [d for d in documents if is_validation(d.path, validation_fraction)]
    return train, validation


def train_tokenizer(documents: list[Document], vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) whose ids 0..2 are BOS, EOS and PAD.

    Newlines are split off before the byte-level pre-tokenizer. GPT-2's rule alone glues a
    newline to the indentation after it, so a prompt that ends in "\\n" would stop inside
    a token the model almost never sees end there.
    `encode` adds BOS in front, as every training document starts with it.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((d.text for d in documents), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def encode_documents(tokenizer: Tokenizer, documents: list[Document]) -> np.ndarray:
    """One token stream: BOS + text + EOS for each document, back to back.

    Returns: [num_tokens] uint16 (the vocabulary has fewer than 65,536 entries).
    """
    if tokenizer.get_vocab_size() > 2**16:
        raise ValueError(f"vocabulary of {tokenizer.get_vocab_size()} does not fit in uint16")
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    encodings = tokenizer.encode_batch([d.text for d in documents], add_special_tokens=True)
    pieces = [np.array(e.ids + [eos_id], dtype=np.uint16) for e in encodings]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def spread_windows(tokens: np.ndarray, num_windows: int, window_len: int) -> np.ndarray:
    """`num_windows` non-overlapping windows spread evenly over a token stream: [n, len] int64."""
    if len(tokens) < num_windows * window_len:
        raise ValueError(f"token stream of {len(tokens)} tokens is too short")
    last_start = len(tokens) - window_len
    starts = [i * last_start // (num_windows - 1) for i in range(num_windows)]
    return np.stack([tokens[s : s + window_len] for s in starts]).astype(np.int64)


# Code the model never saw: permissively licensed packages installed beside minillm (pinned in
# constraints.txt), each with the import directories that hold its source.
FOREIGN_PACKAGES = {"packaging": ["packaging"], "attrs": ["attr", "attrs"], "click": ["click"]}
FOREIGN_FRACTION = 0.3  # share of each package's files, picked by the hash of their paths
FOREIGN_EXCLUDED = {"packaging/licenses/_spdx.py"}  # a table of license data, not code


@dataclass(slots=True)
class PackageSource:
    name: str  # distribution name, e.g. "attrs"
    version: str
    license: str
    roots: list[pathlib.Path]  # import directories, e.g. [.../attr, .../attrs]


def installed_package(name: str, modules: list[str]) -> PackageSource:
    """An installed distribution's version, license and source directories; reads no network."""
    metadata = importlib.metadata.metadata(name)
    license_ = metadata.get("License-Expression") or metadata.get("License") or "unknown"
    roots = []
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"package {module!r} of {name!r} is not installed as a directory")
        roots.append(pathlib.Path(spec.submodule_search_locations[0]))
    return PackageSource(name, metadata["Version"], license_, roots)


def read_package_files(source: PackageSource, fraction: float) -> list[Document]:
    """The picked `.py` files of one package, sorted by path ("attr/_make.py" and so on).

    A file is picked when `is_validation(path, fraction)` says so: the rule of the stdlib
    split, so the pick depends on each path alone. FOREIGN_EXCLUDED files are data, not code.
    """
    documents = []
    for root in source.roots:
        for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
            relative = f"{root.name}/{path.relative_to(root).as_posix()}"
            if relative not in FOREIGN_EXCLUDED and is_validation(relative, fraction):
                documents.append(Document(relative, path.read_bytes().decode("utf-8")))
    return documents


def build_foreign_set(
    tokenizer: Tokenizer,
    sources: list[PackageSource],
    num_windows: int,
    window_len: int,
    fraction: float = FOREIGN_FRACTION,
) -> dict:
    """Evaluation windows of Python from outside the standard library, as stored beside a model.

    The picked files of every source, in the order given, form one stream of
    BOS + text + EOS documents, as in training; the windows spread evenly over it.
    """
    documents = [d for source in sources for d in read_package_files(source, fraction)]
    windows = spread_windows(encode_documents(tokenizer, documents), num_windows, window_len)
    return {
        "description": "Python code from outside the standard library: windows of the "
        "picked files' token stream",
        "sources": [{"name": s.name, "version": s.version, "license": s.license} for s in sources],
        "files": [d.path for d in documents],
        "token_ids": windows.tolist(),
    }


def site_packages_root() -> pathlib.Path:
    """The running environment's directory of installed pure-Python packages."""
    return pathlib.Path(sysconfig.get_paths()["purelib"])


SITE_MAX_FILE_BYTES = 200_000  # larger files are generated tables (unicode data, protobufs)


def read_site_packages(
    root: pathlib.Path | None = None, exclude: set[str] | None = None
) -> list[Document]:
    """The `.py` files of the installed packages, sorted by path, as extra training text.

    Every file with a path component in `exclude` is left out, wherever it sits: the
    foreign packages' import directories (by default) and the copies other packages vendor
    (`pip/_vendor/packaging/...`), so the foreign evaluation stays code the model never saw.
    Also left out: distribution metadata directories of excluded names, the editable-install
    finders (they hold the checkout's path), files over SITE_MAX_FILE_BYTES, non-UTF-8 files.
    """
    root = site_packages_root() if root is None else root
    if exclude is None:
        exclude = {module for modules in FOREIGN_PACKAGES.values() for module in modules}
    prefixes = tuple(f"{name}-" for name in exclude)
    documents = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        parts = path.relative_to(root).parts
        if exclude.intersection(parts) or any(part.startswith(prefixes) for part in parts):
            continue
        if parts[0].startswith("__editable__") or path.stat().st_size > SITE_MAX_FILE_BYTES:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        documents.append(Document(path.relative_to(root).as_posix(), text))
    return documents


def files_per_package(documents: list[Document]) -> dict[str, int]:
    """How many of `documents` sit under each top-level directory (a module's file: itself)."""
    counts = collections.Counter(d.path.split("/")[0].removesuffix(".py") for d in documents)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


# Chat turns as Python comments, the only dialogue the standard library's code contains;
# `minillm serve` renders it for /v1/chat/completions as transformers' apply_chat_template does.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}# {{ message['role'] }}: "
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}"
)


def tokenizer_config() -> dict:
    """`tokenizer_config.json` for `transformers.AutoTokenizer` (a fast tokenizer)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: pathlib.Path) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config()
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
