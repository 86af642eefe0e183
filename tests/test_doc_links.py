"""Every relative link of the docs resolves: the file exists and, for a `#anchor`, one of its headings has
that anchor (GitHub's slugs). Docs move sections between pages; a link left behind fails here, not in a
reader's browser."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*)$")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but `-` and `_`), spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = HEADING.match(line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for url in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z]+:", url):
            continue  # http:, https:, mailto:
        target_part, _, anchor = url.partition("#")
        target = (path.parent / target_part).resolve() if target_part else path
        where = f"{path.relative_to(ROOT)}: {url}"
        if not target.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{where} (no such heading)")
    return broken


def test_slug_follows_github() -> None:
    assert slug("`pdserve bench cpu`: the C++ CPU kernels") == "pdserve-bench-cpu-the-c-cpu-kernels"
    assert slug("meta_info fields") == "meta_info-fields"
    assert slug("`pdserve bench goodput --shift-to`: elastic") == "pdserve-bench-goodput---shift-to-elastic"


def test_every_doc_link_resolves() -> None:
    broken = [b for doc in _docs() for b in broken_links(doc)]
    assert not broken, "broken doc links:\n" + "\n".join(broken)
