"""Static checks of the built HTML: entry page, glossary link, launch links that run."""

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
