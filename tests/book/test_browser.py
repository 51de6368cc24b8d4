"""Open every built page in headless Chromium: its title shows, its figures load, no error.

Needs Debian's `chromium` (`make test` installs it when it may; by hand:
`sudo apt-get install chromium`).
The pages are served over HTTP from a thread, and one harness page loads each of them in
an iframe and reports what a reader would see, as JSON in its DOM.
"""

import functools
import html
import http.server
import json
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading

import nbformat
import pytest

from .conftest import source_of, toc_files

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    # offline and deterministic: every host but the test's own server fails at once
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--virtual-time-budget=60000",
    "--dump-dom",
]

HARNESS = """<!doctype html><html><body><pre id="result">pending</pre><script>
// The frame's load event waits for its images; one that failed has no natural width.
// (img.decode() would be a race: virtual time does not wait for the decoder thread.)
function imageLoaded(img) { return img.complete && img.naturalWidth > 0; }
function visit(url) {
  return new Promise((resolve) => {
    const frame = document.createElement("iframe");
    frame.style.width = "1280px"; frame.style.height = "900px";
    frame.onload = () => {
      const doc = frame.contentDocument;
      const h1 = doc.querySelector("article h1, main h1, h1");
      const images = [...doc.querySelectorAll("article img, main img")];
      const broken = images.filter((img) => !imageLoaded(img)).map((img) => img.src);
      const text = doc.body ? doc.body.innerText : "";
      resolve({url, title: h1 ? h1.textContent.replace(/[#¶]/g, "").trim() : "",
               images: images.length, broken,
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
  for (const url of PAGES) out.push(await visit(url));
  document.getElementById("result").textContent = JSON.stringify(out);
})();
</script></body></html>"""


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


def straight_quotes(text: str) -> str:
    """Undo Sphinx's smart quotes, which turn the source's ' and " into typographic ones."""
    return text.translate(
        str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})
    )


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


@pytest.mark.browser
def test_pages_render_in_a_real_browser(html_dir):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail(
            "headless Chromium is needed to check the built book: "
            "`sudo apt-get install chromium` (Debian/Ubuntu); make test installs it when it may"
        )
    pages = toc_files()
    harness = HARNESS.replace("PAGES", json.dumps([f"/{p}.html" for p in pages]))
    server = serve(html_dir, harness)
    try:
        with tempfile.TemporaryDirectory() as profile:
            url = f"http://127.0.0.1:{server.server_address[1]}/__check__.html"
            dom = subprocess.run(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", url],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            ).stdout
    finally:
        server.shutdown()
    match = re.search(r'<pre id="result">(.*?)</pre>', dom, flags=re.DOTALL)
    assert match and match.group(1) != "pending", "the harness page did not finish"
    results = json.loads(html.unescape(match.group(1)))
    assert [r["url"] for r in results] == [f"/{p}.html" for p in pages]
    for page, result in zip(pages, results, strict=True):
        assert straight_quotes(result["title"]) == expected_title(page), result
        assert result["broken"] == [], f"{page}: figures that do not load: {result['broken']}"
        assert result["errors"] == 0 and not result["traceback"], f"{page}: error output"
