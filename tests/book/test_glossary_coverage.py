"""The book as a whole: the glossary covers the seed glossaries, links resolve, parts match.

`data/seed_terms.json` lists the term names (with aliases) of four published glossaries
of LLM inference that the book set out to cover. Each must be an entry, or an entry's
alias, in book/glossary.md, unless `OMITTED` names it with the reason it is left out.
"""

import json
import pathlib
import re

from .conftest import ROOT, toc_files

BOOK = ROOT / "book"
SEED_TERMS = json.loads((pathlib.Path(__file__).parent / "data" / "seed_terms.json").read_text())

# Deliberate omissions: each seed term the glossary leaves out, with the reason.
_PRODUCT = "a product, library or service the book does not teach (it names some in passing)"
_OPS = "deployment and operations practice outside the engine, which the book does not cover"
_LLAMA_CPP = "a llama.cpp server (llama-server) setting; the book teaches vLLM's and SGLang's"
_NOT_TAUGHT = "a model-architecture or optimization topic no chapter teaches"
_BUILD = "an implement-from-scratch task (chapter 10's Build it yourself exercises), not a term"
OMITTED: dict[str, str] = {
    **dict.fromkeys(
        ["AIBrix", "LMCache", "Mooncake", "NIXL", "Punica", "Ray"],
        _PRODUCT,
    ),
    **dict.fromkeys(["Ray Serve", "Envoy AI Gateway", "Gateway API Inference Extension"], _PRODUCT),
    **dict.fromkeys(["FlashMLA", "PyTorch", "tqdm", "uvloop", "ZeroMQ", "asyncio"], _PRODUCT),
    **dict.fromkeys(["FastAPI", "Hugging Face", "Safetensors", "GGUF", "llama.cpp"], _PRODUCT),
    **dict.fromkeys(["llm-compressor", "MLX", "TGI", "Cloud Run", "Kubernetes"], _PRODUCT),
    **dict.fromkeys(["Grafana", "Alertmanager", "ORCA"], _PRODUCT),
    **dict.fromkeys(["Alert rule", "Container", "Deployment", "Environment variable"], _OPS),
    **dict.fromkeys(["HTTP status codes", "Host addresses (127.0.0.1, 0.0.0.0)"], _OPS),
    **dict.fromkeys(["TLS", "Volume", "Shadow traffic"], _OPS),
    **dict.fromkeys(["Thread", "RPC", "Checkpoint"], _OPS),
    **dict.fromkeys(["Cache-ram", "Slot", "Unified KV pool", "Context size"], _LLAMA_CPP),
    "Linear attention": _NOT_TAUGHT,
    "RoPE scaling": _NOT_TAUGHT,
    **dict.fromkeys(["Fixed state", "CoT", "Function call"], _NOT_TAUGHT),
    "Reasoning parser": _NOT_TAUGHT,
    "Serving": "the subject of the whole book rather than a term of it",
    "Key vLLM flags": "a list of flags, each one an entry under its own name",
    "CUDA out of memory": "an error message; the memory budget it points to is an entry (KV pool)",
    **dict.fromkeys(
        ["Property testing", "State snapshot", "The same mechanism in vLLM and SGLang"], _BUILD
    ),
}


def normalize(term: str) -> str:
    """Case, hyphens, spaces and a plural 's' do not make a different term."""
    t = term.lower().replace("‑", "-").replace("’", "'")
    t = re.sub(r"[\s_\-]+", " ", t).strip()
    return t[:-1] if t.endswith("s") and len(t) > 3 else t


def glossary_body(text: str) -> str:
    """The bodies of the glossary's directives (one per letter), joined."""
    blocks = [part.split("\n```", 1)[0] for part in text.split("```{glossary}")[1:]]
    assert blocks, "the glossary has no glossary directive"
    return "\n".join(blocks)


def glossary_terms(text: str) -> set[str]:
    """Every term line (an entry's name or alias) of the glossary directives' bodies."""
    body = glossary_body(text)
    return {normalize(line) for line in body.splitlines() if line.strip() and not line[0].isspace()}


def seed_entries() -> list[tuple[str, str, list[str]]]:
    return [
        (glossary["name"], group, names)
        for glossary in SEED_TERMS["glossaries"]
        for group, entries in glossary["groups"].items()
        for names in entries
    ]


def missing_terms() -> list[str]:
    have = glossary_terms((BOOK / "glossary.md").read_text())
    missing = []
    for name, group, names in seed_entries():
        if names[0] in OMITTED:
            continue
        if not any(normalize(n) in have for n in names):
            missing.append(f"{names[0]} ({name}, {group})")
    return missing


def test_seed_term_list_is_names_only():
    entries = seed_entries()
    assert len(entries) > 300
    for _, _, names in entries:
        assert names and all(0 < len(n) <= 60 and not n.endswith(".") for n in names), names


def test_every_seed_term_is_in_the_glossary():
    missing = missing_terms()
    assert missing == [], f"{len(missing)} seed terms have no glossary entry: {missing}"


