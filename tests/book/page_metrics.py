"""What a reader sees on each built page, measured in headless Chromium.

`measure(html_dir, pages, width)` serves the built book over HTTP from a thread, loads
each page in an iframe `width` CSS pixels wide, and returns per page: the title, the
figures (loaded or not, numbered, captioned, with real alt text), the tables (styled or
not), the CSS pixels of each table hidden
behind its sideways scroll, the code boxes whose lines run past their right edge, the
equations left as raw TeX (the network is blocked, so MathJax must come from the
book itself), the share of the page's height that is visible code, whether the page scrolls
sideways, and the console errors Chromium logged while loading it.

From the command line, on a built book:

    python -m tests.book.page_metrics _build/html book/03_kv_cache [--width 420]
"""

from __future__ import annotations

import functools
import html
import http.server
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    # offline and deterministic: every host but the test's own server fails at once
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--virtual-time-budget=90000",
    "--enable-logging=stderr",
    "--v=0",
    "--dump-dom",
]

HARNESS = """<!doctype html><html><body><pre id="result">pending</pre><script>
// The frame's load event waits for its images; one that failed has no natural width.
// (img.decode() would be a race: virtual time does not wait for the decoder thread.)
function imageLoaded(img) { return img.complete && img.naturalWidth > 0; }
function visible(el) {
  return el.offsetParent !== null && el.getBoundingClientRect().height > 0;
}
function pathLike(alt) {
  return /\\.(png|svg|jpe?g|gif)$/i.test(alt) || /^[./_a-z0-9-]+$/i.test(alt);
}
function visit(url) {
  return new Promise((resolve) => {
    const frame = document.createElement("iframe");
    frame.style.width = "WIDTHpx"; frame.style.height = "900px";
    frame.onload = async () => {
      // MathJax typesets after the load event: wait for it, when the page loaded it at all
      const mathjax = frame.contentWindow.MathJax;
      if (mathjax && mathjax.startup && mathjax.startup.promise) {
        try { await mathjax.startup.promise; } catch (e) { console.error("MathJax: " + e); }
      }
      const doc = frame.contentDocument;
      const article = doc.querySelector("article.bd-article")
        || doc.querySelector("main") || doc.body;
      // the article's own title (the print-only copy above it carries no section number)
      const h1 = article.querySelector("h1") || doc.querySelector("main h1, h1");
      const images = [...article.querySelectorAll("img")];
      const broken = images.filter((img) => !imageLoaded(img)).map((img) => img.src);
      // explorers: moving a slider must show another precomputed image, without a kernel
      const explorers = [...article.querySelectorAll(".minillm-explorer")].map((box) => {
        const img = box.querySelector("img");
        const slider = box.querySelector("[data-slider]");  // a range slider or a menu
        const before = img ? img.dataset.state : null;
        if (slider && slider.tagName === "SELECT") {
          slider.selectedIndex = slider.selectedIndex === 0 ? slider.options.length - 1 : 0;
          slider.dispatchEvent(new Event("change"));
        } else if (slider) {
          slider.value = String(Number(slider.value) === Number(slider.max) ? 0 : slider.max);
          slider.dispatchEvent(new Event("input"));
        }
        return {sliders: box.querySelectorAll("[data-slider]").length,
                works: !!img && img.dataset.state !== before,
                alt: img ? img.getAttribute("alt") || "" : ""};
      });
      const figures = images.filter((img) => !img.closest(".minillm-explorer")).map((img) => {
        const figure = img.closest("figure");
        const number = figure ? figure.querySelector("figcaption .caption-number") : null;
        const caption = figure ? figure.querySelector("figcaption .caption-text") : null;
        const alt = img.getAttribute("alt") || "";
        return {src: img.getAttribute("src"), numbered: !!number,
                number: number ? number.textContent.trim() : "",
                width: img.getBoundingClientRect().width,
                caption: caption ? caption.textContent.trim() : "",
                alt: alt, alt_ok: alt.trim().split(/\\s+/).length >= 4 && !pathLike(alt.trim())};
      });
      const tables = [...article.querySelectorAll("table")].map((t) => {
        const box = t.closest(".pst-scrollable-table-container") || t.closest(".cell_output");
        return {styled: t.classList.contains("table") || t.classList.contains("docutils"),
                scrolls: !!box,
                // CSS pixels of the table a reader must scroll sideways to see
                hidden_px: box ? Math.max(0, t.getBoundingClientRect().width - box.clientWidth)
                               : 0,
                text: t.textContent.trim().slice(0, 60)};
      });
      // code boxes whose longest line runs past the box's right edge
      const clippedCode = [...article.querySelectorAll("div.highlight pre")]
        .filter((pre) => visible(pre) && !pre.closest("details:not([open])")
                && pre.scrollWidth > pre.clientWidth + 1)
        .map((pre) => pre.textContent.split("\\n").reduce((a, b) => (b.length > a.length ? b : a))
                .slice(0, 80));
      // visible code: code blocks a reader sees (not inside a closed <details>)
      let codeHeight = 0;
      for (const block of article.querySelectorAll("div.highlight")) {
        if (block.parentElement.closest("div.highlight")) continue;
        if (block.closest("details:not([open])")) continue;  // folded behind a toggle
        if (visible(block)) codeHeight += block.getBoundingClientRect().height;
      }
      // math: every span/div Sphinx wrote as TeX must hold MathJax's typeset container
      const maths = [...article.querySelectorAll(".math")];
      const rawMath = maths.filter((m) => !m.querySelector("mjx-container"))
        .map((m) => m.textContent.trim().slice(0, 60));
      const articleHeight = article.getBoundingClientRect().height;
      // where the first figure and the first visible code block start (CSS px, page top)
      const top = (el) => el.getBoundingClientRect().top + frame.contentWindow.scrollY;
      const firstFigure = [...article.querySelectorAll("figure img, .minillm-explorer img")]
        .filter(visible).map(top).sort((a, b) => a - b)[0];
      const firstCode = [...article.querySelectorAll("div.highlight")]
        .filter((b) => visible(b) && !b.closest("details:not([open])")).map(top)
        .sort((a, b) => a - b)[0];
      const text = doc.body ? doc.body.innerText : "";
      const pageWidth = doc.documentElement.scrollWidth;
      const eqnos = [...article.querySelectorAll("span.eqno")]
        .map((e) => e.textContent.replace(/[#¶]/g, "").trim());
      resolve({url, title: h1 ? h1.textContent.replace(/[#¶]/g, "").trim() : "",
               equation_numbers: eqnos,
               images: images.length, broken, figures, tables, explorers,
               math: maths.length, raw_math: rawMath, clipped_code: clippedCode,
               glue_calls: [...article.querySelectorAll("div.highlight")]
                 .filter((b) => visible(b) && !b.closest("details:not([open])")
                         && /\\bglue\\(/.test(b.textContent)).length,
               first_figure_y: firstFigure === undefined ? null : firstFigure,
               first_code_y: firstCode === undefined ? null : firstCode,
               code_share: articleHeight ? codeHeight / articleHeight : 0,
               article_height: articleHeight,
               page_width: pageWidth, frame_width: WIDTH,
               errors: doc.querySelectorAll(".traceback, .output.error").length,
               traceback: text.includes("Traceback (most recent call last)")});
      frame.remove();
    };
    frame.src = url;
    document.body.appendChild(frame);
  });
}
(async () => {
  const out = [];
  for (const url of PAGES) {
    console.log("minillm-visit " + url);
    out.push(await visit(url));
  }
  document.getElementById("result").textContent = JSON.stringify(out);
})();
</script></body></html>"""

