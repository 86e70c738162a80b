"""Copy benchmark figures from the results files into the docs (checked by tests/test_docs.py).

A docs page marks where a results section goes::

    <!-- figures: benchmarks/results/stores.md#Redis -->
    ...replaced by the body of the section "## Redis" of that file...
    <!-- /figures -->

so the figures in the docs are always the ones the benchmark wrote, never copied by hand.

    python scripts/gen_figures.py          # rewrite the docs
    python scripts/gen_figures.py --check  # exit 1 if a page is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "docs" / "guides" / page
    for page in ("performance.md", "inbox.md", "outbox.md", "consumers.md")
]
BLOCK = re.compile(
    r"(<!-- figures: (?P<source>[^#\s]+)#(?P<section>[^>]+?) -->\n)"
    r"(?P<body>.*?)(<!-- /figures -->)",
    re.S,
)


def section(source: str, title: str) -> str:
    """The body of the section *title* (any heading level) of the results file *source*."""
    lines = (ROOT / source).read_text().splitlines()
    for index, line in enumerate(lines):
        match = re.match(r"(#+) (.*)", line)
        if match and match.group(2).strip() == title:
            level = len(match.group(1))
            body: list[str] = []
            for following in lines[index + 1 :]:
                heading = re.match(r"(#+) ", following)
                if heading and len(heading.group(1)) <= level:
                    break
                body.append(following)
            return "\n".join(body).strip() + "\n"
    raise SystemExit(f"{source} has no section {title!r}")


def render(text: str) -> str:
    """*text* with every figures block filled from its results file."""
    return BLOCK.sub(
        lambda m: m.group(1) + section(m["source"], m["section"].strip()) + m.group(5), text
    )


def main(argv: list[str]) -> int:
    stale = []
    for page in PAGES:
        text = page.read_text()
        rendered = render(text)
        if rendered != text:
            stale.append(page)
            if "--check" not in argv:
                page.write_text(rendered)
    if stale and "--check" in argv:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"out of date: {names} (run python scripts/gen_figures.py)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
