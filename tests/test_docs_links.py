"""Every relative link of the README and of docs/ resolves: the file exists, and a `#anchor` names a
heading of that file as GitHub renders it (the README's guide links into docs/reference.md,
docs/benchmarks.md and docs/results.md by section, and those pages link back)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)\)")  # [text](target), not images
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: links reduced to their text, code and emphasis marks dropped,
    lower case, every character but letters, digits, `_`, `-` and spaces dropped, spaces -> `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks); a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    """The link targets in a page's text (not in code blocks or code spans)."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    return LINK.findall(text)


def test_the_slug_follows_github():
    assert github_slug("The orchestrator's status API") == "the-orchestrators-status-api"
    assert (
        github_slug("OpenAI-compatible API gateway: `petals-chain api`")
        == "openai-compatible-api-gateway-petals-chain-api"
    )
    heading = "No server lost to a missed DHT read (2026-11-24, late night): proposed / PETALS policy = 0.51"
    slug = "no-server-lost-to-a-missed-dht-read-2026-11-24-late-night-proposed--petals-policy--051"
    assert github_slug(heading) == slug
    assert github_slug("Speculative decoding (`bench_speculative.py`)") == "speculative-decoding-bench_speculativepy"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file of this repository
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_reaches_every_page_of_docs():
    """A page of docs/ that the README does not link is a page no reader finds (docs/ pages that only
    another page links count: reference, benchmarks and results link on)."""
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in links(page):
            path_part = target.partition("#")[0]
            if path_part and not re.match(r"^[a-z][a-z0-9+.-]*:", path_part):
                dest = (page.parent / path_part).resolve()
                if dest.suffix == ".md" and dest.exists():
                    todo.append(dest)
    missing = [p.relative_to(REPO).as_posix() for p in PAGES if p not in reached]
    assert not missing, f"docs pages no link from the README leads to: {missing}"
