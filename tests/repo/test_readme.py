"""README's engine example is runnable code, and the commands it starts with exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_starts_with_the_two_commands() -> None:
    head = "\n".join(README.splitlines()[:40])
    assert "make run" in head and "make test" in head


def test_engine_example_runs() -> None:
    section = README.split("## The engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the engine section has no python example"
    out = subprocess.run(
        [sys.executable, "-c", code.group(1)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "length" in out.stdout  # both greedy requests ran to max_tokens


def test_agent_turn_example_runs() -> None:
    section = README.split("**Agent turns**", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the agent-turn paragraph has no python example"
    out = subprocess.run(
        [sys.executable, "-c", code.group(1)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "host"  # a 2 s wait parks the KV on the host
    assert lines[-2].startswith("1 (") and lines[-2].endswith("True")  # turn 1 ran to the end
    moved_out, moved_in = map(int, lines[-1].split())
    assert moved_out == moved_in > 0
