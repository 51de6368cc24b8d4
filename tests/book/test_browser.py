"""Open every built page in headless Chromium, at desktop and at phone width, and check
what a reader sees: the title, figures that load and are numbered with a caption and alt
text, styled tables that show every column on a desktop, code that is never cut at the
right edge, diagram labels readable on a phone, chapter numbers, math typeset offline, no
error output, no console errors, no sideways scrolling on a 420 px phone, and chapters
whose visible code stays under a quarter of the page.

Needs Debian's `chromium` (`make test` installs it when it may; by hand:
`sudo apt-get install chromium`). The harness is `tests/book/page_metrics.py`.
"""

import re

import nbformat
import pytest

from . import page_metrics
from .conftest import source_of, toc_files

PHONE_WIDTH = 420
# the smallest label of a diagram a reader can make out on a phone, in CSS pixels
MIN_PHONE_TEXT_PX = 9
# the share of a chapter page's height that may be visible code (the rest: prose, figures,
# tables, the engine's excerpts included in the code)
MAX_CODE_SHARE = 0.25
# a chapter page's height at 1280 px, in screens of 900 px (page_metrics' viewport)
SCREEN_PX, MAX_PAGE_SCREENS = 900, 25


def expected_title(page: str) -> str:
    """The page's first level-1 heading in its source, as the reader should see it."""
    src = source_of(page)
    if src.suffix == ".ipynb":
        nb = nbformat.read(src, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    else:
        text = src.read_text()
    match = re.search(r"^# (.+)$", text, flags=re.MULTILINE)
    assert match, f"{src} has no level-1 heading"
    return match.group(1).strip()


def chapter_number(page: str) -> int:
    return int(re.fullmatch(r"book/(\d\d)_.+", page).group(1))


def straight_quotes(text: str) -> str:
    """Undo Sphinx's smart quotes, which turn the source's ' and " into typographic ones."""
    return text.translate(
        str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})
    )


def is_chapter(page: str) -> bool:
    return re.fullmatch(r"book/\d\d_.+", page) is not None and not page.startswith("book/00")


@pytest.fixture(scope="module")
def chromium():
    if page_metrics.chromium_path() is None:
        pytest.fail(
            "headless Chromium is needed to check the built book: "
            "`sudo apt-get install chromium` (Debian/Ubuntu); make test installs it when it may"
        )


@pytest.fixture(scope="module")
def desktop(html_dir, chromium):
    pages = toc_files()
    return dict(zip(pages, page_metrics.measure(html_dir, pages, width=1280), strict=True))


@pytest.fixture(scope="module")
def phone(html_dir, chromium):
    pages = toc_files()
    return dict(zip(pages, page_metrics.measure(html_dir, pages, width=PHONE_WIDTH), strict=True))


@pytest.mark.browser
def test_pages_render_in_a_real_browser(desktop):
    assert list(desktop) == toc_files()
    for page, result in desktop.items():
        assert result["url"] == f"/{page}.html"
        title = straight_quotes(result["title"])
        if is_chapter(page):
            pattern = rf"{chapter_number(page)}\.(\d+\.)? " + re.escape(expected_title(page))
            assert re.fullmatch(pattern, title), (page, title)
        else:
            assert title == expected_title(page), result
        assert result["broken"] == [], f"{page}: figures that do not load: {result['broken']}"
        assert result["errors"] == 0 and not result["traceback"], f"{page}: error output"


@pytest.mark.browser
def test_no_console_errors(desktop):
    errors = {page: r["console_errors"] for page, r in desktop.items() if r["console_errors"]}
    assert errors == {}


@pytest.mark.browser
def test_every_figure_is_numbered_with_a_caption_and_alt_text(desktop):
    bad = {
        page: [
            f["src"] for f in r["figures"] if not (f["numbered"] and f["caption"] and f["alt_ok"])
        ]
        for page, r in desktop.items()
    }
    assert {page: srcs for page, srcs in bad.items() if srcs} == {}
    chapters = [page for page in desktop if is_chapter(page)]
    assert all(desktop[page]["figures"] for page in chapters), "a chapter without a figure"


@pytest.mark.browser
def test_every_table_is_styled_and_scrolls_in_its_own_box(desktop):
    bad = {
        page: [t["text"] for t in r["tables"] if not (t["styled"] and t["scrolls"])]
        for page, r in desktop.items()
    }
    assert {page: tables for page, tables in bad.items() if tables} == {}


@pytest.mark.browser
def test_no_page_scrolls_sideways_on_a_phone(phone):
    wide = {page: r["page_width"] for page, r in phone.items() if r["page_width"] > PHONE_WIDTH}
    assert wide == {}


@pytest.mark.browser
def test_chapters_show_ideas_not_plumbing(desktop):
    shares = {page: round(r["code_share"], 3) for page, r in desktop.items() if is_chapter(page)}
    assert {int(page[5:7]) for page in shares} == set(range(1, 12)), "each page of eleven chapters"
    assert {page: s for page, s in shares.items() if s >= MAX_CODE_SHARE} == {}


