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
