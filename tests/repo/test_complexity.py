"""No function in ``ref/`` or ``conformance/`` above cyclomatic complexity 15 (radon's
count): the engine, and the suite outsiders read most, are held to the same standard
(docs/ARCHITECTURE.md, "Claims the tests check").

The one exception is a flat list of independent validation checks (a config's
``__post_init__``): its branches are parallel ``if ...: raise`` lines, each read on its own,
so its count says nothing about how hard it is to follow. An exempt function must stay
flat: no control structure nested more than two deep.
"""

from __future__ import annotations

import ast
from pathlib import Path

from radon.complexity import cc_visit
from radon.visitors import Function

ROOT = Path(__file__).resolve().parents[2]
MAX_COMPLEXITY = 15
CHECKED = ("ref", "conformance")
# (file, Class.method): flat validation lists, each branch one independent check.
FLAT_VALIDATION = {
    ("ref/core/config.py", "SchedulerConfig.__post_init__"),
    ("ref/model/sampler.py", "SamplingParams.__post_init__"),
    ("ref/model/config.py", "ModelConfig.__post_init__"),
}
MAX_FLAT_DEPTH = 2
_BRANCHES = (ast.If, ast.For, ast.While, ast.Try, ast.With, ast.Match)


def _functions(blocks: list[Function]) -> list[Function]:
    out = []
    for b in blocks:
        if isinstance(b, Function):
            out.append(b)
            out += _functions(b.closures)
    return out


def _qualname(f: Function) -> str:
    return f"{f.classname}.{f.name}" if f.classname else f.name


def over_limit(source: str, where: str) -> list[str]:
    """Every function in ``source`` above the limit that is not an exempt flat list."""
    return [
        f"{where}:{f.lineno} {_qualname(f)} has complexity {f.complexity} > {MAX_COMPLEXITY}"
        for f in _functions(cc_visit(source))
        if f.complexity > MAX_COMPLEXITY and (where, _qualname(f)) not in FLAT_VALIDATION
    ]


def _depth(node: ast.AST) -> int:
    inner = max((_depth(c) for c in ast.iter_child_nodes(node)), default=0)
    return inner + 1 if isinstance(node, _BRANCHES) else inner


def _function_node(source: str, qualname: str) -> ast.FunctionDef:
    cls, name = qualname.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{qualname} not found")


def _sources() -> list[tuple[str, str]]:
    """(path from the root, source) of every checked file."""
    paths = sorted(p for top in CHECKED for p in (ROOT / top).rglob("*.py"))
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in paths]


def test_no_checked_function_is_above_the_limit() -> None:
    bad = [v for where, source in _sources() for v in over_limit(source, where)]
    assert not bad, "functions above the complexity limit:\n" + "\n".join(bad)


def test_conformance_is_checked() -> None:
    """The walk reads conformance/ as well as ref/, subpackages included."""
    where = {w for w, _ in _sources()}
    assert {
        "ref/core/scheduler.py",
        "conformance/runner.py",
        "conformance/kv/run.py",
        "conformance/bench/peers.py",
    } <= where


def test_exempt_validation_lists_stay_flat() -> None:
    for where, qualname in sorted(FLAT_VALIDATION):
        node = _function_node((ROOT / where).read_text(encoding="utf-8"), qualname)
        depth = max((_depth(s) for s in node.body), default=0)
        assert depth <= MAX_FLAT_DEPTH, f"{where} {qualname}: nested {depth} deep, not flat"


def test_a_function_above_the_limit_is_caught() -> None:
    """The check fails on a planted 16-branch function, and passes one at 15."""
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(14))
    assert over_limit(f"def f(x):\n{branches}    return -1\n", "planted.py") == []
    more = branches + "    if x == 99:\n        return 99\n"
    found = over_limit(f"def f(x):\n{more}    return -1\n", "planted.py")
    assert found == ["planted.py:1 f has complexity 16 > 15"]
