"""Prefill/decode roles over the Ray transport (ref/cluster/ray_replica.py; docs/DISAGG.md,
"In the cluster"): a ``1P1D`` cluster of two Ray actors hands each request off after its
first token by ticket (its K/V inline, the ticket path of ``Cluster.migrate``), and gives
one in-process engine's greedy tokens, the ownership rule and spec/pd.py's snapshot rules
holding after every step. Ray starts once for the module (locally, 2 CPUs, no dashboard,
loopback only, as tests/serve/test_serve_ray.py starts it) and is shut down at its end."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

# Ray itself is imported by start_ray (the module fixture), never here: it must read its
# loopback switch at import (ref/cluster/ray_replica.py, ``LOOPBACK_ENV``).
if importlib.util.find_spec("ray") is None:
    pytest.skip(
        "Ray is the optional [cluster] extra: `make cluster-deps` installs it",
        allow_module_level=True,
    )

from pd_helpers import Run  # after the skip: no Ray, no import

from refserve.cluster import Cluster
from refserve.cluster.disagg import Roles
from refserve.cluster.ray_replica import ray_replicas, start_ray, stop_ray
from refserve.core.config import SchedulerConfig
from refserve.model.sampler import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def ray_local() -> Iterator[None]:
    started = start_ray()
    yield
    if started:
        stop_ray()


def test_1p1d_on_ray_hands_off_by_ticket_and_matches_one_engine() -> None:
    cfg = SchedulerConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True
    )
    reps = ray_replicas(2, scheduler_config=cfg)
    try:
        cluster = Cluster(reps, roles=Roles.parse("1P1D", 2))
        single = Cluster.in_process(1, scheduler_config=cfg)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        work = [(f"r{i}", list(range(1 + i, 14 + i)), params) for i in range(3)]
        for rid, prompt, p in work:
            single.add_request(prompt, p, request_id=rid)
        want = {}
        while single.has_work:
            for o in single.step():
                if o.finished:
                    want[o.request_id, o.index] = o.token_ids
        run = Run(cluster)
        run.add(work)
        assert run.to_end() == want
        assert run.handed_off == {rid for rid, *_ in work} and not run.kept
        assert cluster.metrics.handoffs == 3 and cluster.metrics.migration_bytes > 0
        assert cluster.take_decode_steps() == []  # a Ray actor's step records stay there
    finally:
        for r in reps:
            r.kill()
