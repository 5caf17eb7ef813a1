"""What a value is: the two type tests every input check in refserve is built on.

``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds and a
check written as ``isinstance(x, int)`` takes ``True`` for a count of 1. Every check of a
count, an id, a length or a rate goes through these two functions instead, so that rule
is written once; each caller still raises its own typed error with its own message.
"""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An ``int`` or a ``float`` that is not a ``bool`` (NaN and infinities included:
    callers that refuse them say so in their own range check)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
