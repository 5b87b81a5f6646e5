"""The docs are true about the code: documented commands and flags exist, and the module tree of
docs/architecture.md lists exactly the files of sgl_lite/.

Commands are read from the fenced code blocks of README.md and docs/*.md (continuation lines joined,
comments dropped) and from inline code spans: each `sgl-lite SUBCOMMAND` must be a subcommand of the
click CLI and each of its `--flag`s one of that command's options; each `python scripts/X.py` must exist
and accept each `--flag` (read from its `--help`). `sgl-lite bench` forwards to the benchmark's own
parser, so its flags are read from `sgl-lite bench --help` too.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from sgl_lite.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")
SHELL_SEPARATORS = {"&", "&&", "|", "||", ";"}
# Subcommands that hand their arguments to another parser, whose flags `--help` lists.
FORWARDING = {"bench"}


def _commands_in(text: str) -> list[str]:
    """Command lines of fenced blocks (with `\\` continuations joined) and of inline code spans."""
    commands: list[str] = []
    for block in FENCE.findall(text):
        commands += block.replace("\\\n", " ").splitlines()
    commands += [" ".join(span.split()) for span in INLINE.findall(FENCE.sub("", text))]
    return commands


def _tokens(command: str) -> list[str] | None:
    """The argv of an `sgl-lite ...` or `python scripts/...` command (env assignments before it
    skipped, anything after a shell separator dropped); None for any other line."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote: prose in backticks, not a command
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    if not words:
        return None
    if words[0] == "sgl-lite" or (words[0] == "python" and len(words) > 1 and words[1].startswith("scripts/")):
        cut = next((i for i, w in enumerate(words) if w in SHELL_SEPARATORS), len(words))
        return words[:cut]
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        for command in _commands_in(doc.read_text()):
            argv = _tokens(command)
            if argv is not None:
                found.append((f"{doc.relative_to(ROOT)}: {' '.join(argv)}", argv))
    return found


def _long_flags(argv: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in argv if w.startswith("--") and len(w) > 2]


def _click_flags(command: click.Command) -> set[str]:
    return {opt for p in command.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")}


@functools.lru_cache(maxsize=None)
def _help_flags(argv: tuple[str, ...]) -> frozenset[str]:
    """The `--flag`s an argparse program's `--help` lists as options (lines starting with a dash)."""
    out = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(argv)} --help failed: {out.stderr[-2000:]}"
    flags: set[str] = set()
    for line in out.stdout.splitlines():
        if line.strip().startswith("-"):
            flags.update(re.findall(r"--[A-Za-z0-9][\w-]*", line.strip().split("  ")[0]))
    return frozenset(flags)


def _problems(argv: list[str]) -> list[str]:
    if argv[0] == "python":
        script = ROOT / argv[1]
        if not script.is_file():
            return [f"{argv[1]} does not exist"]
        known = _help_flags((argv[1],))
        return [f"{argv[1]} has no {flag}" for flag in _long_flags(argv[2:]) if flag not in known]
    if len(argv) < 2 or argv[1].startswith("-"):
        return []  # `sgl-lite --help` and the like
    ctx = click.Context(cli_main)
    command = cli_main.get_command(ctx, argv[1])
    if command is None:
        return [f"sgl-lite has no subcommand {argv[1]!r} (it has {', '.join(cli_main.list_commands(ctx))})"]
    if argv[1] in FORWARDING:
        known = _help_flags(("-m", "sgl_lite.cli", argv[1]))
    else:
        known = _click_flags(command) | {"--help"}
    return [f"sgl-lite {argv[1]} has no {flag}" for flag in _long_flags(argv[2:]) if flag not in known]


DOCUMENTED = documented_commands()


def test_the_docs_show_commands_to_check() -> None:
    """The parser finds the commands it should (so the test below cannot pass on an empty list)."""
    names = {argv[1] for _, argv in DOCUMENTED}
    assert {"serve", "simulate", "generate", "bench", "scripts/bench_serving.py", "scripts/bench_scheduler.py"} <= names
    assert len(DOCUMENTED) >= 20


