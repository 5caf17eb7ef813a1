"""The repository never points outside itself.

Every text file git knows about (tracked, or new and not ignored) is scanned for

- references to documents that are not part of the repository: the original design
  brief and its source documents, and the ``shared`` folder beside the checkout (what a
  reader needs from them lives in docs/ARCHITECTURE.md);
- paths ``docs/*.md`` that do not exist;
- ``#anchor`` fragments into docs/*.md (``docs/<name>.md#anchor`` anywhere, and markdown
  links in ``.md`` files) that match no heading, with GitHub's heading slugs.

The needles are assembled from pieces so that this file does not match itself.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Mentions of documents outside the repository (case-insensitive). A source document is
# cited by name (the word, a space, a number 00N); identifiers such as the built-in trace
# ``seed002`` or the test ``test_seed002_...`` keep a historical prefix and are allowed
# (docs/ARCHITECTURE.md, "Worked examples").
FORBIDDEN = {
    "the design brief": re.compile(re.escape("DESIGN" + ".md"), re.IGNORECASE),
    "a source document": re.compile("seed" + r" 00\d", re.IGNORECASE),
    "the shared folder": re.compile(re.escape(".." + "/shared"), re.IGNORECASE),
}

# A repository-root path to a markdown file under docs/, with an optional fragment.
DOCS_PATH = re.compile(r"(?<![\w/.-])(docs/[\w/.-]*?\.md)(?:#([\w-]+))?")
# A markdown link target: [text](target) or [text](target#fragment).
MD_LINK = re.compile(r"\]\(([^)\s]*)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


@cache
def repo_files() -> tuple[str, ...]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return tuple(sorted(p for p in out.decode().split("\0") if p))


@cache
def text_of(rel: str) -> str | None:
    """The file's text, or None for a binary (or vanished) file."""
    try:
        data = (ROOT / rel).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def text_files() -> list[tuple[str, str]]:
    return [(rel, text) for rel in repo_files() if (text := text_of(rel)) is not None]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: keep its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(rel: str) -> frozenset[str]:
    """Every heading anchor of a markdown file (duplicates get -1, -2, ... as on GitHub)."""
    text = text_of(rel) or ""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = None if in_fence else HEADING.match(line)
        if m is None:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_the_scan_sees_the_repository() -> None:
    files = repo_files()
    assert "docs/ARCHITECTURE.md" in files and "tests/repo/test_self_contained.py" in files
    assert len(text_files()) > 50


@pytest.mark.parametrize("what", sorted(FORBIDDEN))
def test_no_reference_to_documents_outside_the_repository(what: str) -> None:
    pattern = FORBIDDEN[what]
    hits = [
        f"{rel}:{_line_of(text, m.start())}: {m.group(0)!r}"
        for rel, text in text_files()
        for m in pattern.finditer(text)
    ]
    assert not hits, (
        f"{len(hits)} reference(s) to {what}, which is not part of the repository; point at "
        "docs/ARCHITECTURE.md instead:\n" + "\n".join(hits)
    )


def _fragment_problem(target: str, fragment: str | None) -> str | None:
    """Why ``target`` (a path from the root, under docs/) with ``fragment`` is broken."""
    if not (ROOT / target).is_file():
        return f"{target} does not exist"
    if fragment and fragment not in anchors(target):
        return f"{target} has no heading with anchor #{fragment}"
    return None


def test_docs_paths_exist_and_their_anchors_resolve() -> None:
    problems = []
    for rel, text in text_files():
        for m in DOCS_PATH.finditer(text):
            why = _fragment_problem(m.group(1), m.group(2))
            if why:
                problems.append(f"{rel}:{_line_of(text, m.start())}: {why}")
    assert not problems, "\n".join(problems)


def test_markdown_links_into_docs_resolve() -> None:
    problems = []
    for rel, text in text_files():
        if not rel.endswith(".md"):
            continue
        for m in MD_LINK.finditer(text):
            target, _, fragment = m.group(1).partition("#")
            if "://" in target or target.startswith("mailto:"):
                continue
            if not target:  # a link within the same file
                if fragment and fragment not in anchors(rel):
                    problems.append(f"{rel}:{_line_of(text, m.start())}: no anchor #{fragment}")
                continue
            resolved = (ROOT / rel).parent / target
            try:
                path = resolved.resolve().relative_to(ROOT).as_posix()
            except ValueError:
                problems.append(f"{rel}:{_line_of(text, m.start())}: {target} leaves the repo")
                continue
            if not (path.startswith("docs/") and path.endswith(".md")):
                continue
            why = _fragment_problem(path, fragment or None)
            if why:
                problems.append(f"{rel}:{_line_of(text, m.start())}: {why}")
    assert not problems, "\n".join(problems)


def test_the_worked_examples_have_stable_anchors() -> None:
    have = anchors("docs/ARCHITECTURE.md")
    for anchor in (
        "example-0-static-vs-continuous-batching",
        "example-1-a-token-budget-of-8",
        "example-2-three-requests-on-the-cost-model",
        "example-2d-decode-first-starvation",
        "example-2e-admission-with-growth-headroom",
        "example-3-a-prefix-hit-and-a-block-aligned-chunk",
        "known-bugs-elsewhere",
        "invariants",
        "kernels",
        "vocabulary",
    ):
        assert anchor in have, anchor


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Example 1: a token budget of 8", "example-1-a-token-budget-of-8"),
        ("The block manager alone: `--kv-adapter`", "the-block-manager-alone---kv-adapter"),
        ("Beyond our kernel: oracle-only cases", "beyond-our-kernel-oracle-only-cases"),
        ("[Layers](#layers) and more", "layers-and-more"),
    ],
)
def test_slug_follows_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
