"""Side-by-side scheduler benchmarks through the adapters (``make bench-peers``).

The same decode-heavy workload (:mod:`conformance.bench.workload`) runs through refserve,
nano-vllm-fork and vLLM, each engine in its own worker process and virtualenv
(``ref_worker``, ``nanovllm_worker``, ``vllm_worker``, one module per engine over the
line protocol of :mod:`conformance.bench.worker`). The driver (:mod:`conformance.bench.peers`,
run from refserve's venv) interleaves the engines round by round and writes the JSON
(the run's record and figures: :mod:`conformance.bench.results`) and the markdown table
(:mod:`conformance.bench.render`). Not part of ``make test``.
"""