@pytest.mark.parametrize("where,argv", DOCUMENTED, ids=[where for where, _ in DOCUMENTED])
def test_documented_command_and_flags_exist(where: str, argv: list[str]) -> None:
    assert _problems(argv) == [], where


def test_the_checker_catches_a_wrong_flag_and_subcommand() -> None:
    assert _problems(["sgl-lite", "serve", "--no-such-flag", "1"]) == ["sgl-lite serve has no --no-such-flag"]
    assert _problems(["sgl-lite", "serve", "--schedule-policy=lpm"]) == []
    assert "no subcommand 'nosuch'" in _problems(["sgl-lite", "nosuch"])[0]
    assert _problems(["python", "scripts/bench_scheduler.py", "--cpu-time", "--no-such-flag"]) == [
        "scripts/bench_scheduler.py has no --no-such-flag"]
    assert _problems(["python", "scripts/no_such_script.py"]) == ["scripts/no_such_script.py does not exist"]


# ---------------------------------------------------------------------------------- the module tree

ARCHITECTURE = ROOT / "docs" / "architecture.md"
TREE_HEADING = "## The code, module by module"


def documented_tree() -> set[str]:
    """Paths named by the first code block after TREE_HEADING: `name/` is a package (its __init__.py),
    `name.py` a module; two spaces of indent per level; the description follows after 2+ spaces."""
    text = ARCHITECTURE.read_text()
    assert TREE_HEADING in text, f"{ARCHITECTURE.name} lost its heading {TREE_HEADING!r}"
    block = FENCE.search(text, text.index(TREE_HEADING)).group(1)
    paths: set[str] = set()
    stack: list[str] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0, f"odd indent: {line!r}"
        name = line.strip().split("  ")[0]
        assert len(line.strip()) > len(name), f"no description: {line!r}"
        depth = indent // 2
        assert depth <= len(stack), f"{name} is indented under nothing"
        del stack[depth:]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            paths.add("/".join(stack) + "/__init__.py")
        else:
            paths.add("/".join([*stack, name]))
    return paths


def test_architecture_tree_matches_the_package() -> None:
    sources = [p for pattern in ("*.py", "*.cpp", "*.h") for p in (ROOT / "sgl_lite").rglob(pattern)]  # C++ ops ship too
    actual = {p.relative_to(ROOT).as_posix() for p in sources if "__pycache__" not in p.parts}
    documented = documented_tree()
    assert sorted(actual - documented) == [], "modules missing from docs/architecture.md"
    assert sorted(documented - actual) == [], "docs/architecture.md lists modules that do not exist"


# ---------------------------------------------------------------------------------- docs sections code cites

CITATION = re.compile(r"docs/([\w-]+\.md),\s*\"([^\"]+)\"")


def cited_sections() -> list[tuple[str, str, str]]:
    """(source file, docs file, quoted section) for every `docs/X.md, "section"` a comment of the code names;
    comment markers at line breaks are dropped so a citation may wrap."""
    found = []
    for path in sorted([*(ROOT / "sgl_lite").rglob("*.py"), *(ROOT / "sgl_lite").rglob("*.cpp"), *(ROOT / "sgl_lite").rglob("*.h"),
                        *(ROOT / "scripts").rglob("*.py")]):
        text = re.sub(r"\n\s*(?://|#)?\s*", " ", path.read_text())
        found += [(path.relative_to(ROOT).as_posix(), doc, section) for doc, section in CITATION.findall(text)]
    return found


def test_every_docs_section_the_code_cites_exists() -> None:
    cited = cited_sections()
    assert cited, "the pattern finds no citation at all"
    missing = [f"{source}: docs/{doc} has no {section!r}" for source, doc, section in cited
               if not (ROOT / "docs" / doc).is_file()
               or section.rstrip(".") not in re.sub(r"\s+", " ", (ROOT / "docs" / doc).read_text())]
    assert missing == []
