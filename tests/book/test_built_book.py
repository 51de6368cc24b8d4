"""Static checks of the built HTML: entry page, glossary link, launch links that run."""

import json
import re
from html.parser import HTMLParser

import yaml

from .conftest import ROOT, toc_files

COLAB = re.compile(r"https://colab\.research\.google\.com/github/([^/]+)/([^/]+)/blob/([^/]+)/(.+)")


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "href" and value:
                self.hrefs.append(value)


def hrefs(path) -> list[str]:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser.hrefs


def test_every_page_is_built(html_dir):
    for page in toc_files():
        assert (html_dir / f"{page}.html").exists(), f"{page} missing from the built book"


def test_index_opens_on_the_preface_and_links_the_glossary(html_dir):
    root = yaml.safe_load((ROOT / "_toc.yml").read_text())["root"]
    index = (html_dir / "index.html").read_text()
    assert f"{root}.html" in index, "index.html must redirect to the preface"
    preface_links = hrefs(html_dir / f"{root}.html")
    assert any(h.split("#")[0].endswith("glossary.html") for h in preface_links)


def test_colab_links_open_notebooks_that_exist(html_dir):
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    url = config["repository"]["url"].rstrip("/")
    owner, repo = url.split("/")[-2:]
    branch = config["repository"]["branch"]
    seen = 0
    for page in toc_files():
        for href in hrefs(html_dir / f"{page}.html"):
            match = COLAB.match(href)
            if not match:
                continue
            seen += 1
            assert match.groups()[:3] == (owner, repo, branch), href
            target = ROOT / match.group(4)
            assert target.suffix == ".ipynb", f"{page}: Colab link to a non-notebook {href}"
            assert target.exists(), f"{page}: Colab link to a missing notebook {href}"
    assert seen >= 2, "expected Colab links on the preface and the exercise pages"


def search_index(html_dir) -> dict:
    """The built book's search index (Sphinx's searchindex.js)."""
    text = (html_dir / "searchindex.js").read_text(encoding="utf-8")
    return json.loads(text[text.index("(") + 1 : text.rindex(")")])


def test_the_search_finds_every_glossary_term_in_a_chapter(html_dir):
    """Each glossary entry's words (stemmed as the search stems them) are in the index of a
    page other than the glossary: a reader who searches for a term reaches a page that uses it."""
    from sphinx.search.en import SearchEnglish

    from .test_glossary_coverage import glossary_body

    index = search_index(html_dir)
    glossary_doc = index["docnames"].index("book/glossary")
    docs_of: dict[str, set[int]] = {}
    for field in ("terms", "titleterms"):
        for word, docs in index[field].items():
            docs_of.setdefault(word, set()).update(docs if isinstance(docs, list) else [docs])
    language = SearchEnglish({})
    body = glossary_body((ROOT / "book" / "glossary.md").read_text())
    missing = []
    for entry in re.split(r"\n\n(?=\S)", body.strip()):
        names = [line for line in entry.splitlines() if line[:1].strip()]
        found = False
        for name in names:
            words = [
                language.stem(w.lower())
                for w in re.findall(r"\w+", name)
                if language.word_filter(w.lower())
            ]
            pages = [docs_of.get(w, set()) - {glossary_doc} for w in words]
            if words and set.intersection(*pages):
                found = True
                break
        if not found:
            missing.append(names[0])
    assert missing == [], f"glossary terms no page but the glossary is found by: {missing}"
