# Two commands a newcomer needs: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Modules whose pure helpers carry CrossHair contracts (pre/post conditions).
CROSSHAIR_MODULES := refserve.spec.arith refserve.spec.hashing refserve.spec.groups refserve.core.capacity \
	refserve.core.prefill refserve.core.speculation refserve.core.swap refserve.core.policy \
	refserve.conformance.explore.key
CROSSHAIR_TIMEOUT ?= 5

.PHONY: run train-tiny cluster-deps test lint typecheck pytest crosshair conformance conformance-nanovllm conformance-vllm bench deep clean venv gpu-check gpu-bench tree wheel test-wheel

venv: $(STAMP)

# torch==2.13.0 is installed explicitly first: this machine's pip finds the CPU wheel on
# local disk, and the project's torch range is satisfied by it, so pip never resolves a
# multi-GB CUDA build. GPU users: see docs/GUIDE.md ("Installing").
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The demo, then one request moved between two engines every 2 steps, its output checked
# against the unmigrated run (ref/cli/migrate.py, docs/MIGRATION.md).
run: $(STAMP)
	$(VENV)/bin/refserve demo
	$(VENV)/bin/refserve generate --prompt "Count to four." --max-tokens 24 --migrate-every 2 --check

# The embedded trained model: regenerates ref/model/tiny/{config.json,model.safetensors}
# from the generated corpus (one CPU thread, seeded; about 5 minutes).
train-tiny: $(STAMP)
	$(PY) -m refserve.model.train_tiny

# One import name, refserve, over four folders (docs/ARCHITECTURE.md, "One import name").
# Python processes of $(VENV) import it through setuptools' editable finder; tools that run
# no import hooks (mypy, mutmut) and a machine with nothing installed read it through this
# link tree instead: the wheel's layout, real folders holding a link to every source file,
# made anew on each use (it takes well under a second), so added files are never missed.
TREE := build/tree
tree:
	rm -rf $(TREE)/refserve
	mkdir -p $(TREE)
	cp -rs $(CURDIR)/ref $(TREE)/refserve
	cp -rs $(CURDIR)/spec $(TREE)/refserve/spec
	cp -rs $(CURDIR)/kernels $(TREE)/refserve/kernels
	cp -rs $(CURDIR)/conformance $(TREE)/refserve/conformance
	find $(TREE)/refserve -name __pycache__ -prune -exec rm -rf {} +

# The wheel users install (build/wheel/refserve-*.whl): the third-party venvs install
# it, and test-wheel installs it beside current transformers and Hugging Face's kernels.
WHEEL_DIR := build/wheel
wheel:
	rm -rf $(WHEEL_DIR)
	$(PYTHON) -m pip wheel -q --no-deps -w $(WHEEL_DIR) .
WHEEL = $(wildcard $(WHEEL_DIR)/refserve-*.whl)
# Into a third-party venv, again on every run, so that the venv runs this checkout's code.
install_wheel = $(1) -m pip install -q --no-deps --force-reinstall $(WHEEL)

# The wheel in a fresh virtualenv beside the newest transformers and Hugging Face's
# `kernels`, driven from outside the checkout (tests/install/; minutes: torch is installed
# into that venv). Part of `make test`; a plain `pytest` deselects it (pyproject addopts).
test-wheel: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider -m install tests/install

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP) tree
	$(VENV)/bin/mypy

# The deterministic Hypothesis profile unless the caller picks another (deep, dev).
HYPOTHESIS_PROFILE ?= ci
export HYPOTHESIS_PROFILE

# The cluster's Ray transport (docs/CLUSTER.md, "Transports"): the pinned `cluster` extra
# into $(VENV), stamped like the dev extra. The pytest stage needs it
# (tests/serve/test_serve_ray.py: two replicas on Ray); the in-process default needs none.
CLUSTER_STAMP := $(VENV)/.installed-cluster