@pytest.mark.browser
def test_no_chapter_page_is_longer_than_about_25_screens(desktop):
    """A long chapter is split into pages (its sections in the table of contents), so that
    no page of a chapter runs past MAX_PAGE_SCREENS screens of 900 px at desktop width."""
    tall = {
        page: round(r["article_height"] / SCREEN_PX, 1)
        for page, r in desktop.items()
        if is_chapter(page) and r["article_height"] > MAX_PAGE_SCREENS * SCREEN_PX
    }
    assert tall == {}


@pytest.mark.browser
def test_the_explorers_work_without_a_kernel(desktop):
    """Chapters 2 and 3 have explorers a reader of the HTML book can move (on one of their
    pages): a slider shows
    another precomputed figure (minillm.lab.explorer), with alt text."""
    explorers = {page: r["explorers"] for page, r in desktop.items() if r["explorers"]}
    assert {2, 3} <= {int(page[5:7]) for page in explorers if is_chapter(page)}
    for page, found in explorers.items():
        assert all(e["works"] and len(e["alt"].split()) >= 4 for e in found), (page, found)


@pytest.mark.browser
def test_every_equation_renders_offline(desktop):
    """The harness blocks every host but its own, so an equation typesets only when the
    book serves MathJax itself (_ext/minillm_book.py); a CDN script would leave raw TeX."""
    assert sum(r["math"] for r in desktop.values()) > 0, "no equation found in the book"
    raw = {page: r["raw_math"] for page, r in desktop.items() if r["raw_math"]}
    assert raw == {}


@pytest.mark.browser
def test_chapters_figures_and_equations_carry_the_chapter_number(desktop):
    """The sidebar and the titles number the chapters as the text counts them (a page of
    chapter 3 is titled "3. ..." or "3.k. ..."), and a chapter's figures and equations are
    numbered within it (Fig. 3.4, (3.1)), so "chapter 3" in the text finds its page."""
    wrong = {}
    for page, r in desktop.items():
        if not is_chapter(page):
            continue
        n = chapter_number(page)
        figures = [f["number"] for f in r["figures"] if not f["number"].startswith(f"Fig. {n}.")]
        equations = [e for e in r["equation_numbers"] if not e.startswith(f"({n}.")]
        if figures or equations:
            wrong[page] = figures + equations
    assert wrong == {}


@pytest.mark.browser
def test_tables_show_every_column_on_a_desktop(desktop):
    """At 1280 px a table fits the text column: no column hides behind a sideways scroll
    (on a phone the table scrolls in its own box, with a shadow at the edge)."""
    hidden = {
        page: [(t["text"][:40], round(t["hidden_px"])) for t in r["tables"] if t["hidden_px"] > 1]
        for page, r in desktop.items()
    }
    assert {page: tables for page, tables in hidden.items() if tables} == {}


@pytest.mark.browser
def test_no_code_line_is_cut_at_the_right_edge(desktop, phone):
    """Listings wrap at spaces: no line of code runs past its box, on a desktop or a phone."""
    for width in (desktop, phone):
        clipped = {page: r["clipped_code"] for page, r in width.items() if r["clipped_code"]}
        assert clipped == {}


@pytest.mark.browser
def test_diagram_labels_are_readable_on_a_phone(phone, html_dir):
    """At 420 px the smallest text of every SVG figure is at least MIN_PHONE_TEXT_PX CSS
    pixels: its size in points times the scale the page shows the figure at."""
    small = {}
    for page, r in phone.items():
        page_dir = (html_dir / page).parent
        for figure in r["figures"]:
            if not (figure["src"] or "").endswith(".svg"):
                continue
            found = page_metrics.smallest_svg_text_pt(page_dir / figure["src"])
            if found is None:
                continue
            text_pt, width_pt = found
            shown_px = text_pt * figure["width"] / width_pt  # pt * (px shown / pt drawn)
            if shown_px < MIN_PHONE_TEXT_PX:
                small.setdefault(page, []).append((figure["number"], round(shown_px, 1)))
    assert small == {}


@pytest.mark.browser
def test_each_chapter_opens_with_a_picture_before_its_code(desktop):
    """On a chapter's first page the first figure comes before the first visible code: the
    reader sees the mechanism, then the code that does it."""
    first_pages = {}
    for page in desktop:  # in the order of the table of contents
        if is_chapter(page):
            first_pages.setdefault(chapter_number(page), page)
    assert sorted(first_pages) == list(range(1, 12))
    late = {}
    for page in first_pages.values():
        figure_y, code_y = desktop[page]["first_figure_y"], desktop[page]["first_code_y"]
        if code_y is not None and (figure_y is None or figure_y > code_y):
            late[page] = (figure_y, code_y)
    assert late == {}


@pytest.mark.browser
def test_no_glue_call_is_shown(desktop):
    """`glue(...)` only carries a number into the prose: a reader never sees the call."""
    shown = {page: r["glue_calls"] for page, r in desktop.items() if r["glue_calls"]}
    assert shown == {}
