"""Shared pieces of the cluster tests: small engines of the tiny model publishing their
cache events, and a drive loop that checks the ownership rule after every step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from refserve.cluster import Cluster, InProcessReplica
from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine, RequestOutput


def config(block_size: int, num_blocks: int, budget: int, max_num_seqs: int = 4) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=True,
        cache_events=True,
    )


#: Three replicas that differ in block size, pool and budget (chunked prefills, evictions).
CONFIGS = (config(4, 48, 8), config(8, 24, 11), config(4, 32, 16))


def replica(cfg: SchedulerConfig, *, model_seed: int = 0) -> InProcessReplica:
    return InProcessReplica(LLMEngine("tiny", scheduler_config=cfg, model_seed=model_seed))


def final_tokens(outputs: Sequence[RequestOutput]) -> dict[str, tuple[int, ...]]:
    """Each request's final token ids (n == 1), from a stream of outputs; each request
    must finish exactly once."""
    out: dict[str, tuple[int, ...]] = {}
    for o in outputs:
        if o.finished:
            assert o.request_id not in out, f"{o.request_id} finished twice"
            out[o.request_id] = o.token_ids
    return out


def drive(
    cluster: Cluster,
    *,
    each_step: Callable[[int], None] | None = None,
    max_steps: int = 2000,
) -> list[RequestOutput]:
    """Step until no replica has work, checking ownership after every step (and after
    whatever ``each_step(step_index)`` does between steps)."""
    outputs: list[RequestOutput] = []
    for i in range(max_steps):
        if not cluster.has_work:
            return outputs
        if each_step is not None:
            each_step(i)
            assert cluster.ownership_violations() == []
        outputs.extend(cluster.step())
        assert cluster.ownership_violations() == []
    raise AssertionError(f"the cluster still has work after {max_steps} steps")