def test_omissions_are_seed_terms_with_reasons():
    firsts = {names[0] for _, _, names in seed_entries()}
    assert set(OMITTED) <= firsts, set(OMITTED) - firsts
    assert all(reason.strip() for reason in OMITTED.values())


def test_no_omitted_term_has_an_entry_after_all():
    have = glossary_terms((BOOK / "glossary.md").read_text())
    covered = sorted(
        {
            names[0]
            for _, _, names in seed_entries()
            if names[0] in OMITTED and any(normalize(n) in have for n in names)
        }
    )
    assert covered == [], f"in the glossary now, so take them off OMITTED: {covered}"


def glossary_entries(text: str) -> list[list[str]]:
    """Every entry of the glossary as its names (the first, then its aliases), as written."""
    entries: list[list[str]] = []
    fresh = True
    for line in glossary_body(text).splitlines():
        if not line.strip():
            fresh = True
        elif not line[0].isspace():
            if fresh:
                entries.append([])
            entries[-1].append(line.strip())
            fresh = False
    return entries


def flatten(text: str) -> str:
    """Lower case, with runs of spaces, hyphens and underscores (line breaks too) as one space."""
    return re.sub(r"[\s_\-‑]+", " ", text.lower())


def unmentioned_seed_terms() -> list[str]:
    """Seed terms in the glossary whose names (or their entry's) no chapter page uses."""
    pages = " ".join(flatten(p.read_text()) for p in chapter_page_files())
    by_name = {
        normalize(name): entry
        for entry in glossary_entries((BOOK / "glossary.md").read_text())
        for name in entry
    }
    missing = []
    for _, _, names in seed_entries():
        if names[0] in OMITTED:
            continue
        candidates = set(names)
        for name in names:
            candidates.update(by_name.get(normalize(name), []))
        patterns = [
            r"(?<![\w])" + re.escape(flatten(n).strip()) + r"s?(?![\w])" for n in candidates
        ]
        if not any(re.search(pattern, pages) for pattern in patterns):
            missing.append(names[0])
    return missing


def chapter_page_files() -> list[pathlib.Path]:
    """Every page of the numbered chapters (not the preface, glossary or guides)."""
    return [p for p in sorted(BOOK.glob("*.md")) if re.match(r"(0[1-9]|1\d)_", p.name)]


def test_every_seed_term_is_used_on_a_chapter_page():
    """A glossary entry is a term some chapter uses, so every seed term the book covers is
    named (by one of its names) on a chapter page, not only in the glossary."""
    missing = unmentioned_seed_terms()
    assert missing == [], f"seed terms no chapter page names: {missing}"


def test_new_serving_terms_are_checked():
    """The benchmarking and load-balancing seed terms are among those the two tests above
    cover (none of them is omitted)."""
    firsts = {names[0] for _, _, names in seed_entries()}
    for term in ("AFD", "DPLB", "QPM", "TP90", "Ramp-up test", "Concurrency sweep", "TBO"):
        assert term in firsts and term not in OMITTED, term


# --- cross-references -------------------------------------------------------------------

PAGES = sorted(BOOK.glob("*.md"))
_LABEL = re.compile(r"^\(([\w\-]+)\)=\s*$", re.MULTILINE)
# a figure's name: `:name:` of a directive, or `name:` under a code cell's `figure:` option
_FIGURE = re.compile(r"^\s*:?name:\s*([\w\-]+)\s*$", re.MULTILINE)
_ROLE = re.compile(r"\{(ref|numref|doc|term)\}`([^`]+)`")
_CHAPTER = re.compile(r"\b[Cc]hapters? (\d+)\b")


def role_target(text: str) -> str:
    """`text <target>` or `target`: the target."""
    match = re.search(r"<([^>]+)>\s*$", text)
    return " ".join((match.group(1) if match else text).split())


