"""The structural claims of docs/ARCHITECTURE.md, each checked (docs/ARCHITECTURE.md,
"Claims the tests check").

A claim about the code that nothing checks drifts: the doc said ref/core had no torch
while three of its modules imported it, and that every formula lived in spec/arith.py
while the blocks-needed formula was inlined in five places. Each claim below is read off
the source (the syntax tree, not a grep) or off a running scheduler, each checker is
shown failing on a planted violation, and the doc names this file where it makes the
claim. The layer order has its own file (tests/repo/test_layers.py), as has the rule
that ref/core, ref/kv and spec import no torch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

# ----------------------------------------------------------------- formulas in spec/arith.py
# "All formulas live once, in spec/arith.py" (docs/ARCHITECTURE.md, "Vocabulary"): the
# paged cache's arithmetic on a block size (blocks needed, the slot of a position, the
# block of a position, a position's offset in its block) is called, never written out.
BLOCK_SIZE_NAMES = frozenset({"bs", "block_size"})
FORMULA_HOME = ROOT / "spec" / "arith.py"


def _is_block_size(node: ast.expr) -> bool:
    """``bs``, ``block_size`` or ``<anything>.block_size``."""
    if isinstance(node, ast.Name):
        return node.id in BLOCK_SIZE_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "block_size"


def _is_ceil_division(node: ast.AST) -> bool:
    """``-(-a // b)``: ceiling division written out (``refserve.spec.arith.cdiv``)."""
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.BinOp)
        and isinstance(node.operand.op, ast.FloorDiv)
        and isinstance(node.operand.left, ast.UnaryOp)
        and isinstance(node.operand.left.op, ast.USub)
    )


def inlined_formulas(source: str, where: str) -> list[str]:
    """Every place in ``source`` that writes a cache formula out instead of calling it:
    a ceiling division, or a floor division or remainder by a block size."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if _is_ceil_division(node):
            found.append(
                f"{where}:{node.lineno}: ceiling division (refserve.spec.arith.blocks_needed)"
            )
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.FloorDiv | ast.Mod)
            and _is_block_size(node.right)
        ):
            what = "logical_block" if isinstance(node.op, ast.FloorDiv) else "block_offset"
            found.append(
                f"{where}:{node.lineno}: division by a block size (refserve.spec.arith.{what})"
            )
    return found


def _sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def test_every_cache_formula_is_called_from_spec_arith() -> None:
    found = [
        hit
        for path in _sources("ref")
        for hit in inlined_formulas(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert not found, "formulas written out of spec/arith.py:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        "n = -(-num_tokens // bs)",
        "slot = table[p // self.block_size] * 16",
        "offset = position % block_size",
        "full = (n + 1) % cfg.block_size == 0",
    ],
)
def test_an_inlined_formula_is_caught(planted: str) -> None:
    assert inlined_formulas(planted, "planted.py")


def test_calls_and_other_arithmetic_are_not_formulas() -> None:
    fine = "n = blocks_needed(t, bs)\nq = a // 2\nr = steps % period\ns = -(x // y)\n"
    assert inlined_formulas(fine, "fine.py") == []


def test_spec_arith_itself_holds_the_formulas() -> None:
    # The scan must not be vacuous: the home of the formulas writes them out.
    assert inlined_formulas(FORMULA_HOME.read_text(encoding="utf-8"), "spec/arith.py")


# ----------------------------------------------------------------- the doc names its tests
def test_the_doc_names_this_file_and_every_test_it_cites_exists() -> None:
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    assert "tests/repo/test_architecture_claims.py" in doc
    cited = set(re.findall(r"`(tests/[\w/]+\.py)`", doc))
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"docs/ARCHITECTURE.md cites tests that do not exist: {missing}"
