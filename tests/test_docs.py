"""The documentation holds together: every relative link in README.md and docs/*.md resolves.

A link `[text](target)` that is not an absolute URL (http, https, mailto) must name a file that
exists, relative to the Markdown file's folder, and its `#anchor`, in the same page or in another
.md file, must be a heading of that file under GitHub's anchor rules: lowercase, punctuation other
than hyphens and spaces dropped, spaces turned into hyphens, and a repeated heading numbered -1,
-2, ... Also: the README stays a front door (at most 200 lines) and links every docs page.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
README_MAX_LINES = 200
DOCS_PAGES = sorted((REPO_ROOT / "docs").glob("*.md"))
MARKDOWN_FILES = [README, *DOCS_PAGES]

ABSOLUTE = re.compile(r"(?:https?|mailto):", re.I)
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target), with an optional title; the text may span lines.
INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def _outside_fences(markdown: str) -> list[str]:
    """The lines of a Markdown text that are not inside a fenced code block."""
    lines: list[str] = []
    fence: str | None = None
    for line in markdown.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and match and match.group(1)[0] == fence[0]:
            if len(match.group(1)) >= len(fence):
                fence = None
        elif fence is None:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before duplicates are numbered)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags are not part of the text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and `_`, as GitHub does
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a Markdown text, duplicates numbered as GitHub numbers them."""
    seen: Counter[str] = Counter()
    result: set[str] = set()
    for line in _outside_fences(markdown):
        match = HEADING.match(line)
        if not match:
            continue
        text = re.sub(r"[ \t]+#+$", "", match.group(2))  # closing hashes are not text
        slug = github_slug(text)
        result.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return result


def link_targets(markdown: str) -> list[str]:
    """Every link target of a Markdown text outside code blocks and code spans."""
    text = CODE_SPAN.sub("", "\n".join(_outside_fences(markdown)))
    return INLINE_LINK.findall(text) + REFERENCE_DEFINITION.findall(text)


def broken_links(path: Path) -> list[str]:
    """The relative links of one Markdown file that do not resolve, each with the reason."""
    problems: list[str] = []
    for target in link_targets(path.read_text()):
        if ABSOLUTE.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not destination.exists():
            problems.append(f"{target}: {file_part} does not exist")
            continue
        in_markdown = destination.suffix == ".md"
        if anchor and in_markdown and unquote(anchor) not in anchors(destination.read_text()):
            problems.append(f"{target}: no heading #{anchor} in {destination.name}")
    return problems


def _name(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=_name)
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == [], f"{_name(path)} has broken links"


def test_readme_is_a_front_door() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    assert DOCS_PAGES, "docs/ has no pages"
    linked = {
        (README.parent / unquote(target.partition("#")[0])).resolve()
        for target in link_targets(README.read_text())
        if not ABSOLUTE.match(target) and target.partition("#")[0]
    }
    assert [_name(page) for page in DOCS_PAGES if page.resolve() not in linked] == []


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        (
            "Running jobs on the cluster (`scripts/cluster.py`)",
            "running-jobs-on-the-cluster-scriptsclusterpy",
        ),
        ("Deploying to AWS (`npx cdk deploy`)", "deploying-to-aws-npx-cdk-deploy"),
        ("What the operator's credentials need", "what-the-operators-credentials-need"),
        ("What a run costs: `scripts/estimate_cost.py`", "what-a-run-costs-scriptsestimate_costpy"),
        ("Throughput: `workload/bench.py`", "throughput-workloadbenchpy"),
        ("See [the README](../README.md) – twice", "see-the-readme--twice"),
    ],
)
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Part\n\n## Part\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Setup (`make`)\n\n"
        "[ok](#setup-make) [ok](other.md#part-1) [ok](other.md) [ok](https://example.com/x#y)\n"
        "[gone](missing.md) [bad anchor](#setup) [bad](other.md#part-2)\n"
        "`[in a code span](nowhere.md)`\n\n"
        "```\n[in a code block](nowhere.md)\n# not a heading\n```\n"
        "[split\nacross lines](#not-a-heading)\n\n[ref]: other.md#nope\n"
    )
    assert broken_links(page) == [
        "missing.md: missing.md does not exist",
        "#setup: no heading #setup in page.md",
        "other.md#part-2: no heading #part-2 in other.md",
        "#not-a-heading: no heading #not-a-heading in page.md",
        "other.md#nope: no heading #nope in other.md",
    ]
