"""The engine releases the chapters cite lie in the range the preface states.

Chapters name the vLLM or SGLang release whose source they were checked against, and the
preface says which releases the book spans; a chapter citing a release outside that span
(written later, or copied from elsewhere) has to move the preface's statement with it.
"""

from __future__ import annotations

import re

from .conftest import ROOT

CITED = {
    "vLLM": re.compile(r"vLLM (?:V1 )?\(?(0\.\d+)"),
    "SGLang": re.compile(r"SGLang \(?(0\.\d+)"),
}
# a release cited as history, not as what the chapter was checked against
HISTORY = {("vLLM", 6)}  # chapter 7: dynamic speculation in vLLM 0.6, the V0 engine
STATED = re.compile(r"as vLLM went from (0\.\d+) to (0\.\d+) and SGLang from (0\.\d+) to (0\.\d+)")


def minor(version: str) -> int:
    return int(version.split(".")[1])


def test_every_cited_release_lies_in_the_span_the_preface_states():
    preface = (ROOT / "book" / "00_preface.md").read_text()
    stated = STATED.search(" ".join(preface.split()))
    assert stated, "the preface states the releases the book spans"
    spans = {
        "vLLM": (minor(stated[1]), minor(stated[2])),
        "SGLang": (minor(stated[3]), minor(stated[4])),
    }
    cited = {engine: set() for engine in CITED}
    # the chapters, not the glossary or the guide
    for page in sorted((ROOT / "book").glob("[01]*.md")):
        text = " ".join(page.read_text().split())
        for engine, pattern in CITED.items():
            for version in pattern.findall(text):
                cited[engine].add((page.name, minor(version)))
    assert cited["vLLM"] and cited["SGLang"]
    for engine, (low, high) in spans.items():
        checked = {(page, v) for page, v in cited[engine] if (engine, v) not in HISTORY}
        outside = sorted((page, v) for page, v in checked if not low <= v <= high)
        assert outside == [], f"{engine} releases outside 0.{low} to 0.{high}: {outside}"
        # the span is the one the chapters cite: its ends are cited
        assert {low, high} <= {v for _, v in checked}, f"{engine}: 0.{low} to 0.{high}"