def labels() -> set[str]:
    found = set()
    for page in PAGES:
        found |= set(_LABEL.findall(page.read_text())) | set(_FIGURE.findall(page.read_text()))
    for notebook in sorted((ROOT / "exercises").glob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                found |= set(_LABEL.findall("".join(cell["source"])))
    return found


def roles(kind: str) -> list[tuple[str, str]]:
    return [
        (page.name, role_target(text))
        for page in PAGES
        for found_kind, text in _ROLE.findall(page.read_text())
        if found_kind == kind or (kind == "ref" and found_kind == "numref")
    ]


def test_there_are_references_to_check():
    assert len(roles("ref")) > 100 and len(roles("doc")) > 5 and len(roles("term")) > 100
    assert sum(len(_CHAPTER.findall(page.read_text())) for page in PAGES) > 50


def test_every_ref_names_a_label_that_exists():
    known = labels()
    missing = sorted({(page, label) for page, label in roles("ref") if label not in known})
    assert missing == [], f"{{ref}} to labels no page defines: {missing}"


def test_every_doc_link_names_a_page_that_exists():
    missing = []
    for page, target in roles("doc"):
        base = ROOT if target.startswith("/") else BOOK
        path = base / target.lstrip("/")
        if not any(path.with_suffix(s).exists() for s in (".md", ".ipynb")):
            missing.append((page, target))
    assert missing == [], f"{{doc}} links to pages that do not exist: {missing}"


def test_every_term_role_names_a_glossary_entry():
    body = glossary_body((BOOK / "glossary.md").read_text())
    entries = {line.strip().lower() for line in body.splitlines() if line[:1].strip()}
    missing = sorted({(p, t) for p, t in roles("term") if t.lower() not in entries})
    assert missing == [], f"{{term}} roles with no glossary entry: {missing}"


def chapter_pages() -> list[str]:
    """The numbered chapters of the table of contents, in order (book/01_..., ...): each
    chapter's first page; a long chapter's later pages are its sections."""
    pages = [p for p in toc_files() if re.fullmatch(r"book/\d\d_\w+", p) and p[5:7] != "00"]
    return [p for i, p in enumerate(pages) if p[5:7] not in {q[5:7] for q in pages[:i]}]


def test_every_chapter_number_in_the_prose_is_a_chapter_of_the_book():
    numbers = {int(p[5:7]) for p in chapter_pages()}
    assert numbers == set(range(1, len(numbers) + 1)), "chapters are numbered 1, 2, ... in order"
    wrong = []
    for page in PAGES:
        prose = re.sub(r"^```\{code-cell\}.*?^```", "", page.read_text(), flags=re.S | re.M)
        wrong += [(page.name, int(n)) for n in _CHAPTER.findall(prose) if int(n) not in numbers]
    assert wrong == [], f"references to chapters the book does not have: {wrong}"


def test_every_chapter_label_is_defined_once():
    counts: dict[str, int] = {}
    for page in PAGES:
        for label in _LABEL.findall(page.read_text()):
            counts[label] = counts.get(label, 0) + 1
    assert [label for label, n in counts.items() if n > 1] == []


# --- the preface's part table ------------------------------------------------------------

_STOP = {"a", "an", "and", "the", "in", "of"}


def part_table() -> list[str]:
    text = (BOOK / "00_preface.md").read_text()
    table = text.split("| part | what it covers |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.strip().splitlines()[1:] if line.startswith("|")]
    return [row.split("|")[1].strip() for row in rows]


def words(title: str) -> set[str]:
    return set(re.findall(r"[a-z']+", title.lower())) - _STOP


def test_the_preface_lists_the_parts_of_the_table_of_contents_in_order():
    titles = []
    for page in chapter_pages():
        match = re.search(r"^# (.+)$", (ROOT / f"{page}.md").read_text(), flags=re.M)
        titles.append(match.group(1))
    parts = part_table()
    assert len(parts) == len(titles), (parts, titles)
    for part, title in zip(parts, titles, strict=True):
        assert words(part) <= words(title), f"preface part {part!r} is not chapter {title!r}"


def test_the_glossary_is_grouped_by_first_letter_in_order():
    text = (BOOK / "glossary.md").read_text()
    sections = re.findall(r"^## (\S+)\n\n```\{glossary\}\n(.*?)\n```", text, re.M | re.S)
    letters = [letter for letter, _ in sections]
    assert letters == sorted(letters) and len(letters) >= 20
    for letter, body in sections:
        # an entry's first name decides its letter (an alias under it may start otherwise)
        names = [entry.splitlines()[0] for entry in re.split(r"\n\n(?=\S)", body.strip())]
        assert names and all(n[0].upper() == letter for n in names), (letter, names[:3])
    # the jump bar links every letter's section
    bar = next(line for line in text.splitlines() if line.startswith("**Jump to:**"))
    assert re.findall(r"\[(\w)\]\(#glossary-\w\)", bar) == letters


def test_chapter_10_marks_every_term_the_glossary_sends_to_it():
    """An entry whose link points into chapter 10 is marked with {term} in some chapter, so
    the glossary's promise (a chapter marks a term where it explains it) holds there."""
    body = glossary_body((BOOK / "glossary.md").read_text())
    entries: list[tuple[list[str], str]] = []
    for line in body.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            if not entries or entries[-1][1]:
                entries.append(([], ""))
            entries[-1][0].append(line.strip().lower())
        else:
            entries[-1] = (entries[-1][0], entries[-1][1] + line)
    chapter_10 = set()
    for page in BOOK.glob("10_*.md"):
        chapter_10 |= set(_LABEL.findall(page.read_text()))
    marked = {target.lower() for _, target in roles("term")}
    unmarked = [
        names[0]
        for names, definition in entries
        if {role_target(t) for k, t in _ROLE.findall(definition) if k == "ref"} & chapter_10
        and not set(names) & marked
    ]
    assert len(entries) > 200
    assert unmarked == [], f"glossary entries taught in chapter 10 but never marked: {unmarked}"
