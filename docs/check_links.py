"""Check every internal link of the built site.

Each relative ``href`` and ``src`` must name a file of the build, and each ``#anchor`` an ``id`` on its page. Run
after the build, as CI does: ``python docs/check_links.py docs/_build/html``. It prints each broken link with the
page it is on and exits with 1 if there is one. External links (``https://``, ``mailto:``) are not followed: the
site's own pages, the API reference's cross-references and the notebooks' pages are what it checks.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class PageLinks(HTMLParser):
    """The ``id`` attributes of one HTML page, and the targets of its ``href`` and ``src`` attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.targets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Collect the tag's id (and a legacy ``<a name>``) and its link target."""
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif name in ("href", "src"):
                self.targets.append(value)


def read_page(page: Path) -> PageLinks:
    """The ids and link targets of ``page``."""
    links = PageLinks()
    links.feed(page.read_text(encoding="utf-8"))
    return links


def broken_links(site: Path) -> list[str]:
    """Every internal link of the HTML site under ``site`` whose file or anchor does not exist, as ``page: target``."""
    pages = {page.resolve(): read_page(page) for page in sorted(site.rglob("*.html"))}
    broken = []
    for page, links in pages.items():
        for target in links.targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or target.startswith("mailto:") or target.startswith("data:"):
                continue
            linked = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if linked.is_dir():
                linked = linked / "index.html"
            anchor = unquote(parts.fragment)
            if not linked.is_file():
                broken.append(f"{page.relative_to(site.resolve())}: {target} (no such file)")
            elif anchor and linked in pages and anchor not in pages[linked].ids:
                broken.append(f"{page.relative_to(site.resolve())}: {target} (no such anchor)")
    return broken


def main(arguments: list[str]) -> int:
    """Check the site built under ``arguments[0]``; print each broken link and return 1 if any."""
    if len(arguments) != 1 or not Path(arguments[0]).is_dir():
        print("usage: python docs/check_links.py BUILT_HTML_DIRECTORY", file=sys.stderr)
        return 2
    site = Path(arguments[0])
    pages = len(list(site.rglob("*.html")))
    broken = broken_links(site)
    for link in broken:
        print(f"broken link: {link}")
    print(f"{pages} pages checked, {len(broken)} broken internal links")
    return 1 if broken or pages == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
