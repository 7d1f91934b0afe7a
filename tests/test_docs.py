"""The README and docs/ point at each other: every relative link names a file that exists and, with an
anchor, a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page`` (outside code blocks)."""
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{page.name}: {target} (no such heading in {linked.name})")
    return broken


def test_every_link_between_the_readme_and_docs_resolves():
    assert len(PAGES) >= 5, PAGES  # the README and the pages it sends readers to
    broken = [problem for page in PAGES for problem in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_a_link_to_a_missing_heading_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## `hybrid`: combine in place\n\n[ok](#hybrid-combine-in-place) [bad](#combine)\n"
                    "[gone](missing.md)\n")
    assert broken_links(page) == ["page.md: #combine (no such heading in page.md)",
                                  "page.md: missing.md (no such file)"]
