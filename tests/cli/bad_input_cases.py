"""The bad-input table of ``test_bad_input.py``: hostile command lines, traces, config.json
files and output paths, each with the words its one-line error must contain.

A case's argv may hold ``{ws}``, replaced by the case's scratch folder, which always has
``ok.jsonl`` (a valid trace), ``afile`` (a regular file), ``adir/`` (a folder) and, for
model cases, ``ckpt/`` (a tiny random checkpoint: see :func:`write_checkpoint`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from refserve.model.config import ModelConfig
from refserve.model.weights import random_state_dict

OK_LINE = '{"id": "a", "arrival_ms": 0, "prompt_len": 4, "output_len": 2}'
# Paths no user can write: /proc/1 refuses new files even to root (chmod does not stop
# root, and these tests may run as root).
UNWRITABLE = "/proc/1/refserve-out"


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    words: str  # the message must contain these (the field, the option or the file)
    code: int = 2
    # Paths (under the scratch folder) that must not exist afterwards.
    outputs: tuple[str, ...] = ()
    trace: str | bytes | None = None  # written to {ws}/t.jsonl
    config: Mapping[str, object] | str | bytes | None = None  # {ws}/ckpt/config.json
    # (module attribute, value) pairs set for the case only, e.g. a smaller limit.
    patches: tuple[tuple[str, object], ...] = ()
    env_unset: tuple[str, ...] = ()
    # Model cases: one tensor of the checkpoint set to a value (NaN, inf), or the
    # safetensors file replaced by these bytes.
    bad_tensor: tuple[str, float] | None = None
    weights_bytes: bytes | None = None
    message: str = "refserve: error: "
    # A case that is only bad where CUDA is missing (--device cuda).
    skip_if_cuda: bool = False


# --------------------------------------------------------------------- the tiny model
#: A tiny Llama config.json: vocab above the byte tokenizer's 259 ids, GQA 4:2.
BASE_CONFIG: dict[str, object] = {
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: A one-layer hybrid Qwen2 config (a sliding layer of window 8), for the window cases;
#: each breaks one field and is refused while reading config.json, before the weights.
QWEN2_WINDOW: dict[str, object] = {
    "model_type": "qwen2",
    "use_sliding_window": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention"],
}


def checkpoint_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The seeded random weights the engine tests use (``random_state_dict``), shaped by
    :data:`BASE_CONFIG`."""
    return random_state_dict(ModelConfig.from_hf(BASE_CONFIG), seed)


