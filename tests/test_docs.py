"""The README and the docs pages (issue 41 item 4): the README stays a five-minute read, every relative markdown link
of README.md and docs/*.md points at a file that exists, and the README's table of commands names every subcommand
that ``pairmine --help`` lists."""

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_local_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, s3:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, f"{page.name}: links that do not resolve: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_code_block_is_closed(page):
    fences = [line for line in page.read_text().splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: a code block is never closed"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 260, f"README.md has {lines} lines"


def _subcommands() -> list[str]:
    from pairmine.pipeline.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_readme_commands_table_names_every_subcommand():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Commands", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([a-z-]+)` \|", table, flags=re.M))
    commands = _subcommands()
    assert len(commands) >= 9, commands
    assert set(commands) <= named, f"missing from the README's commands table: {set(commands) - named}"
    for name in commands:  # one example each, of that very command
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"`pairmine {name} " in row, f"the README's row for {name} has no example"


def test_ci_runs_the_readme_commands():
    """.ci/run installs as the README's first command does and runs the README's test command."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    install, tests = blocks[0].strip(), blocks[1].strip()
    assert tests == ".venv/bin/python -m pytest" and tests in ci.splitlines()
    pip = re.search(r"pip install (.*?) &&", install).group(1)
    assert "pairmine mine" in install and pip in ci