CONSOLE_LINE = re.compile(r'CONSOLE[:(]\d+\)?\] "(?P<message>.*)", source: (?P<source>\S*)')


def smallest_svg_text_pt(svg_path: pathlib.Path) -> tuple[float, float] | None:
    """(smallest text size, drawn width), both in points, of a matplotlib SVG, or None.

    The book's figures write text as paths (svg.fonttype "path"): each glyph run is a group
    scaled from matplotlib's 100-unit glyphs, `scale(0.09 -0.09)` for 9 pt text."""
    text = svg_path.read_text(encoding="utf-8")
    width = re.search(r'<svg[^>]*\swidth="([\d.]+)pt"', text)
    sizes = [float(s) * 100 for s in re.findall(r"scale\(([\d.]+) -[\d.]+\)", text)]
    if width is None or not sizes:
        return None
    return min(sizes), float(width.group(1))


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def serve(html_dir: pathlib.Path, harness: str):
    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/__check__.html"):
                body = harness.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                super().do_GET()

        def log_message(self, *args):
            pass

    handler = functools.partial(Handler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def console_errors(stderr: str) -> dict[str, list[str]]:
    """Chromium's logged console messages that are errors, by the page being visited.

    Resources a reader loads from the internet (MathJax from its CDN) cannot load in this
    offline browser; their failures are not the book's and are left out.
    """
    errors: dict[str, list[str]] = {}
    page = None
    for line in stderr.splitlines():
        match = CONSOLE_LINE.search(line)
        if not match:
            continue
        message, source = match.group("message"), match.group("source")
        if message.startswith("minillm-visit "):
            page = message.removeprefix("minillm-visit ")
            continue
        if page is None:
            continue
        offline = "ERR_NAME_NOT_RESOLVED" in message or "ERR_CONNECTION" in message
        if offline and not source.startswith("http://127.0.0.1"):
            continue
        error_like = (
            "Uncaught" in message or "Error" in message or "Failed to load resource" in message
        )
        if error_like:
            errors.setdefault(page, []).append(f"{message} ({source})")
    return errors


def measure(html_dir: pathlib.Path, pages: list[str], width: int = 1280) -> list[dict]:
    """Load `pages` (paths without .html) from `html_dir` at `width`; one dict per page."""
    chromium = chromium_path()
    if chromium is None:
        raise RuntimeError(
            "headless Chromium is needed to check the built book: "
            "`sudo apt-get install chromium` (Debian/Ubuntu); make test installs it when it may"
        )
    urls = [f"/{p}.html" for p in pages]
    harness = HARNESS.replace("PAGES", json.dumps(urls)).replace("WIDTH", str(width))
    server = serve(html_dir, harness)
    try:
        with tempfile.TemporaryDirectory() as profile:
            url = f"http://127.0.0.1:{server.server_address[1]}/__check__.html"
            done = subprocess.run(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", url],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
    finally:
        server.shutdown()
    match = re.search(r'<pre id="result">(.*?)</pre>', done.stdout, flags=re.DOTALL)
    if not match or match.group(1) == "pending":
        raise RuntimeError("the harness page did not finish")
    results = json.loads(html.unescape(match.group(1)))
    errors = console_errors(done.stderr)
    for result in results:
        result["console_errors"] = errors.get(result["url"], [])
    return results


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html_dir", type=pathlib.Path)
    parser.add_argument("pages", nargs="+", help="pages without .html, e.g. book/03_kv_cache")
    parser.add_argument("--width", type=int, default=1280)
    args = parser.parse_args(argv)
    for result in measure(args.html_dir.resolve(), args.pages, args.width):
        bad_figures = [f for f in result["figures"] if not (f["numbered"] and f["alt_ok"])]
        bad_tables = [t for t in result["tables"] if not (t["styled"] and t["scrolls"])]
        print(
            f"{result['url']}: code {result['code_share']:.1%} of "
            f"{result['article_height']:.0f} px, page width {result['page_width']} "
            f"in {result['frame_width']}, {len(result['figures'])} figures "
            f"({len(bad_figures)} without number or alt), {len(result['tables'])} tables "
            f"({len(bad_tables)} unstyled or not scrolling), "
            f"explorers {[e['works'] for e in result['explorers']]}, "
            f"console errors {result['console_errors']}"
        )
        for figure in bad_figures:
            print(f"    figure {figure}")
        for entry in bad_tables:
            print(f"    table {entry}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
