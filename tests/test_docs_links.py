"""The README is a newcomer's first five minutes and the docs hold the rest (issue 46): every
relative link in README.md, CONTRIBUTING.md, docs/ and notebooks/*.md resolves to a file or
folder, and a link to a heading (``page.md#anchor``) names a heading that page has, as GitHub
makes its anchors; the README stays under 220 lines, opens with its two commands, and links
every page of docs/."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "notebooks").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text a reader sees as prose: fenced blocks, code spans and comments removed."""
    return CODE.sub("", COMMENT.sub("", FENCE.sub("", text)))


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, markup and punctuation dropped
    (hyphens and underscores kept), spaces to hyphens, a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", text)):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)       # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` that names no file, or a heading its page lacks."""
    bad = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):             # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: {dest.name} has no heading #{anchor}")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    bad = {str(p.relative_to(ROOT)): b for p in PAGES if (b := broken_links(p))}
    assert not bad, f"links that resolve to nothing: {bad}"


def test_the_readme_is_short_and_opens_with_its_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) < 220, f"README.md has {len(lines)} lines: move detail into docs/"
    head = "\n".join(lines[:40])
    for command in ("make lab", "make test"):
        assert re.search(rf"^{command}\b", head, re.M), f"`{command}` is not in README's first 40 lines"


def test_the_readme_links_every_page_of_the_docs():
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for t in LINK.findall(_prose(README.read_text()))}
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "instructor" / "README.md",
             ROOT / "CONTRIBUTING.md"]
    missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked]
    assert not missing, f"README.md links none of {missing}"


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    """A guard on the checker itself: links written wrong are reported, links written right,
    code and comments are not."""
    (tmp_path / "other.md").write_text("# The `check` command: at 2 ranks\n\n## Same\n\n## Same\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-check-command-at-2-ranks) [ok](other.md#same-1) "
                    "[ok](#here) ![ok](other.md) [web](https://example.org/x)\n"
                    "`[code](gone.md)` <!-- [comment](gone.md) -->\n```\n[fenced](gone.md)\n```\n"
                    "# Here\n[no file](gone.md) [no heading](other.md#same-2)\n")
    assert broken_links(page) == [f"gone.md: no {tmp_path / 'gone.md'}",
                                  "other.md#same-2: other.md has no heading #same-2"]
