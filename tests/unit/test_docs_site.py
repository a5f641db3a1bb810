"""The docs site builds with `mkdocs build --strict`: a broken link, a page missing from the nav,
a config key the reference cannot show or an API name mkdocstrings cannot find fails here.

And the site built as the README says works opened from disk, as a newcomer opens it: every
link followed over file:// lands on a page (not on a folder, which a browser lists as "Index
of ..."), search has its index inlined for file://, nothing is fetched from the network, long
commands wrap, and the home page names what paratrain trains."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse
from urllib.request import url2pathname, urlopen

import pytest

from tests.conftest import REPO

pytest.importorskip("mkdocs", reason="pip install -e '.[docs]' (scripts/test.sh does)")
pytest.importorskip("mkdocstrings")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-5000:]
    return out


@pytest.mark.timeout(300)
def test_mkdocs_build_strict(site):
    reference = (site / "reference" / "config.html").read_text()
    assert "trainer.tensor_parallel" in reference and "Record field names" in reference
    assert "paratrain config show" in (site / "reference" / "cli.html").read_text()


class _Page(HTMLParser):
    """A page's links (`a href`, the nav's among them), scripts, stylesheets, ids, h2 titles."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.nav_links: list[str] = []
        self.assets: list[str] = []
        self.ids: set[str] = set()
        self.h2 = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
            if "md-nav__link" in (a.get("class") or ""):
                self.nav_links.append(a["href"])
        elif tag == "script" and a.get("src") or tag == "link" and a.get("rel") == "stylesheet":
            self.assets.append(a.get("src") or a["href"])
        elif tag == "h2":
            self.h2 += 1


def _read(url: str) -> _Page:
    page = _Page()
    with urlopen(url) as f:  # file://: what a browser opening the site from disk reads
        page.feed(f.read().decode())
    return page


@pytest.mark.timeout(300)
def test_the_site_works_from_disk(site):
    start = (site / "index.html").as_uri()
    seen, todo, pages = set(), [start], {}
    while todo:  # every page the nav reaches, and every link on those pages
        url = todo.pop()
        if url in seen:
            continue
        seen.add(url)
        path = Path(url2pathname(urlparse(url).path))
        assert path.is_file(), f"{url}: not a page (a folder opens as a listing from disk)"
        pages[url] = page = _read(url)
        for asset in page.assets:
            assert not urlparse(asset).scheme, f"{url} fetches {asset} from the network"
            assert Path(url2pathname(urlparse(urljoin(url, asset)).path)).is_file(), asset
        for href in page.links:
            target, _ = urldefrag(urljoin(url, href))
            if urlparse(target).scheme == "file" and target.startswith(site.as_uri()):
                todo.append(target)
    nav = {urldefrag(urljoin(start, h))[0] for h in pages[start].nav_links}
    assert len(nav) >= 29 and nav <= seen, sorted(nav - seen)  # (29 pages in the nav)
    for url, page in pages.items():  # the anchors links name are on their pages
        for href in page.links:
            target, anchor = urldefrag(urljoin(url, href))
            if anchor and target in pages:
                assert anchor in pages[target].ids, f"{url} -> {href}: no #{anchor} there"

    index = (site / "search" / "search_index.js").read_text()
    assert index.startswith("var __index = ") and "online-rl" in index  # search from disk
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"pre > code \{ white-space: pre-wrap;", css)  # long commands wrap
    home = (site / "index.html").read_text()
    for words in ("online RL", "GRPO", "embedding", "SetFit", "KTO"):
        assert words in home, words
    assert pages[(site / "guides" / "online-rl.html").as_uri()].h2 >= 4  # subheadings


@pytest.mark.slow  # a browser's start-up: the link walk covers the quick subset
@pytest.mark.timeout(300)
def test_search_answers_from_disk_in_a_real_browser(site):
    """Headless Chromium opens the home page from disk with a query (material reads ?q=): the
    search runs in its worker (the vendored iframe-worker shim) over the inlined index."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium here (apt-get install chromium); the link walk still runs")
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                        "--virtual-time-budget=15000", "--dump-dom",
                        (site / "index.html").as_uri() + "?q=reward"],
                       capture_output=True, text=True, timeout=240)
    assert re.search(r"\d+ matching documents", r.stdout), r.stdout[-2000:]
