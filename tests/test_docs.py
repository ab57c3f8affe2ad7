"""The documentation holds together: every link and repository path it names exists, every
`backfill` command it shows parses with the real parser, and every result file is cited."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from backfill.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RESULTS = ROOT / "docs" / "results"

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A repository path in prose or code: a top-level folder, then at least one more part (not REV:path,
# a file in git history, as `git show REV:scripts/NAME.py` names a probe kept there).
REPO_PATH = re.compile(r"(?<![\w./:-])((?:backfill|docs|scripts|tests)/[\w./*-]*[\w*])")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_text(page))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_resolves(page):
    missing = [t for t in _relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{_page_id(page)} links to what does not exist: {missing}"


def _repo_paths(page: Path) -> set[str]:
    """The paths a page names, as glob patterns: a placeholder in capitals (NAME, N) stands for any name."""
    return {re.sub(r"(?<![A-Za-z])[A-Z]+(?![A-Za-z])", "*", p.rstrip(".")) for p in REPO_PATH.findall(_text(page))}


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_repository_path_named_exists(page):
    missing = sorted(p for p in _repo_paths(page) if not any(ROOT.glob(p)))
    assert not missing, f"{_page_id(page)} names paths that do not exist: {missing}"


def shown_commands(text: str) -> list[list[str]]:
    """The `backfill ...` command lines of the page's code blocks, as argument lists (without the
    program name, shell comments, line continuations and what follows a pipe or &&)."""
    commands = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"^\s*(\$\s+)?", "", line)
            for part in re.split(r"\s*(?:&&?|\|\|?|;)\s*", line):
                part = re.sub(r"^(\w+=\S*\s+)+", "", part)  # VAR=value prefixes
                if re.match(r"(\.venv/bin/)?backfill\s", part):
                    commands.append(shlex.split(part, comments=True)[1:])
    return commands


def _node_bench_parses(argv: list[str]) -> None:
    from backfill.bench.node_bench import build_parser as node_bench_parser

    node_bench_parser().parse_args(argv)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_command_shown_parses(page):
    for argv in shown_commands(_text(page)):
        try:
            if argv[:2] == ["bench", "node"]:
                _node_bench_parses(argv[2:])
            else:
                build_parser(argv).parse_args(argv)
        except SystemExit as exc:
            if exc.code == 0:  # --help
                continue
            pytest.fail(f"{_page_id(page)} shows `backfill {shlex.join(argv)}`, which does not parse ({exc})")


def test_the_pages_show_commands():
    """The command check above has something to check (a code block format it misses would pass)."""
    assert sum(len(shown_commands(_text(page))) for page in PAGES) > 30


def test_shown_commands_reads_blocks_like_a_shell():
    text = ("```bash\n$ backfill demo --duration 20   # a comment\n"
            "FOO=1 backfill sim coserve \\\n  --duration 5 && backfill bench engine | tee x\n"
            "echo backfill not a command\n```\nbackfill outside a block\n")
    assert shown_commands(text) == [["demo", "--duration", "20"], ["sim", "coserve", "--duration", "5"],
                                    ["bench", "engine"]]


def test_every_result_file_is_cited_by_a_page():
    cited = set()
    for page in PAGES:
        text = _text(page)
        cited |= {(ROOT / p).resolve() for p in REPO_PATH.findall(text)}
        cited |= {(page.parent / t.split("#")[0]).resolve() for t in _relative_links(page)}
    uncited = [str(f.relative_to(ROOT)) for f in sorted(RESULTS.rglob("*"))
               if f.is_file() and f.resolve() not in cited and not _in_cited_folder_readme(f, cited)]
    assert not uncited, f"result files no page cites (cite them or delete them): {uncited}"


def _in_cited_folder_readme(path: Path, cited: set[Path]) -> bool:
    """A results folder with a README.md that a page cites: the README cites the folder's files."""
    readme = path.parent / "README.md"
    return (path.parent != RESULTS and readme.resolve() in cited
            and path.name in readme.read_text(encoding="utf-8"))
