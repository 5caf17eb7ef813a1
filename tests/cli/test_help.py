"""Every ``refserve`` help text a user can ask for prints, exits 0, and explains every
option.

The commands come from the real parser (the choices of its subparsers action), never a
hand list, so a subcommand registered tomorrow is walked too. ``check-kernel``, ``compare``
and ``conformance`` parse their own command line: the entry in ``refserve``'s parser is a
stub (one REMAINDER argument), and their real parsers are walked instead (:data:`OWN_PARSERS`).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout

import pytest

from refserve.cli import main as cli_main


def _check_kernel_parser() -> argparse.ArgumentParser:
    from refserve.conformance.kernel_grid import build_parser

    return build_parser()


def _compare_parser() -> argparse.ArgumentParser:
    from refserve.cli.compare import _parser

    return _parser()


def _conformance_parser() -> argparse.ArgumentParser:
    from refserve.conformance.cli import _parser

    return _parser()


#: The parser each self-parsing subcommand hands its arguments to.
OWN_PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "check-kernel": _check_kernel_parser,
    "compare": _compare_parser,
    "conformance": _conformance_parser,
}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands ``parser`` registers, by name (empty for a parser without any)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _owns_its_command_line(parser: argparse.ArgumentParser) -> bool:
    return any(a.nargs == argparse.REMAINDER for a in parser._actions)


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """What is wrong with the help of ``parser`` and of every subcommand under it: an
    argument (optional or positional, the subcommand list included) without help, a
    backtick (reST markup printed as is), a help text argparse cannot format."""
    problems: list[str] = []
    try:
        text = parser.format_help()
    except (ValueError, TypeError, KeyError) as e:  # a stray % in a help string
        return [f"{parser.prog}: the help does not format: {e}"]
    if "`" in text:
        line = next(x for x in text.splitlines() if "`" in x)
        problems.append(f"{parser.prog}: a backtick in the help: {line.strip()!r}")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if not (action.help or "").strip():
            name = "/".join(action.option_strings) or action.metavar or action.dest
            problems.append(f"{parser.prog}: {name} has no help")
    for name, sub in subcommands(parser).items():
        if _owns_its_command_line(sub):
            if name not in OWN_PARSERS:
                problems.append(
                    f"{parser.prog} {name}: parses its own arguments; name its "
                    "parser in OWN_PARSERS"
                )
                continue
            sub = OWN_PARSERS[name]()
        problems += help_problems(sub)
    return problems


def test_every_help_text_explains_every_option() -> None:
    problems = help_problems(cli_main._parser())
    assert not problems, "\n".join(problems)


def test_the_top_level_help_lists_every_subcommand() -> None:
    parser = cli_main._parser()
    names = subcommands(parser)
    assert len(names) >= 9  # the walk would pass vacuously on a parser it cannot read
    text = parser.format_help()
    missing = [n for n in names if f"    {n} " not in text and f"    {n}\n" not in text]
    assert not missing, f"not in refserve --help: {missing}"
    assert cli_main.DESCRIPTION in text


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli_main.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", [None, *subcommands(cli_main._parser())])
def test_each_help_prints_and_exits_0(name: str | None) -> None:
    """What a user types, through the real dispatch (the self-parsing commands included)."""
    argv = ["--help"] if name is None else [name, "--help"]
    code, out, err = _run(argv)
    assert code == 0, err
    assert out.startswith("usage: refserve") and (name is None or name in out.split("\n")[0])
    assert "`" not in out
    assert not err


def test_version() -> None:
    code, out, err = _run(["--version"])
    assert code == 0, err
    assert out == f"refserve {cli_main.version()}\n"
    assert cli_main.version()[0].isdigit()  # the installed package's, not the fallback


def test_version_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli_main.version() == "unknown (not installed)"
    assert _run(["--version"])[:2] == (0, "refserve unknown (not installed)\n")


# --------------------------------------------------------------------- the walker fails
def _tiny(**flag: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiny", description="a tiny tool")
    p.add_argument("--fine", help="has help")
    sub = p.add_subparsers(metavar="COMMAND", help="what to run")
    run = sub.add_parser("run", help="run it")
    run.add_argument("--flag", **flag)  # type: ignore[arg-type]
    return p


def test_the_walker_passes_a_parser_with_help_everywhere() -> None:
    assert help_problems(_tiny(help="explained")) == []


@pytest.mark.parametrize(
    ("flag", "complaint"),
    [
        ({}, "tiny run: --flag has no help"),
        ({"help": " "}, "tiny run: --flag has no help"),
        ({"help": "see ``--fine``"}, "tiny run: a backtick in the help"),
        ({"help": "100% of it"}, "tiny run: the help does not format"),
    ],
)
def test_the_walker_reports_a_subcommand_flag(flag: dict[str, str], complaint: str) -> None:
    found = help_problems(_tiny(**flag))
    assert len(found) == 1 and found[0].startswith(complaint), found


def test_the_walker_reports_a_positional_and_the_command_list() -> None:
    p = argparse.ArgumentParser(prog="tiny")
    p.add_argument("path")
    p.add_subparsers(metavar="COMMAND").add_parser("run", help="run it")
    assert help_problems(p) == ["tiny: path has no help", "tiny: COMMAND has no help"]


def test_the_walker_needs_the_real_parser_of_a_self_parsing_command() -> None:
    p = argparse.ArgumentParser(prog="tiny")
    sub = p.add_subparsers(metavar="COMMAND", help="what to run")
    sub.add_parser("own", help="parses its own").add_argument(
        "rest", nargs=argparse.REMAINDER, help="everything"
    )
    (found,) = help_problems(p)
    assert "own: parses its own arguments" in found
