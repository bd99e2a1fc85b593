"""Open the report in a real headless Chromium (Debian's package): it must paint a
page, log no console error, and fail to load nothing (it loads nothing at all)."""

import re
import subprocess

import pytest
from PIL import Image

from conftest import require_tool
from report_fixture import build_report

pytestmark = pytest.mark.browser

# The flags this machine's Chromium needs as root and offline. Even with the background
# networking ones it asks Google's hosts for updates at start; the resolver rule makes
# every such lookup fail here, so nothing leaves the machine.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
]
# Chromium's own service requests, which the net log shows beside the page's.
BROWSER_OWN = re.compile(r"^https?://[^/]*(google\.com|googleapis\.com|gvt1\.com)/")


def test_report_renders_in_chromium(tmp_path):
    chromium = require_tool("chromium")
    build_report(tmp_path)
    shot = tmp_path / "report.png"
    proc = subprocess.run(
        [
            chromium,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1280,4000",
            f"--screenshot={shot}",
            f"--log-net-log={tmp_path / 'net.json'}",
            (tmp_path / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), proc.stderr[-3000:]

    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
    errors = [line for line in console if re.search(r"error|failed|uncaught", line, re.I)]
    assert not errors, errors
    # Every URL the browser requested, from its own network log: the page's must be none.
    urls = set(re.findall(r'"url":"([^"]+)"', (tmp_path / "net.json").read_text()))
    page_requests = {u for u in urls if not BROWSER_OWN.match(u)}
    assert not page_requests, f"the report loaded {page_requests}"

    # Not blank: a real page has text, tables and plots, so many pixels are not white
    # and there is a spread of colours.
    img = Image.open(shot).convert("L")
    hist = img.histogram()
    non_white = 1 - hist[255] / sum(hist)
    assert img.size == (1280, 4000)
    assert non_white > 0.05, f"page looks blank ({non_white:.1%} non-white)"
    assert sum(1 for h in hist if h) > 50, "too few grey levels for text and plots"


# Measured in the page by the browser itself: each table's width against the column it
# sits in, each plot's shown size against its own.
MEASURE = """<script>
window.addEventListener('load', () => {
  const out = {page: document.documentElement.scrollWidth, tables: [], plots: []};
  document.querySelectorAll('table').forEach(t => {
    const box = t.parentElement.classList.contains('wide') ? t.parentElement : t;
    out.tables.push({width: t.scrollWidth, room: box.clientWidth,
                     head: t.querySelector('th') ? t.querySelector('th').textContent : ''});
  });
  document.querySelectorAll('img').forEach(im => {
    const shown = im.getBoundingClientRect().width;
    out.plots.push({alt: im.alt, shown: shown, natural: im.naturalWidth});
  });
  const pre = document.createElement('pre');
  pre.id = 'measured'; pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
});
</script></body>"""


def test_the_report_reads_on_a_laptop_screen_without_scrolling_sideways(tmp_path):
    """At 1366 pixels wide, the commonest laptop screen: no table runs off its column
    (the summary's ran 265 px over), and no plot is a thumbnail (memory and MFU were
    shown at 553 px, a tenth of their width, side by side)."""
    import html
    import json

    chromium = require_tool("chromium")
    page = build_report(tmp_path, advice=True)
    assert 'id="what-to-run"' in page and 'id="advise-torchtitan"' in page
    page = page.replace("</body>", MEASURE)
    (tmp_path / "measured.html").write_text(page)
    proc = subprocess.run(
        [
            chromium,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1366,768",
            "--virtual-time-budget=5000",
            "--dump-dom",
            (tmp_path / "measured.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'<pre id="measured">(.*?)</pre>', proc.stdout, re.S)
    assert found, proc.stderr[-3000:]
    got = json.loads(html.unescape(found.group(1)))
    assert got["page"] <= 1366
    assert got["tables"] and got["plots"]
    wide = [t for t in got["tables"] if t["width"] > t["room"] + 1]
    assert not wide, wide
    # a thumbnail: shrunk to under half its drawn width (its text with it), or narrow
    small = [p for p in got["plots"] if p["shown"] < max(500, p["natural"] / 2)]
    assert not small, small