$(CLUSTER_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[cluster]'
	touch $(CLUSTER_STAMP)

cluster-deps: $(CLUSTER_STAMP)

# One worker process per core (pytest-xdist), a test file per worker at a time: module
# fixtures (a trained checkpoint, a server, a Ray cluster) are built once per file.
PYTEST_WORKERS ?= 2

pytest: $(STAMP) $(CLUSTER_STAMP)
	$(PY) -m pytest -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile

crosshair: $(STAMP)
	timeout 300 $(VENV)/bin/crosshair check --per_condition_timeout=$(CROSSHAIR_TIMEOUT) \
		$(CROSSHAIR_MODULES)

# refserve's own adapter must pass the whole conformance suite.
conformance: $(STAMP)
	$(VENV)/bin/refserve conformance --adapter refserve.conformance.adapters.ref:make --kv-adapter refserve.conformance.adapters.ref_kv:make_kv
	$(VENV)/bin/refserve conformance --adapter refserve.conformance.adapters.ref:make_swap
	$(VENV)/bin/refserve conformance --adapter refserve.conformance.adapters.ref:make_mlfq
	$(VENV)/bin/refserve conformance --grouped-kv-adapter refserve.conformance.adapters.ref_kv:make_grouped

test: lint typecheck pytest crosshair conformance test-wheel

# The third-party run. nano-vllm-fork lives in its own virtualenv, never in $(VENV) and
# never in `make test`: torch==2.13.0 first, as for $(VENV) (the CPU wheel on local disk);
# refserve's wheel with its `conformance` extra (as users install it, not editable);
# what the adapter imports (the `nanovllm` extra: numpy, transformers); pytest and
# pytest-benchmark (pyproject's addopts) for the adapter's test:
# $(NANO_VENV)/bin/python -m pytest tests/conformance/test_conformance.py -k nanovllm
# and last nano-vllm-fork with --no-deps (its own requirements add triton; only its
# scheduler modules are imported). The run EXITS 1 BY DESIGN: the suite finds nano-vllm's
# bugs (so make reports Error 1). Findings: conformance/FINDINGS_nanovllm.md.
NANO_VENV := .venv-nanovllm
NANO_PY := $(NANO_VENV)/bin/python
NANO_STAMP := $(NANO_VENV)/.installed

$(NANO_STAMP): pyproject.toml | wheel
	test -x $(NANO_PY) || $(PYTHON) -m venv $(NANO_VENV)
	$(NANO_PY) -m pip install -q --upgrade pip
	$(NANO_PY) -m pip install -q torch==2.13.0
	$(NANO_PY) -m pip install -q '$(WHEEL)[conformance]' numpy 'transformers>=4.48' 'pytest>=8' pytest-benchmark
	$(NANO_PY) -m pip install -q --no-deps nano-vllm-fork==20260210 'xxhash>=3'
	touch $(NANO_STAMP)

conformance-nanovllm: wheel $(NANO_STAMP)
	$(call install_wheel,$(NANO_PY))
	mkdir -p out
	$(NANO_VENV)/bin/refserve conformance --adapter refserve.conformance.adapters.nanovllm:make \
		--report out/nanovllm.json --markdown out/nanovllm.md

# vLLM's V1 scheduler and KV cache manager, driven on the CPU by
# conformance/adapters/vllm.py (no model, no GPU; a fake model-runner output). vLLM pins its
# own torch (a CUDA build from the package index, ~9 GB with its dependencies), so it lives
# in its own virtualenv, never in $(VENV) and never in `make test`. Like the nano-vllm run,
# the run exits 1 when the suite finds failures; findings: conformance/FINDINGS_vllm.md.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml | wheel
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q 'vllm==0.33.0'
	$(VLLM_PY) -m pip install -q '$(WHEEL)[conformance]' 'pytest>=8' pytest-benchmark
	touch $(VLLM_STAMP)

# Two runs of vLLM's scheduler with the scheduler side of its NIXL connector, which plays
# the suite's moves as vLLM's prefill/decode hand-off (conformance/adapters/vllm_nixl.py):
# first with policy="priority", the one run that has every feature the adapter drives
# (moves, speculative decoding, RequestSpec.priority; what stays not supported is what
# vLLM lacks: rollback, a partial prompt's hand-off, budgets below max_num_seqs); then
# with vLLM's default policy, fcfs, which ignores RequestSpec.priority. Last, the grouped
# KV suite (spec/groups.py) on vLLM's hybrid KVCacheManager, full and sliding-window
# groups over one pool (conformance/adapters/vllm_hybrid_kv.py).
conformance-vllm: wheel $(VLLM_STAMP)
	$(call install_wheel,$(VLLM_PY))
	mkdir -p out
	status=0; \
	$(VLLM_VENV)/bin/refserve conformance --adapter refserve.conformance.adapters.vllm_nixl:make_priority \
		--report out/vllm.json --markdown out/vllm.md || status=1; \
	$(VLLM_VENV)/bin/refserve conformance --adapter refserve.conformance.adapters.vllm_nixl:make \
		--report out/vllm-fcfs.json --markdown out/vllm-fcfs.md || status=1; \
	$(VLLM_VENV)/bin/refserve conformance \
		--grouped-kv-adapter refserve.conformance.adapters.vllm_hybrid_kv:make || status=1; \
	exit $$status

# The same scheduler with its real offloading connector (conformance/adapters/vllm_offload.py:
# a fake worker side completes, delays or fails each load and store as the suite draws or
# the explorer enumerates): the sampled suite, then the small exhaustive scope under each
# load-failure policy (fail, recompute). Exits 1 by design: the suite finds two vLLM
# behaviours, a reload loop at block size 1 and a failed store that blocks every later
# lookup of its chunks (conformance/FINDINGS_vllm.md).
.PHONY: conformance-vllm-offload
conformance-vllm-offload: wheel $(VLLM_STAMP)
	$(call install_wheel,$(VLLM_PY))
	mkdir -p out
	status=0; \
	$(VLLM_VENV)/bin/refserve conformance --adapter refserve.conformance.adapters.vllm_offload:make \
		--report out/vllm-offload.json --markdown out/vllm-offload.md || status=1; \
	$(VLLM_VENV)/bin/refserve conformance --exhaustive --scope small \
		--adapter refserve.conformance.adapters.vllm_offload:make \
		--report out/explore-vllm-offload.json || status=1; \
	$(VLLM_VENV)/bin/refserve conformance --exhaustive --scope small \
		--adapter refserve.conformance.adapters.vllm_offload:make_recompute \
		--report out/explore-vllm-offload-recompute.json || status=1; \
	exit $$status

# The pytest-benchmark suites (out/bench-pytest.json); the migration bench, a move with the
# K/V against a recompute per context length, in a JSON of its own (out/bench-migration.json,
# its own table); then refserve's full CPU step, the
# bulk path (persistent batch) against the reference loop, each in its own worker process,
# rounds interleaved, every worker on one CPU (--no-pin to let the OS move them), prefix
# caching off and on (out/bench-step.json); then the Python heap per running request
# (out/bench-memory.json). Code: conformance/bench/. Last, the fresh JSON replaces the
# committed inputs in docs/bench/ and docs/BENCHMARKS.md is rendered from them (figures
# are never typed by hand; tests/repo/test_benchmarks_doc.py keeps the two in step).
BENCH_REPORT = $(PY) -m refserve.conformance.bench.report --out docs/BENCHMARKS.md docs/bench/*.json

bench: $(STAMP)
	mkdir -p out docs/bench
	$(PY) -m pytest tests/bench --benchmark-only --benchmark-columns=min,median,mean,rounds \
		--benchmark-json out/bench-pytest.json -p no:cacheprovider \
		--ignore=tests/bench/test_migration_bench.py
	$(PY) -m pytest tests/bench/test_migration_bench.py --benchmark-only \
		--benchmark-json out/bench-migration.json -p no:cacheprovider
	$(PY) -m refserve.conformance.bench.peers --engines ref ref-loop --only steps \
		--json out/bench-step.json --markdown out/bench-step.md
	$(PY) -m refserve.conformance.bench.memory --json out/bench-memory.json --markdown out/bench-memory.md
	cp out/bench-pytest.json out/bench-migration.json out/bench-step.json out/bench-memory.json docs/bench/
	$(BENCH_REPORT)

# refserve, nano-vllm-fork and vLLM scheduler steps side by side through the adapters'
# engines (conformance/bench/; not in `make test`): one worker per engine in its own venv
# (the two venvs of conformance-nanovllm and conformance-vllm), rounds interleaved, every
# worker on one CPU. Writes out/bench-peers.json and out/bench-peers.md; exit 1 if an
# engine could not run, and then docs/bench/ keeps the last complete run.
.PHONY: bench-peers bench-report
bench-peers: $(STAMP) wheel $(NANO_STAMP) $(VLLM_STAMP)
	$(call install_wheel,$(NANO_PY))
	$(call install_wheel,$(VLLM_PY))
	mkdir -p out docs/bench
	$(PY) -m refserve.conformance.bench.peers --json out/bench-peers.json --markdown out/bench-peers.md
	cp out/bench-peers.json docs/bench/
	$(BENCH_REPORT)

# The simulator against refserve serve (1 and 2 replicas, chat trace below the knee):
# about two minutes. Writes out/bench-simfit.json, copies it into docs/bench/.
.PHONY: bench-simfit
bench-simfit: $(STAMP)
	mkdir -p out docs/bench
	$(PY) -m refserve.conformance.bench.simfit --json out/bench-simfit.json --replicas 1,2 --rate 4 --duration 60 --slo-ttft-ms 100 --slo-tpot-ms 20
	cp out/bench-simfit.json docs/bench/
	$(BENCH_REPORT)

# The soak (conformance/bench/soak.py; docs/CLUSTER.md, "Soak"; not in `make test`, whose pytest
# stage runs a 20-second one): `refserve serve --replicas 2 --fault-endpoints` under
# SOAK_S seconds of open-loop load with replica kills, disconnects, aborts and bad
# requests; exit 1, and docs/bench/ untouched, if a promise broke. Its JSON replaces
# docs/bench/soak.json and docs/BENCHMARKS.md is rendered again.
SOAK_S ?= 600
SOAK_BACKEND ?= inprocess
.PHONY: soak
soak: $(STAMP)
	mkdir -p out docs/bench
	$(PY) -m refserve.conformance.bench.soak --duration $(SOAK_S) --backend $(SOAK_BACKEND) --json out/soak.json
	cp out/soak.json docs/bench/
	$(BENCH_REPORT)

# docs/BENCHMARKS.md again from the JSON in docs/bench/, measuring nothing.
bench-report: $(STAMP)
	$(BENCH_REPORT)

# Long Hypothesis runs for local use.
deep: $(STAMP)
	HYPOTHESIS_PROFILE=deep $(PY) -m pytest -p no:cacheprovider tests

clean:
	rm -rf $(VENV) .hypothesis .mypy_cache .ruff_cache .benchmarks

# On a CUDA machine: the kernel tests compiled, plus the full grid report (every case in
# its own worker run, fp32/fp16/bf16; docs/KERNELS.md). With gpu-bench: < 10 min on one GPU.
# The link tree goes first on PYTHONPATH, so the targets run where refserve is not installed.
GPU_ENV = PYTHONPATH=$(CURDIR)/$(TREE)$${PYTHONPATH:+:$$PYTHONPATH}
gpu-check: $(STAMP) tree
	mkdir -p out
	$(GPU_ENV) $(PY) -m pytest -p no:cacheprovider tests/kernels -q
	$(GPU_ENV) $(PY) -m refserve.cli.main check-kernel refserve.kernels:paged_attention \
		--timeout 120 --json out/gpu_grid.json --jsonl out/gpu_grid.jsonl

# On a CUDA machine: decode and mixed batches at 1k-128k context, fp16/bf16, block 16:
# achieved HBM bandwidth vs a measured device copy, ratios to SDPA and FlashInfer
# (if installed), one JSON (docs/KERNELS.md, "GPU benchmark"). Exits 2 without CUDA.
# The JSON replaces docs/bench/gpu-bench.json and docs/BENCHMARKS.md is rendered again.
# On a machine whose own python3 holds CUDA torch and Triton (no venv, no network):
#   make -o $(STAMP) PY=python3 gpu-check gpu-bench
gpu-bench: $(STAMP) tree
	mkdir -p out docs/bench
	$(GPU_ENV) $(PY) -m refserve.kernels.bench --json out/gpu_bench.json
	cp out/gpu_bench.json docs/bench/gpu-bench.json
	$(GPU_ENV) $(BENCH_REPORT)

# Mutation testing (mutmut 3, config in pyproject.toml; docs/MUTATION.md). mutmut names a
# module by its path, so it runs in the link tree, beside links to the tests and the
# config; its mutants live in $(TREE)/mutants/ (the real sources are never touched) and
# its verdicts are cached there, so an interrupted run picks up where it stopped. The
# run's JSON goes to docs/mutation/ and docs/MUTATION.md is rendered from every run there
# (figures are never typed by hand: tests/repo/test_mutation_doc.py keeps the two in
# step). `make mutation` runs every mutant (hours on two cores); `make mutation-sample`
# a uniform sample of MUTATION_N of the modules MUTATION_MODULES names (all: empty).
MUTATION_N ?= 150
MUTATION_SEED ?= 1
MUTATION_MODULES ?=
MUTATION_JSON ?= docs/mutation/sample.json
MUTATION_RUN = cd $(TREE) && HYPOTHESIS_PROFILE=ci $(CURDIR)/$(VENV)/bin/python -m refserve.conformance.mutation.run \
	--reasons $(CURDIR)/docs/mutation/reasons.txt --max-children 1
MUTATION_REPORT = $(PY) -m refserve.conformance.mutation.report --out docs/MUTATION.md docs/mutation/*.json
.PHONY: mutation mutation-sample mutation-report mutation-setup
mutation-setup: $(STAMP) tree
	$(PY) -m pip install -q 'mutmut==3.8.1'
	ln -sfn $(CURDIR)/tests $(TREE)/tests
	ln -sf $(CURDIR)/pyproject.toml $(TREE)/pyproject.toml

mutation: mutation-setup
	$(MUTATION_RUN) --out $(CURDIR)/docs/mutation/every.json --title "Every mutant of the scope"
	$(MUTATION_REPORT)

mutation-sample: mutation-setup
	$(MUTATION_RUN) --out $(CURDIR)/$(MUTATION_JSON) --sample $(MUTATION_N) \
		--seed $(MUTATION_SEED) --modules $(MUTATION_MODULES) \
		--title "A uniform sample of $(MUTATION_N) mutants"
	$(MUTATION_REPORT)

# docs/MUTATION.md again from the JSON in docs/mutation/, measuring nothing.
mutation-report: $(STAMP)
	$(MUTATION_REPORT)

# The exhaustive explorer through the adapter protocol on the third-party engines (each
# in its own virtualenv, as for conformance-nanovllm / conformance-vllm; not in
# `make test`): every state of the small scope (small-unchunked for nano-vllm, which
# cannot chunk a prompt), replayed from a fresh adapter per state.
# Exits 1 when a counterexample is found; findings: conformance/FINDINGS_*.md.
.PHONY: explore-nanovllm explore-vllm
explore-nanovllm: wheel $(NANO_STAMP)
	$(call install_wheel,$(NANO_PY))
	mkdir -p out/explore-nanovllm
	$(NANO_VENV)/bin/refserve conformance --exhaustive --scope small-unchunked \
		--adapter refserve.conformance.adapters.nanovllm:make --report out/explore-nanovllm.json \
		--counterexamples out/explore-nanovllm

explore-vllm: wheel $(VLLM_STAMP)
	$(call install_wheel,$(VLLM_PY))
	mkdir -p out/explore-vllm
	$(VLLM_VENV)/bin/refserve conformance --exhaustive --scope small \
		--adapter refserve.conformance.adapters.vllm:make --report out/explore-vllm.json \
		--counterexamples out/explore-vllm

# SGLang 0.5.23's radix prefix cache (RadixCache) and its token-to-KV allocator, driven on
# the CPU through the KV-manager protocol by conformance/adapters/sglang_kv.py (no model,
# no GPU; findings: conformance/FINDINGS_sglang.md). SGLang pins torch==2.14.1 with CUDA
# wheels and some eighty packages, so it lives in its own virtualenv, never in $(VENV) and
# never in `make test`, and is installed with --no-deps: torch==2.13.0 first (the CPU wheel
# on local disk), refserve's wheel with its `conformance` extra, then only what importing
# sglang.srt.mem_cache really runs: numpy, triton (module-level `import triton`; its jit
# decorators need no GPU), transformers and kernels (imported by SGLang's model configs),
# and small pure-Python packages. Seven modules SGLang imports at module level but its
# cache never calls (zmq, torchvision, IPython, tvm_ffi, sentencepiece, compressed_tensors,
# gguf) get stand-ins: SGLANG_STANDINS below, written into the venv's site-packages with a
# .pth line that installs it. An `import` of one of them gets an empty module whose names
# are placeholder classes that raise when used; an "is it installed?" probe
# (importlib.util.find_spec, as transformers makes) gets no, so no library takes a
# stand-in for the real package. The adapter builds SGLang's own request (`Req`) to derive
# a request's radix namespace; its module imports the OpenAI API types, so SGLANG_REQ_DEPS
# (SGLang's pins: openai==2.8.0, partial_json_parser) are installed too, by a stamp of
# their own so that a venv built before them gets them. The run exits 1 when the suite
# finds failures, and does by design: SGLang 0.5.23 keys a LoRA request's radix namespace
# by the caller's key and the adapter's id joined end to end (sglang#24638, unfixed;
# conformance/FINDINGS_sglang.md), which the key-namespace scenarios find.
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_REQ_STAMP := $(SGLANG_VENV)/.installed-req
SGLANG_REQ_DEPS := 'openai==2.8.0' partial_json_parser
SGLANG_DEPS := numpy packaging requests tqdm pydantic pillow starlette aiohttp \
	'transformers==5.19.0' 'kernels>=0.14.1,<0.15' triton orjson psutil pybase64 msgspec dill
define SGLANG_STANDINS
"""Stand-ins for modules SGLang imports at module level but its KV cache never calls."""
import importlib.abc, importlib.machinery, sys, types
NAMES = {"zmq", "torchvision", "IPython", "tvm_ffi", "sentencepiece", "compressed_tensors", "gguf"}
class _Meta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Meta(attr, (_Missing,), {"__module__": cls.__module__})
class _Missing(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is a stand-in")
class _StandIn(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _Meta(attr, (_Missing,), {"__module__": self.__name__})
        setattr(self, attr, value)
        return value
def _probe():
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename in ("<frozen importlib.util>",) or f.f_code.co_filename.endswith("importlib/util.py"):
            return True
        if f.f_code.co_name == "_find_and_load_unlocked":
            return False
        f = f.f_back
    return False
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in NAMES and not _probe():
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module
    def exec_module(self, module):
        pass
sys.meta_path.append(_Finder())
endef
# Written by the venv's own python: its site-packages, the module, and the .pth line that
# imports it at start-up.
SGLANG_WRITE_STANDINS := import os, sysconfig; d = sysconfig.get_paths()['purelib']; \
	open(os.path.join(d, '_sglang_standins.py'), 'w').write(os.environ['SGLANG_STANDINS'] + '\n'); \
	open(os.path.join(d, '_sglang_standins.pth'), 'w').write('import _sglang_standins\n')
export SGLANG_STANDINS SGLANG_WRITE_STANDINS

$(SGLANG_STAMP): pyproject.toml | wheel
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q torch==2.13.0
	$(SGLANG_PY) -m pip install -q '$(WHEEL)[conformance]' 'pytest>=8' pytest-benchmark
	$(SGLANG_PY) -m pip install -q --no-deps 'sglang==0.5.23'
	$(SGLANG_PY) -m pip install -q $(SGLANG_DEPS)
	$(SGLANG_PY) -c "$$SGLANG_WRITE_STANDINS"
	touch $(SGLANG_STAMP)

$(SGLANG_REQ_STAMP): $(SGLANG_STAMP)
	$(SGLANG_PY) -m pip install -q $(SGLANG_REQ_DEPS)
	touch $(SGLANG_REQ_STAMP)

.PHONY: conformance-sglang
conformance-sglang: wheel $(SGLANG_REQ_STAMP)
	$(call install_wheel,$(SGLANG_PY))
	mkdir -p out
	$(SGLANG_VENV)/bin/refserve conformance --kv-adapter refserve.conformance.adapters.sglang_kv:make_kv \
		--report out/sglang-kv.json --markdown out/sglang-kv.md

# lmdeploy 0.18.0's PyTorch-engine paging scheduler (Scheduler, its block manager, block
# trie and eviction helper), driven on the CPU by conformance/adapters/lmdeploy.py (no
# model, no GPU). The wheel pins torch<=2.12.1 and some fifty packages for its serving,
# TurboMind and vision paths, so it lives in its own virtualenv, never in $(VENV) and never
# in `make test`, and is installed with --no-deps: torch==2.13.0 first (the CPU wheel on
# local disk; the paging code only uses torch.profiler and Tensor type checks), refserve's
# wheel with its `conformance` extra, then only what the paging modules import at module
# level: numpy, pydantic (lmdeploy.messages), transformers (lmdeploy.utils), requests,
# pillow and pybase64 (lmdeploy.vl, reached through pytorch.multimodal), psutil
# (lmdeploy.pytorch.utils). The adapter imports them without running lmdeploy/__init__.py
# (pipeline, serving, mmengine) and with one stand-in module, the model agent: its
# docstring says why. The run exits 1 when the suite finds failures; findings:
# conformance/FINDINGS_lmdeploy.md.
LMDEPLOY_VENV := .venv-lmdeploy
LMDEPLOY_PY := $(LMDEPLOY_VENV)/bin/python
LMDEPLOY_STAMP := $(LMDEPLOY_VENV)/.installed
LMDEPLOY_DEPS := numpy pydantic 'transformers>=4.48' requests pillow pybase64 psutil

$(LMDEPLOY_STAMP): pyproject.toml | wheel
	test -x $(LMDEPLOY_PY) || $(PYTHON) -m venv $(LMDEPLOY_VENV)
	$(LMDEPLOY_PY) -m pip install -q --upgrade pip
	$(LMDEPLOY_PY) -m pip install -q torch==2.13.0
	$(LMDEPLOY_PY) -m pip install -q '$(WHEEL)[conformance]' 'pytest>=8' pytest-benchmark
	$(LMDEPLOY_PY) -m pip install -q --no-deps 'lmdeploy==0.18.0'
	$(LMDEPLOY_PY) -m pip install -q $(LMDEPLOY_DEPS)
	touch $(LMDEPLOY_STAMP)

.PHONY: conformance-lmdeploy
conformance-lmdeploy: wheel $(LMDEPLOY_STAMP)
	$(call install_wheel,$(LMDEPLOY_PY))
	mkdir -p out
	$(LMDEPLOY_VENV)/bin/refserve conformance --adapter refserve.conformance.adapters.lmdeploy:make \
		--report out/lmdeploy.json --markdown out/lmdeploy.md

# The corpus of real bugs (docs/CORPUS.md; entries: conformance/corpus/catalogue.py). Each
# engine's entries run in that engine's virtualenv, buggy and clean side, and write one
# JSON into docs/corpus/; docs/CORPUS.md is then rendered from all of them (never typed:
# tests/repo/test_corpus_doc.py keeps the two in step). The models of bugs in engines
# that cannot run here (conformance/corpus/models/) need no third-party engine: they run
# in $(VENV), into docs/corpus/models.json. Exits 1 when an entry is not
# caught or its clean side is not clean, after writing everything.
CORPUS_REPORT = $(PY) -m refserve.conformance.corpus.report --out docs/CORPUS.md docs/corpus/*.json

.PHONY: corpus corpus-report
corpus: wheel $(STAMP) $(NANO_STAMP) $(VLLM_STAMP) $(SGLANG_REQ_STAMP) $(LMDEPLOY_STAMP)
	$(call install_wheel,$(NANO_PY))
	$(call install_wheel,$(VLLM_PY))
	$(call install_wheel,$(SGLANG_PY))
	$(call install_wheel,$(LMDEPLOY_PY))
	mkdir -p docs/corpus
	status=0; \
	$(NANO_VENV)/bin/refserve conformance --corpus --engine nano-vllm \
		--report docs/corpus/nano-vllm.json || status=1; \
	$(VLLM_VENV)/bin/refserve conformance --corpus --engine vllm \
		--report docs/corpus/vllm.json || status=1; \
	$(SGLANG_VENV)/bin/refserve conformance --corpus --engine sglang \
		--report docs/corpus/sglang.json || status=1; \
	$(LMDEPLOY_VENV)/bin/refserve conformance --corpus --engine lmdeploy \
		--report docs/corpus/lmdeploy.json || status=1; \
	$(VENV)/bin/refserve conformance --corpus --reproduction model \
		--report docs/corpus/models.json || status=1; \
	$(CORPUS_REPORT) && exit $$status

corpus-report: $(STAMP)
	$(CORPUS_REPORT)