def write_checkpoint(
    directory: Path,
    config: Mapping[str, object] | str | bytes | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    weights_file: Path | None = None,
) -> Path:
    """A local Hugging Face-style checkpoint: ``config.json`` (the base one, a patch of
    it, or raw text/bytes) and ``model.safetensors`` (``tensors``, or a link to
    ``weights_file``, which saves writing the same weights for every case)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if config is None or isinstance(config, Mapping):
        text = json.dumps({**BASE_CONFIG, **(config or {})})
        (directory / "config.json").write_text(text, encoding="utf-8")
    elif isinstance(config, bytes):
        (directory / "config.json").write_bytes(config)
    else:
        (directory / "config.json").write_text(config, encoding="utf-8")
    target = directory / "model.safetensors"
    if weights_file is not None:
        target.symlink_to(weights_file)
    else:
        save_file(dict(tensors or checkpoint_tensors()), str(target))
    return directory


# --------------------------------------------------------------------- helpers
def _sim(*extra: str) -> tuple[str, ...]:
    """simulate the valid trace with a JSON and a timeline output, plus ``extra``."""
    return (
        "simulate",
        "{ws}/ok.jsonl",
        "--quiet",
        "--json",
        "{ws}/out/run.json",
        "--timeline",
        "{ws}/out/run.html",
        *extra,
    )


SIM_OUT = ("out/run.json", "out/run.html")


def opt(option: str, value: str, words: str, case_id: str | None = None) -> Case:
    """A simulate option case."""
    return Case(case_id or f"sim{option}={value[:20]}", _sim(option, value), words, outputs=SIM_OUT)


def trace(case_id: str, text: str | bytes, words: str, *extra: str, **kw: object) -> Case:
    argv = ("simulate", "{ws}/t.jsonl", "--quiet", "--json", "{ws}/out/run.json", *extra)
    return Case(
        f"trace-{case_id}",
        argv,
        words,
        outputs=("out/run.json",),
        trace=text,
        **kw,  # type: ignore[arg-type]
    )


def line(**fields: object) -> str:
    """A trace line: the valid one with ``fields`` replaced (``None`` removes a field)."""
    obj: dict[str, object] = {"id": "b", "arrival_ms": 0, "prompt_len": 4, "output_len": 2}
    for k, v in fields.items():
        if v is None:
            obj.pop(k, None)
        else:
            obj[k] = v
    return json.dumps(obj)


def raw_line(**fields: str) -> str:
    """A trace line whose values are raw JSON text (NaN, Infinity, 5,000 digits...)."""
    obj = {"id": '"b"', "arrival_ms": "0", "prompt_len": "4", "output_len": "2", **fields}
    return "{" + ", ".join(f'"{k}": {v}' for k, v in obj.items()) + "}"


def gen(*extra: str) -> tuple[str, ...]:
    return ("generate", "--prompt", "Hi", "--max-tokens", "2", *extra)


MODEL_ARGV = ("generate", "--model", "{ws}/ckpt", "--prompt-ids", "1,5", "--max-tokens", "2")


def model(case_id: str, config: Mapping[str, object] | str | bytes, words: str) -> Case:
    return Case(f"config-{case_id}", MODEL_ARGV, words, config=config)


def weights(case_id: str, words: str, **kw: object) -> Case:
    return Case(f"weights-{case_id}", MODEL_ARGV, words, config={}, **kw)  # type: ignore[arg-type]


def cmp(*extra: str) -> tuple[str, ...]:
    return (
        "compare",
        "--quick",
        "--traces",
        "chat",
        "--policies",
        "fcfs",
        "--no-progress",
        "--out",
        "{ws}/cmp",
        *extra,
    )


CMP_OUT = ("cmp/report.json", "cmp/report.md")
KERNEL = "refserve.kernels.oracle:paged_attention"
DEEP = "[" * 200_000 + "]" * 200_000
DIGITS_5000 = "7" * 5000
DIGITS_4000 = "7" * 4000
DIGITS_400 = "9" * 400


# --------------------------------------------------------------------- the table
SIMULATE_OPTIONS: list[Case] = [
    opt("--num-blocks", "100000000", "--num-blocks"),
    opt("--num-blocks", "-5", "num_blocks"),
    opt("--num-blocks", "0", "num_blocks"),
    opt("--num-blocks", "x", "--num-blocks"),
    opt("--num-blocks", "1e3", "--num-blocks"),
    opt("--num-blocks", DIGITS_5000, "--num-blocks", "sim--num-blocks=5000-digits"),
    opt("--block-size", "0", "block_size"),
    opt("--block-size", "100000", "--block-size"),
    opt("--max-num-seqs", "0", "max_num_seqs"),
    opt("--max-num-seqs", "2000000", "--max-num-seqs"),
    opt("--max-num-batched-tokens", "-4", "max_num_batched_tokens"),
    opt("--max-num-batched-tokens", "1000000000000", "--max-num-batched-tokens"),
    opt("--max-model-len", "0", "max_model_len"),
    opt("--max-model-len", "1000000000000", "--max-model-len"),
    opt("--max-model-len", "2", "max_model_len", "sim--max-model-len-shorter-than-prompt"),
    opt("--watermark-blocks", "-1", "watermark_blocks"),
    opt("--watermark-blocks", "5000", "watermark_blocks"),
    opt("--num-host-blocks", "-1", "num_host_blocks"),
    opt("--num-host-blocks", "100000000", "--num-host-blocks"),
    opt("--kv-bytes-per-token", "0", "kv_bytes_per_token"),
    opt("--kv-bytes-per-token", "-1", "kv_bytes_per_token"),
    opt("--kv-bytes-per-token", str(1 << 41), "--kv-bytes-per-token"),
    opt("--swap-link-gbps", "nan", "--swap-link-gbps"),
    opt("--swap-link-gbps", "inf", "--swap-link-gbps"),
    opt("--swap-link-gbps", "0", "--swap-link-gbps"),
    opt("--swap-link-gbps", "-1", "--swap-link-gbps"),
    opt("--preemption-mode", "swap", "num_host_blocks"),
    Case(
        "sim-auto-without-kv-bytes",
        _sim("--preemption-mode", "auto", "--num-host-blocks", "4"),
        "swap_cost",
        outputs=SIM_OUT,
    ),
    opt("--preemption-mode", "bogus", "--preemption-mode"),
    opt("--policy", "bogus", "--policy"),
    opt("--admission", "bogus", "--admission"),
    opt("--cost", "", "cost model"),
    opt("--cost", "2+0.5Q", "'0.5Q'"),
    opt("--cost", "2+-P", "'-P'"),
    opt("--cost", "1e5P", "'1e5P'"),
    opt("--cost", "2++P", "cost model"),
    opt("--cost", "nan", "'nan'"),
    opt("--cost", "inf+P", "'inf'"),
    opt("--cost", "2000000", "1e+06"),
    opt("--cost", DIGITS_400 + "+P", "cost model", "sim--cost=400-digits"),
    opt("--cost", "2+" + DIGITS_400 + "P", "cost model", "sim--cost=400-digit-P"),
    # The multi-level queue's knobs: refused whatever the policy, and with it.
    opt("--mlfq-queues", "0", "num_queues"),
    opt("--mlfq-queues", "-2", "num_queues"),
    opt("--mlfq-queues", "17", "--mlfq-queues"),
    opt("--mlfq-queues", "x", "--mlfq-queues"),
    opt("--mlfq-queues", "2.5", "--mlfq-queues"),
    opt("--mlfq-quantum-ms", "0", "--mlfq-quantum-ms"),
    opt("--mlfq-quantum-ms", "-4", "--mlfq-quantum-ms"),
    opt("--mlfq-quantum-ms", "nan", "--mlfq-quantum-ms"),
    opt("--mlfq-quantum-ms", "inf", "--mlfq-quantum-ms"),
    opt("--mlfq-quantum-ms", "2000000", "--mlfq-quantum-ms"),
    opt("--mlfq-quantum-ms", "x", "--mlfq-quantum-ms"),
    opt("--mlfq-growth", "0.5", "--mlfq-growth"),
    opt("--mlfq-growth", "17", "--mlfq-growth"),
    opt("--mlfq-growth", "nan", "--mlfq-growth"),
    opt("--mlfq-growth", "-inf", "--mlfq-growth"),
    opt("--mlfq-starvation-steps", "0", "starvation_steps"),
    opt("--mlfq-starvation-steps", "-3", "starvation_steps"),
    opt("--mlfq-starvation-steps", "1.5", "--mlfq-starvation-steps"),
    opt("--mlfq-starvation-steps", str(1 << 31), "--mlfq-starvation-steps"),
    opt(
        "--mlfq-starvation-steps",
        DIGITS_5000,
        "--mlfq-starvation-steps",
        "sim--mlfq-starvation-steps=5000-digits",
    ),
    Case(
        "sim-mlfq-queues-0-under-mlfq",
        _sim("--policy", "mlfq", "--mlfq-queues", "0"),
        "num_queues",
        outputs=SIM_OUT,
    ),
    Case(
        "sim-mlfq-growth-under-mlfq",
        _sim("--policy", "mlfq", "--mlfq-growth", "0"),
        "--mlfq-growth",
        outputs=SIM_OUT,
    ),
    # The KV layer groups: each part named.
    opt("--kv-groups", "", "layout part 1"),
    opt("--kv-groups", "full,sliding:8", "layout part 2 ('sliding:8')"),
    opt("--kv-groups", "full,window:0", "a window group needs a window >= 1"),
    opt("--kv-groups", "full,window:-4", "layout part 2"),
    opt("--kv-groups", "full,compressed:1", "a compressed group needs a ratio >= 2"),
    opt("--kv-groups", "window:8,full", "kv_groups[0] must be a full attention group"),
    opt("--kv-groups", "full,window:" + "9" * 400, "--kv-groups", "sim--kv-groups=400-digits"),
    opt("--max-steps", "0", "--max-steps"),
    opt("--max-steps", "-5", "--max-steps"),
    opt("--max-steps", "1000000000", "--max-steps"),
    opt("--max-steps", "x", "--max-steps"),
    Case("sim-unknown-option", _sim("--bogus"), "--bogus", outputs=SIM_OUT),
    Case("sim-no-trace", ("simulate",), "trace"),
    Case("sim-missing-trace", ("simulate", "{ws}/absent.jsonl"), "absent.jsonl"),
    Case("sim-trace-is-dir", ("simulate", "{ws}/adir"), "is a directory"),
]

TRACES: list[Case] = [
    trace("arrival-nan", raw_line(arrival_ms="NaN"), "'arrival_ms'"),
    trace("arrival-infinity", OK_LINE + "\n" + raw_line(arrival_ms="Infinity"), ":2: 'arrival_ms'"),
    trace("arrival-minus-infinity", raw_line(arrival_ms="-Infinity"), "'arrival_ms'"),
    trace("arrival-1e999", raw_line(arrival_ms="1e999"), "'arrival_ms'"),
    trace("arrival-1e13", raw_line(arrival_ms="1e13"), "'arrival_ms'"),
    trace("arrival-400-digits", raw_line(arrival_ms=DIGITS_400), "'arrival_ms'"),
    trace("arrival-5000-digits", raw_line(arrival_ms=DIGITS_5000), "number"),
    trace("arrival-string", line(arrival_ms="5"), "'arrival_ms'"),
    trace("arrival-bool", line(arrival_ms=True), "'arrival_ms'"),
    trace("arrival-negative", line(arrival_ms=-1), "'arrival_ms'"),
    trace(
        "arrival-out-of-order",
        OK_LINE.replace('"arrival_ms": 0', '"arrival_ms": 9') + "\n" + line(arrival_ms=1),
        ":2: arrival_ms 1 is before",
    ),
    trace("prompt-len-10e12", line(prompt_len=10**12), "'prompt_len'"),
    trace("prompt-len-2e24-plus-1", line(prompt_len=(1 << 24) + 1), "'prompt_len'"),
    trace("prompt-len-4000-digits", raw_line(prompt_len=DIGITS_4000), "'prompt_len'"),
    trace("prompt-len-5000-digits", raw_line(prompt_len=DIGITS_5000), "number"),
    trace("prompt-len-0", line(prompt_len=0), "'prompt_len'"),
    trace("prompt-len-float", line(prompt_len=2.5), "'prompt_len'"),
    trace("prompt-len-nan", raw_line(prompt_len="NaN"), "'prompt_len'"),
    trace("prompt-len-string", line(prompt_len="4"), "'prompt_len'"),
    trace(
        "prompt-over-max-model-len",
        line(prompt_len=100),
        "max_model_len",
        "--max-model-len",
        "50",
    ),
    trace(
        "trace-token-total",
        OK_LINE + "\n" + line(prompt_len=60),
        "prompt tokens",
        patches=(("refserve.sim.trace.MAX_TRACE_TOKENS", 50),),
    ),
    trace(
        "trace-too-large",
        OK_LINE + "\n" + line(id="c") + "\n",
        "MiB",
        patches=(("refserve.sim.trace.MAX_TRACE_BYTES", 64),),
    ),
    trace("output-len-0", line(output_len=0), "'output_len'"),
    trace("output-len-negative", line(output_len=-2), "'output_len'"),
    trace("output-len-10e12", line(output_len=10**12), "'output_len'"),
    trace("output-len-missing", line(output_len=None), "'output_len'"),
    trace("output-len-string", line(output_len="3"), "'output_len'"),
    trace("priority-string", line(priority="hi"), "'priority'"),
    trace("priority-2e40", line(priority=1 << 40), "'priority'"),
    trace("priority-float", line(priority=1.5), "'priority'"),
    trace("tenant-int", line(tenant=3), "'tenant'"),
    trace("tenant-empty", line(tenant=""), "'tenant'"),
    trace("tenant-control-char", line(tenant="\u0007bell"), "'tenant'"),
    trace("tenant-too-long", line(tenant="t" * 300), "'tenant'"),
    trace("id-missing", line(id=None), "'id'"),
    trace("id-int", line(id=5), "'id'"),
    trace("id-empty", line(id=""), "'id'"),
    trace("id-duplicate", OK_LINE + "\n" + line(id="a"), "duplicate request id 'a'"),
    trace("id-lone-surrogate", raw_line(id='"a\\ud800"'), "'id'"),
    trace("id-escape-sequence", line(id="\u001b[31mred"), "'id'"),
    trace("id-newline", line(id="a\nb"), "'id'"),
    trace("id-too-long", line(id="i" * 300), "'id'"),
    trace("unknown-field", line(colour="red"), "unknown field(s) colour"),
    trace("duplicate-key", '{"id": "a", "id": "b", "prompt_len": 4, "output_len": 2}', "'id'"),
    trace("not-an-object-list", "[1, 2]", "expected a JSON object"),
    trace("not-an-object-string", '"a"', "expected a JSON object"),
    trace("not-an-object-null", "null", "expected a JSON object"),
    trace("not-json", "{oops", "not valid JSON"),
    trace("truncated-json", OK_LINE[:-5], "not valid JSON"),
    trace("nul-byte", OK_LINE[:10] + "\x00" + OK_LINE[10:], "not valid JSON"),
    trace("nested-200k", DEEP, "nested too deeply"),
    trace("nested-200k-in-field", raw_line(prompt_token_ids=DEEP), "nested too deeply"),
    trace("both-prompt-kinds", line(prompt_token_ids=[1, 2]), "exactly one of"),
    trace("no-prompt", line(prompt_len=None), "exactly one of"),
    trace("prompt-ids-empty", line(prompt_len=None, prompt_token_ids=[]), "'prompt_token_ids'"),
    trace("prompt-ids-string", line(prompt_len=None, prompt_token_ids="abc"), "'prompt_token_ids'"),
    trace("prompt-ids-negative", line(prompt_len=None, prompt_token_ids=[1, -2]), "bad token"),
    trace("prompt-ids-huge", line(prompt_len=None, prompt_token_ids=[1, 1 << 40]), "bad token"),
    trace("prompt-ids-float", line(prompt_len=None, prompt_token_ids=[1, 1.5]), "bad token"),
    trace("prompt-ids-bool", line(prompt_len=None, prompt_token_ids=[True]), "bad token"),
    trace(
        "prompt-ids-with-group",
        line(prompt_len=None, prompt_token_ids=[1, 2], prefix_group="g"),
        "'prefix_group'",
    ),
    trace("prefix-len-without-group", line(prefix_len=2), "'prefix_len'"),
    trace("prefix-len-too-long", line(prefix_group="g", prefix_len=9), "'prefix_len'"),
    trace("prefix-group-int", line(prefix_group=1), "'prefix_group'"),
    trace(
        "latin-1", '{"id": "caf\xe9", "prompt_len": 4, "output_len": 2}'.encode("latin-1"), ":1:"
    ),
    trace(
        "latin-1-line-3",
        (OK_LINE + "\n\n" + '{"id": "\xe9"}').encode("latin-1"),
        "t.jsonl:3: not UTF-8",
    ),
    trace("utf-16", OK_LINE.encode("utf-16"), "not UTF-8"),
    trace("empty-file", "", "holds no requests"),
    trace("blank-lines-only", "\n\n  \n", "holds no requests"),
]

OUTPUT_PATHS: list[Case] = [
    Case("out-json-is-dir", ("simulate", "seed002", "--json", "{ws}/adir"), "--json"),
    Case("out-json-under-file", ("simulate", "seed002", "--json", "{ws}/afile/x.json"), "afile"),
    Case(
        "out-json-deep-under-file",
        ("simulate", "seed002", "--json", "{ws}/afile/a/b/x.json"),
        "afile",
    ),
    Case("out-json-dev-null", ("simulate", "seed002", "--json", "/dev/null"), "/dev/null"),
    Case("out-json-unwritable", ("simulate", "seed002", "--json", UNWRITABLE), "--json"),
    Case("out-json-empty-name", ("simulate", "seed002", "--json", ""), "--json"),
    Case("out-json-nul-byte", ("simulate", "seed002", "--json", "{ws}/a\x00b"), "--json"),
    Case(
        "out-json-name-too-long", ("simulate", "seed002", "--json", "{ws}/" + "n" * 300), "--json"
    ),
    Case(
        "out-timeline-is-dir",
        ("simulate", "seed002", "--json", "{ws}/out/r.json", "--timeline", "{ws}/adir"),
        "--timeline",
        outputs=("out/r.json",),
    ),
    Case(
        "out-timeline-under-file",
        ("simulate", "seed002", "--timeline", "{ws}/afile/t.html"),
        "--timeline",
    ),
    Case("out-timeline-dev-null", ("simulate", "seed002", "--timeline", "/dev/null"), "/dev/null"),
    Case(
        "out-timeline-unwritable", ("simulate", "seed002", "--timeline", UNWRITABLE), "--timeline"
    ),
    Case("demo-timeline-is-dir", ("demo", "--timeline", "{ws}/adir"), "--timeline"),
    Case("demo-timeline-under-file", ("demo", "--timeline", "{ws}/afile/t.html"), "afile"),
    Case("demo-timeline-dev-null", ("demo", "--timeline", "/dev/null"), "/dev/null"),
    Case("demo-timeline-unwritable", ("demo", "--timeline", UNWRITABLE), "--timeline"),
    Case("compare-out-is-file", cmp("--out", "{ws}/afile"), "--out"),
    Case("compare-out-under-file", cmp("--out", "{ws}/afile/report"), "afile"),
    Case("compare-out-dev-null", cmp("--out", "/dev/null"), "/dev/null"),
    Case("compare-out-unwritable", cmp("--out", UNWRITABLE), "--out"),
    Case("kernel-json-is-dir", ("check-kernel", KERNEL, "--json", "{ws}/adir"), "--json"),
    Case(
        "kernel-json-under-file", ("check-kernel", KERNEL, "--json", "{ws}/afile/k.json"), "afile"
    ),
    Case("kernel-json-dev-null", ("check-kernel", KERNEL, "--json", "/dev/null"), "/dev/null"),
    Case("kernel-json-unwritable", ("check-kernel", KERNEL, "--json", UNWRITABLE), "--json"),
]

GENERATE: list[Case] = [
    Case("gen-device-cuda", gen("--device", "cuda"), "--device", skip_if_cuda=True),
    Case("gen-device-cuda-99", gen("--device", "cuda:99"), "--device"),
    Case("gen-device-bogus", gen("--device", "bogus"), "--device"),
    Case("gen-device-meta", gen("--device", "meta"), "--device"),
    Case("gen-device-empty", gen("--device", ""), "--device"),
    Case("gen-device-negative-index", gen("--device", "cuda:-1"), "--device"),
    Case("gen-device-mps", gen("--device", "mps"), "--device"),
    Case(
        "gen-triton-on-cpu",
        gen("--attention-backend", "triton"),
        "--attention-backend triton",
        env_unset=("TRITON_INTERPRET",),
    ),
    Case("gen-backend-bogus", gen("--attention-backend", "bogus"), "--attention-backend"),
    Case("gen-prompt-lone-surrogate", ("generate", "--prompt", "a\udc80b"), "--prompt"),
    Case("gen-prompt-only-surrogates", ("generate", "--prompt", "\udcff\udcfe"), "--prompt"),
    Case("gen-stop-lone-surrogate", gen("--stop", "x\udc80"), "--stop"),
    Case("gen-prompt-empty", ("generate", "--prompt", ""), "prompt"),
    Case("gen-prompt-ids-empty", ("generate", "--prompt-ids", ""), "prompt"),
    Case("gen-prompt-ids-letter", ("generate", "--prompt-ids", "1,x"), "--prompt-ids"),
    Case("gen-prompt-ids-empty-item", ("generate", "--prompt-ids", "1,,2"), "--prompt-ids"),
    Case("gen-prompt-ids-negative", ("generate", "--prompt-ids", "-1"), "token"),
    Case("gen-prompt-ids-outside-vocab", ("generate", "--prompt-ids", "99999"), "99999"),
    Case("gen-prompt-ids-5000-digits", ("generate", "--prompt-ids", DIGITS_5000), "--prompt-ids"),
    Case("gen-prompt-and-ids", ("generate", "--prompt", "a", "--prompt-ids", "1"), "--prompt-ids"),
    Case("gen-no-prompt", ("generate",), "--prompt"),
    Case("gen-max-tokens-negative", gen("--max-tokens", "-5"), "max_tokens"),
    Case("gen-max-tokens-0", gen("--max-tokens", "0"), "max_tokens"),
    Case("gen-max-tokens-10e12", gen("--max-tokens", "1000000000000"), "--max-tokens"),
    Case("gen-max-tokens-letter", gen("--max-tokens", "x"), "--max-tokens"),
    Case("gen-n-0", gen("--n", "0"), "n must"),
    Case("gen-n-negative", gen("--n", "-5"), "n must"),
    Case("gen-n-5000", gen("--n", "5000"), "--n"),
    Case("gen-temperature-nan", gen("--temperature", "nan"), "temperature"),
    Case("gen-temperature-inf", gen("--temperature", "inf"), "temperature"),
    Case("gen-temperature-negative", gen("--temperature", "-1"), "temperature"),
    Case("gen-top-p-nan", gen("--top-p", "nan"), "top_p"),
    Case("gen-top-p-0", gen("--top-p", "0"), "top_p"),
    Case("gen-top-p-2", gen("--top-p", "2"), "top_p"),
    Case("gen-top-k-negative", gen("--top-k", "-5"), "top_k"),
    Case("gen-seed-negative", gen("--seed", "-5"), "seed"),
    Case("gen-stop-empty", gen("--stop", ""), "stop"),
    Case("gen-model-missing", gen("--model", "{ws}/absent"), "absent"),
    Case("gen-model-is-file", gen("--model", "{ws}/afile"), "afile"),
    Case("gen-model-no-weights", gen("--model", "{ws}/adir"), "config.json"),
    Case("gen-speculative-unknown", gen("--speculative", "medusa"), "--speculative"),
    Case("gen-speculative-draft-empty", gen("--speculative", "draft:"), "draft:DIR"),
    Case("gen-speculative-draft-missing", gen("--speculative", "draft:{ws}/absent"), "absent"),
    Case("gen-speculative-draft-file", gen("--speculative", "draft:{ws}/afile"), "afile"),
    Case("gen-speculative-draft-no-weights", gen("--speculative", "draft:{ws}/adir"), "config"),
    Case(
        "gen-speculative-k-0",
        gen("--speculative", "ngram", "--num-speculative-tokens", "0"),
        "num-speculative-tokens",
    ),
    Case(
        "gen-speculative-k-5000",
        gen("--speculative", "ngram", "--num-speculative-tokens", "5000"),
        "--num-speculative-tokens",
    ),
    # The scheduler's options (simulate's and serve's) and --migrate-every.
    Case("gen-block-size-0", gen("--block-size", "0"), "block_size"),
    Case("gen-block-size-letter", gen("--block-size", "x"), "--block-size"),
    Case("gen-num-blocks-10e8", gen("--num-blocks", "100000000"), "--num-blocks"),
    Case("gen-budget-0", gen("--max-num-batched-tokens", "0"), "max_num_batched_tokens"),
    Case("gen-policy-unknown", gen("--policy", "nope"), "--policy"),
    Case("gen-mlfq-queues-0", gen("--policy", "mlfq", "--mlfq-queues", "0"), "num_queues"),
    Case(
        "gen-mlfq-quantum-nan",
        gen("--policy", "mlfq", "--mlfq-quantum-ms", "nan"),
        "--mlfq-quantum-ms",
    ),
    Case(
        "gen-mlfq-starvation-0",
        gen("--policy", "mlfq", "--mlfq-starvation-steps", "0"),
        "starvation_steps",
    ),
    Case("gen-migrate-every-0", gen("--migrate-every", "0"), "--migrate-every"),
    Case("gen-migrate-every-negative", gen("--migrate-every", "-3"), "--migrate-every"),
    Case("gen-migrate-every-letter", gen("--migrate-every", "k"), "--migrate-every"),
    Case("gen-migrate-every-10e12", gen("--migrate-every", "1000000000000"), "--migrate-every"),
    Case("gen-migrate-every-5000-digits", gen("--migrate-every", DIGITS_5000), "--migrate-every"),
    Case(
        "gen-migration-kv-unknown",
        gen("--migrate-every", "2", "--migration-kv", "copy"),
        "--migration-kv",
    ),
    Case("gen-migration-kv-alone", gen("--migration-kv", "transfer"), "--migrate-every"),
    Case(
        "gen-migration-chunk-blocks-0",
        gen("--migrate-every", "2", "--migration-chunk-blocks", "0"),
        "--migration-chunk-blocks",
    ),
    Case(
        "gen-migration-chunk-blocks-10e8",
        gen("--migrate-every", "2", "--migration-chunk-blocks", "100000000"),
        "--migration-chunk-blocks",
    ),
    Case(
        "gen-migration-chunk-blocks-alone", gen("--migration-chunk-blocks", "1"), "--migrate-every"
    ),
    Case(
        "gen-migration-chunk-blocks-with-recompute",
        gen("--migrate-every", "2", "--migration-kv", "recompute", "--migration-chunk-blocks", "1"),
        "--migration-chunk-blocks",
    ),
    Case(
        "gen-peer-block-size-0",
        gen("--migrate-every", "2", "--peer-block-size", "0"),
        "--peer-block-size",
    ),
    Case(
        "gen-peer-block-size-100000",
        gen("--migrate-every", "2", "--peer-block-size", "100000"),
        "--peer-block-size",
    ),
    Case("gen-peer-block-size-alone", gen("--peer-block-size", "8"), "--migrate-every"),
    Case(
        "gen-migrate-sampled-speculative-recompute",
        gen("--migrate-every", "2", "--speculative", "ngram", "--temperature", "0.8"),
        "--migration-kv auto",
    ),
    Case(
        "gen-migrate-pool-too-small",
        gen("--migrate-every", "2", "--num-blocks", "1", "--block-size", "4", "--max-tokens", "30"),
        "--num-blocks 1",
    ),
]

CONFIGS: list[Case] = [
    model("tie-string-false", {"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    model("tie-int", {"tie_word_embeddings": 0}, "tie_word_embeddings"),
    model("attention-bias-string", {"attention_bias": "true"}, "attention_bias"),
    model("mlp-bias-string", {"mlp_bias": "false"}, "mlp_bias"),
    model("sliding-window-string", {"use_sliding_window": "no"}, "use_sliding_window"),
    model("llama-sliding-window", {"use_sliding_window": True}, "use_sliding_window"),
    model("qwen2-window-zero", {**QWEN2_WINDOW, "sliding_window": 0}, "sliding_window"),
    model("qwen2-window-string", {**QWEN2_WINDOW, "sliding_window": "8"}, "sliding_window"),
    model(
        "qwen2-layer-types-length",
        {**QWEN2_WINDOW, "layer_types": ["sliding_attention"] * 2},
        "layer_types",
    ),
    model(
        "qwen2-layer-kind-unknown",
        {**QWEN2_WINDOW, "layer_types": ["chunked_attention"]},
        "chunked_attention",
    ),
    model("qwen2-layer-types-string", {**QWEN2_WINDOW, "layer_types": "full"}, "layer_types"),
    model(
        "qwen2-sliding-layer-no-window",
        {**QWEN2_WINDOW, "use_sliding_window": False},
        "sliding_window",
    ),
    model("rope-theta-string", {"rope_theta": "10000"}, "rope_theta"),
    model("rope-theta-nan", json.dumps(BASE_CONFIG).replace("10000.0", "NaN"), "rope_theta"),
    model(
        "rope-theta-infinity", json.dumps(BASE_CONFIG).replace("10000.0", "Infinity"), "rope_theta"
    ),
    model("rope-theta-1e999", json.dumps(BASE_CONFIG).replace("10000.0", "1e999"), "rope_theta"),
    model("rope-theta-negative", {"rope_theta": -1}, "rope_theta"),
    model("rope-theta-zero", {"rope_theta": 0}, "rope_theta"),
    model("rope-theta-400-digits", {"rope_theta": int(DIGITS_400)}, "rope_theta"),
    model("rope-parameters-list", {"rope_parameters": []}, "rope_parameters"),
    model("rope-parameters-string", {"rope_parameters": "default"}, "rope_parameters"),
    model("rope-parameters-linear", {"rope_parameters": {"rope_type": "linear"}}, "linear"),
    model(
        "rope-parameters-theta-string",
        {"rope_parameters": {"rope_type": "default", "rope_theta": "x"}},
        "rope_theta",
    ),
    model("rope-scaling-dynamic", {"rope_scaling": {"type": "dynamic"}}, "dynamic"),
    model("eos-list-float", {"eos_token_id": [257.7]}, "eos_token_id"),
    model("eos-string", {"eos_token_id": "2"}, "eos_token_id"),
    model("eos-outside-vocab", {"eos_token_id": 99999}, "eos_token_id"),
    model("eos-bool", {"eos_token_id": True}, "eos_token_id"),
    model("eos-list-bool", {"eos_token_id": [2, False]}, "eos_token_id"),
    model("bos-outside-vocab", {"bos_token_id": 99999}, "bos_token_id"),
    model("bos-float", {"bos_token_id": 1.5}, "bos_token_id"),
    model("bos-negative", {"bos_token_id": -1}, "bos_token_id"),
    model("vocab-string", {"vocab_size": "320"}, "vocab_size"),
    model("vocab-zero", {"vocab_size": 0}, "vocab_size"),
    model(
        "vocab-5000-digits",
        json.dumps(BASE_CONFIG).replace('"vocab_size": 320', f'"vocab_size": {DIGITS_5000}'),
        "number",
    ),
    model("hidden-2e40", {"hidden_size": 1 << 40}, "hidden_size"),
    model("heads-zero", {"num_attention_heads": 0}, "num_attention_heads"),
    model("kv-heads-not-divisor", {"num_key_value_heads": 3}, "num_kv_heads"),
    model("head-dim-odd", {"head_dim": 7}, "head_dim"),
    model("head-dim-string", {"head_dim": "8"}, "head_dim"),
    model("hidden-not-multiple-no-head-dim", {"head_dim": None, "hidden_size": 30}, "head_dim"),
    model("rms-eps-zero", {"rms_norm_eps": 0}, "rms_norm_eps"),
    model("rms-eps-string", {"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    model("max-positions-negative", {"max_position_embeddings": -1}, "max_position_embeddings"),
    model("model-type-gpt2", {"model_type": "gpt2"}, "gpt2"),
    model("model-type-int", {"model_type": 5}, "model_type"),
    model("hidden-act-gelu", {"hidden_act": "gelu"}, "gelu"),
    model("not-an-object", "[1]", "config.json"),
    model("not-json", "{oops", "config.json"),
    model("latin-1", '{"model_type": "caf\xe9"}'.encode("latin-1"), "not UTF-8"),
    model("nested-200k", DEEP, "nested too deeply"),
    model("duplicate-key", '{"vocab_size": 320, "vocab_size": 321}', "vocab_size"),
    model("empty", "", "config.json"),
    weights(
        "nan",
        "'model.layers.0.mlp.up_proj.weight'",
        bad_tensor=("model.layers.0.mlp.up_proj.weight", float("nan")),
    ),
    weights(
        "inf", "'model.embed_tokens.weight'", bad_tensor=("model.embed_tokens.weight", math.inf)
    ),
    weights("minus-inf", "'lm_head.weight'", bad_tensor=("lm_head.weight", -math.inf)),
    weights("corrupt-file", "safetensors", weights_bytes=b"\x08\x00\x00\x00garbage!"),
    weights("empty-file", "safetensors", weights_bytes=b""),
]

COMPARE: list[Case] = [
    Case("cmp-scale-inf", cmp("--scale", "inf"), "--scale", outputs=CMP_OUT),
    Case("cmp-scale-nan", cmp("--scale", "nan"), "--scale", outputs=CMP_OUT),
    Case("cmp-scale-0", cmp("--scale", "0"), "--scale", outputs=CMP_OUT),
    Case("cmp-scale-half", cmp("--scale", "0.5"), "--scale", outputs=CMP_OUT),
    Case("cmp-scale-1e9", cmp("--scale", "1e9"), "--scale", outputs=CMP_OUT),
    Case("cmp-knee-nan", cmp("--knee", "nan"), "--knee", outputs=CMP_OUT),
    Case("cmp-knee-0", cmp("--knee", "0"), "--knee", outputs=CMP_OUT),
    Case("cmp-knee-1.5", cmp("--knee", "1.5"), "--knee", outputs=CMP_OUT),
    Case("cmp-knee-inf", cmp("--knee", "inf"), "--knee", outputs=CMP_OUT),
    Case("cmp-rates-nan", cmp("--rates", "nan"), "--rates", outputs=CMP_OUT),
    Case("cmp-rates-0", cmp("--rates", "0"), "--rates", outputs=CMP_OUT),
    Case("cmp-rates-inf", cmp("--rates", "1,inf"), "--rates", outputs=CMP_OUT),
    Case("cmp-rates-letters", cmp("--rates", "a,b"), "--rates", outputs=CMP_OUT),
    Case("cmp-rates-100000", cmp("--rates", "100000"), "--rates", outputs=CMP_OUT),
    Case(
        "cmp-agent-rate-too-many-sessions",
        ("compare", "--traces", "agent", "--rates", "10000", "--out", "{ws}/cmp"),
        "--rates",
        outputs=CMP_OUT,
    ),
    Case("cmp-requests-0", cmp("--requests", "0"), "--requests", outputs=CMP_OUT),
    Case("cmp-requests-negative", cmp("--requests", "-5"), "--requests", outputs=CMP_OUT),
    Case("cmp-requests-10e6", cmp("--requests", "1000000"), "--requests", outputs=CMP_OUT),
    Case("cmp-traces-empty", cmp("--traces", ""), "--traces", outputs=CMP_OUT),
    Case("cmp-traces-twice", cmp("--traces", "chat,chat"), "--traces", outputs=CMP_OUT),
    Case("cmp-traces-unknown", cmp("--traces", "nope"), "unknown trace nope", outputs=CMP_OUT),
    Case("cmp-policies-unknown", cmp("--policies", "nope"), "unknown policy", outputs=CMP_OUT),
    Case("cmp-policies-empty-item", cmp("--policies", "fcfs,"), "--policies", outputs=CMP_OUT),
    Case("cmp-ttft-slo-nan", cmp("--ttft-slo-ms", "nan"), "--ttft-slo-ms", outputs=CMP_OUT),
    Case("cmp-ttft-slo-negative", cmp("--ttft-slo-ms", "-1"), "--ttft-slo-ms", outputs=CMP_OUT),
    Case(
        "cmp-ttft-per-token-inf",
        cmp("--ttft-slo-per-token-ms", "inf"),
        "--ttft-slo-per-token-ms",
        outputs=CMP_OUT,
    ),
    Case("cmp-tbt-slo-0", cmp("--tbt-slo-ms", "0"), "--tbt-slo-ms", outputs=CMP_OUT),
    Case("cmp-cost-400-digits", cmp("--cost", DIGITS_400), "cost model", outputs=CMP_OUT),
    Case("cmp-num-blocks-10e8", cmp("--num-blocks", "100000000"), "--num-blocks", outputs=CMP_OUT),
    Case("cmp-num-blocks-negative", cmp("--num-blocks", "-5"), "num_blocks", outputs=CMP_OUT),
    Case(
        "cmp-budget-0",
        cmp("--max-num-batched-tokens", "0"),
        "max_num_batched_tokens",
        outputs=CMP_OUT,
    ),
    Case("cmp-seed-2e70", cmp("--seed", str(1 << 70)), "--seed", outputs=CMP_OUT),
    Case("cmp-unknown-option", cmp("--bogus"), "--bogus", outputs=CMP_OUT),
]


def kvl(*extra: str) -> tuple[str, ...]:
    return ("kv-layouts", "--quick", "--quiet", "--out", "{ws}/kvl", *extra)


KVL_OUT = ("kvl/report.json", "kvl/report.md")

KV_LAYOUTS: list[Case] = [
    Case("kvl-out-is-file", kvl("--out", "{ws}/afile"), "--out"),
    Case("kvl-out-under-file", kvl("--out", "{ws}/afile/report"), "afile"),
    Case("kvl-contexts-letters", kvl("--contexts", "1k"), "--contexts", outputs=KVL_OUT),
    Case("kvl-contexts-0", kvl("--contexts", "0,256"), "--contexts", outputs=KVL_OUT),
    Case("kvl-contexts-twice", kvl("--contexts", "256,256"), "twice", outputs=KVL_OUT),
    Case("kvl-context-never-fits", kvl("--contexts", "100000"), "dense_blocks", outputs=KVL_OUT),
    Case("kvl-layouts-unknown", kvl("--layouts", "dense,nope"), "unknown layout", outputs=KVL_OUT),
    Case("kvl-window-0", kvl("--window", "0"), "--window", outputs=KVL_OUT),
    Case("kvl-load-nan", kvl("--load", "nan"), "--load", outputs=KVL_OUT),
    Case("kvl-load-11", kvl("--load", "11"), "--load", outputs=KVL_OUT),
    Case("kvl-cost-no-prefill", kvl("--cost", "2+1D"), "cost", outputs=KVL_OUT),
    Case("kvl-dense-blocks-0", kvl("--dense-blocks", "0"), "dense_blocks", outputs=KVL_OUT),
    Case("kvl-trace-unknown", kvl("--trace", "nope@256"), "trace", outputs=KVL_OUT),
    Case("kvl-unknown-option", kvl("--bogus"), "--bogus", outputs=KVL_OUT),
]

CHECK_KERNEL: list[Case] = [
    Case("kernel-no-target", ("check-kernel",), "MODULE:FUNCTION"),
    Case("kernel-no-target-with-options", ("check-kernel", "--quick"), "MODULE:FUNCTION"),
    Case("kernel-target-no-colon", ("check-kernel", "refserve.kernels.oracle"), "MODULE:FUNCTION"),
    Case("kernel-target-no-module", ("check-kernel", "no_such_module_xyz:f"), "no_such_module_xyz"),
    Case("kernel-target-relative", ("check-kernel", ".x:f"), "'.x:f'"),
    Case(
        "kernel-target-bad-function",
        ("check-kernel", "refserve.kernels.oracle:a-b"),
        "'refserve.kernels.oracle:a-b'",
    ),
    Case("kernel-device-bogus", ("check-kernel", KERNEL, "--device", "bogus"), "--device"),
    Case("kernel-device-meta", ("check-kernel", KERNEL, "--device", "meta"), "--device"),
    Case("kernel-device-cuda-99", ("check-kernel", KERNEL, "--device", "cuda:99"), "--device"),
    Case(
        "kernel-device-cuda",
        ("check-kernel", KERNEL, "--device", "cuda"),
        "--device",
        skip_if_cuda=True,
    ),
    Case("kernel-dtype-float64", ("check-kernel", KERNEL, "--dtype", "float64"), "--dtype"),
    Case("kernel-layout-paged", ("check-kernel", KERNEL, "--layout", "paged"), "--layout"),
    Case("kernel-seed-letter", ("check-kernel", KERNEL, "--seed", "x"), "--seed"),
    Case("kernel-timeout-nan", ("check-kernel", KERNEL, "--timeout", "nan"), "--timeout"),
    Case("kernel-timeout-0", ("check-kernel", KERNEL, "--timeout", "0"), "--timeout"),
    Case("kernel-atol-negative", ("check-kernel", KERNEL, "--atol", "-1"), "--atol"),
    Case("kernel-rtol-inf", ("check-kernel", KERNEL, "--rtol", "inf"), "--rtol"),
    Case("kernel-unknown-option", ("check-kernel", KERNEL, "--bogus"), "--bogus"),
    Case(
        "kernel-jsonl-under-file",
        ("check-kernel", KERNEL, "--jsonl", "{ws}/afile/k.jsonl"),
        "--jsonl",
    ),
]

CONF_ERROR = "refserve conformance: error: "  # the conformance command's own surface

CONFORMANCE: list[Case] = [
    Case(
        "conformance-adapter-not-an-adapter",
        ("conformance", "--adapter", "builtins:dict", "--report", "{ws}/o/r.json"),
        "--adapter builtins:dict does not return an engine adapter: missing name, features, "
        "configure, add_request, abort, has_unfinished, schedule, commit, rollback, snapshot",
        outputs=("o/r.json",),
        message=CONF_ERROR,
    ),
    Case(
        "conformance-kv-adapter-not-an-adapter",
        ("conformance", "--kv-adapter", "builtins:dict", "--report", "{ws}/o/r.json"),
        "--kv-adapter builtins:dict does not return a KV adapter: missing name, features, "
        "configure, allocate, fork, free, snapshot",
        outputs=("o/r.json",),
        message=CONF_ERROR,
    ),
    Case(
        "conformance-report-dev-null",
        (
            "conformance",
            "--adapter",
            "refserve.conformance.adapters.ref:make",
            "--report",
            "/dev/null",
        ),
        "/dev/null: exists and is not a regular file",
        message=CONF_ERROR,
    ),
    Case(
        "conformance-markdown-is-dir",
        (
            "conformance",
            "--adapter",
            "refserve.conformance.adapters.ref:make",
            "--markdown",
            "{ws}/adir",
        ),
        "adir",
        message=CONF_ERROR,
    ),
    Case(
        "conformance-kv-adapter-is-an-engine-adapter",
        ("conformance", "--kv-adapter", "refserve.conformance.adapters.ref:make"),
        "missing allocate, fork, free",
        message=CONF_ERROR,
    ),
]

TOP_LEVEL: list[Case] = [
    Case("no-command", (), "COMMAND"),
    Case("unknown-command", ("frobnicate",), "frobnicate"),
    Case("unknown-global-option", ("--bogus", "simulate", "seed002"), "--bogus"),
    Case("demo-unknown-option", ("demo", "--bogus"), "--bogus"),
    Case("demo-simulator-unknown-option", ("demo", "--simulator", "--bogus"), "--bogus"),
]

ALL_CASES: list[Case] = [
    *SIMULATE_OPTIONS,
    *TRACES,
    *OUTPUT_PATHS,
    *GENERATE,
    *CONFIGS,
    *COMPARE,
    *KV_LAYOUTS,
    *CHECK_KERNEL,
    *CONFORMANCE,
    *TOP_LEVEL,
]
