"""Side-by-side scheduler benchmarks through the adapters (``make bench-peers``).

The same decode-heavy workload (:mod:`refserve.conformance.bench.workload`) runs through refserve,
nano-vllm-fork and vLLM, each engine in its own worker process and virtualenv
(``ref_worker``, ``nanovllm_worker``, ``vllm_worker``, one module per engine over the
line protocol of :mod:`refserve.conformance.bench.worker`). The driver
(:mod:`refserve.conformance.bench.peers`, run from refserve's venv) interleaves the engines round by
round and writes the JSON (the run's record and figures: :mod:`refserve.conformance.bench.results`)
and the markdown table (:mod:`refserve.conformance.bench.render`). Not part of ``make test``.
"""
