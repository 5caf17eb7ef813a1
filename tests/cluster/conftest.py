"""The cluster tests run the tiny model on one torch thread: its matrices are far too
small to gain from more, and on a shared 2-core machine extra threads only contend
(tests/engine/migration_helpers.py, ``one_torch_thread``, does the same)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
