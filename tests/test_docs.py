"""The documentation holds together: every relative link and image of README.md, CHANGELOG.md and docs/ resolves
(file and heading anchor), no page uses the project's internal vocabulary, and numbers that change with every commit
(test counts, suite times) appear only on the dated results pages (docs/results/)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")])
RESULTS = DOCS / "results"

FENCE = re.compile(r"^(\s*)(```|~~~)")
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"""<(?:img|a)\b[^>]*\b(?:src|href)=["']([^"']+)["']""")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT_ANCHOR = re.compile(r"\{\s*#([\w-]+)\s*\}\s*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")

# Words of the project's own history that mean nothing to a reader of the docs.
INTERNAL_VOCABULARY = [
    (re.compile(r"\bthe floor\b", re.I), "'the floor' (say what the target is)"),
    (re.compile(r"\bthe main job\b", re.I), "'the main job' (say 'the default run')"),
    (re.compile(r"\bthis session\b", re.I), "'this session'"),
    (re.compile(r"\bissue #\d+", re.I), "a project issue number"),
    (re.compile(r"\bDESIGN\.md\b"), "DESIGN.md (link docs/design/math.md)"),
]
# Numbers that move with every commit: they belong on dated results pages only.
VOLATILE = [
    (re.compile(r"\b\d[\d,]* (?:passed|failed|skipped)\b"), "a test count"),
    (re.compile(r"\b\d[\d,]* tests?\b(?! file)"), "a test count"),
    (re.compile(r"\bmake test\b[^\n]*\b\d+ ?min", re.I), "a suite time"),
    (re.compile(r"\b\d[\d,]* lines\b"), "a line count"),
]


def prose_lines(path: Path, *, keep_code_spans: bool = False):
    """(line number, text) of the lines outside fenced code blocks, with inline code spans blanked unless kept
    (headings may hold them)."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(line)
        if match:
            marker = match.group(2)
            fence = marker if fence is None else (None if fence == marker else fence)
            continue
        if fence is None:
            yield number, line if keep_code_spans else re.sub(r"`+[^`]*`+", lambda m: " " * len(m.group(0)), line)


def slug(text: str) -> str:
    """The heading id that both a code host and mkdocs' toc give: lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = unicodedata.normalize("NFKD", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r"[ ]+", "-", text.strip())


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(path, keep_code_spans=True):
        for name in HTML_ANCHOR.findall(line):
            found.add(name)
        heading = HEADING.match(line)
        if not heading:
            continue
        explicit = EXPLICIT_ANCHOR.search(heading.group(2))
        if explicit:
            found.add(explicit.group(1))
            continue
        base = slug(heading.group(2))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
        found.add(base)
    return found


def links(path: Path):
    for number, line in prose_lines(path):
        for match in LINK.finditer(line):
            yield number, match.group(1) == "!", match.group(3)
        for target in HTML_SRC.findall(line):
            yield number, True, target


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_documentation_exists():
    assert (ROOT / "README.md").is_file() and (ROOT / "CHANGELOG.md").is_file()
    assert len(list(DOCS.rglob("*.md"))) >= 30, "docs/ should hold the guides, methods, concepts and results pages"


def test_the_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; at most 200 (move detail into docs/)"


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_every_relative_link_and_image_resolves(page):
    broken = []
    for number, is_image, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # an absolute URL (https:, mailto:)
        file_part, _, anchor = unquote(target).partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        where = f"{relative(page)}:{number}: {target}"
        if not destination.exists():
            broken.append(f"{where} (no such file)")
            continue
        if page.is_relative_to(DOCS) and not destination.is_relative_to(DOCS):
            broken.append(f"{where} (a docs page links outside docs/: the site would not have it; name the file in "
                          "backticks instead)")
            continue
        if is_image and destination.suffix.lower() not in {".png", ".jpg", ".jpeg", ".svg", ".gif", ".webp"}:
            broken.append(f"{where} (an image that is not a picture)")
        if anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{where} (no heading with the anchor #{anchor} in {relative(destination)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_no_page_uses_the_projects_internal_vocabulary(page):
    found = [f"{relative(page)}:{number}: {what}" for number, line in prose_lines(page)
             for pattern, what in INTERNAL_VOCABULARY if pattern.search(line)]
    assert not found, "internal vocabulary:\n" + "\n".join(found)


@pytest.mark.parametrize("page", [p for p in PAGES if not p.is_relative_to(RESULTS)], ids=relative)
def test_numbers_that_change_with_every_commit_live_on_the_results_pages(page):
    found = [f"{relative(page)}:{number}: {what}: {line.strip()[:100]}" for number, line in prose_lines(page)
             for pattern, what in VOLATILE if pattern.search(line)]
    assert not found, "volatile numbers outside docs/results/:\n" + "\n".join(found)


def test_the_link_checker_catches_a_broken_link_and_anchor(tmp_path, monkeypatch):
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code` heading\n\n[ok](#some-code-heading) [ok](b.md#title)\n"
                                   "[bad](b.md#nowhere) [bad](missing.md) ![pic](a.md)\n```\n[in code](missing.md)\n```\n")
    (tmp_path / "b.md").write_text("# Title\n")
    page = tmp_path / "a.md"
    found = list(links(page))
    assert [t for _, _, t in found] == ["#some-code-heading", "b.md#title", "b.md#nowhere", "missing.md", "a.md"]
    assert "some-code-heading" in anchors(page)
    assert "nowhere" not in anchors(tmp_path / "b.md")


PAPER_AND_CODE = re.compile(r"^\*\*Paper\*\*: (?P<paper>.+?) · \*\*Code\*\*: (?P<code>.+)$")
ARXIV = re.compile(r"\[arXiv:(\d{4}\.\d{4,5})\]\(https://arxiv\.org/abs/\1\)")
GITHUB = re.compile(r"\[([\w.-]+/[\w.-]+)\]\(https://github\.com/\1\)")


@pytest.mark.parametrize("page", sorted(set((DOCS / "methods").glob("*.md")) - {DOCS / "methods/index.md"}),
                         ids=relative)
def test_every_method_page_links_its_paper_and_its_code_first(page):
    # The line under the title: the arXiv page and the reference repository, each either linked (the link's text is
    # its target) or said not to exist ("none: ...", "no ...").
    line = page.read_text(encoding="utf-8").splitlines()[2]
    match = PAPER_AND_CODE.match(line)
    assert match, f"{relative(page)}: line 3 is not '**Paper**: ... · **Code**: ...': {line[:80]}"
    assert ARXIV.search(match["paper"]) or match["paper"].startswith("none"), match["paper"]
    assert GITHUB.search(match["code"]) or match["code"].startswith(("none", "no ", "this repository")), match["code"]
