"""``refserve demo`` (``make run``): a short mixed workload on the embedded trained tiny
model, its per-step table, per-request latencies and the timeline pictures."""

from __future__ import annotations

import time
from pathlib import Path

import refserve.spec.checks as spec_checks
from refserve.core.config import SchedulerConfig
from refserve.core.request_metrics import RequestMetrics
from refserve.engine.llm_engine import TINY_TRAINED, LLMEngine, Proposer, RequestOutput
from refserve.model.sampler import SamplingParams
from refserve.report.timeline import write_timeline_html, write_timeline_png
from refserve.sim.metrics import RunMetrics, percentile

CONFIG = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, block_size=8, num_blocks=24)
SYSTEM = "You are a terse assistant. "
# (arrival step, prompt, sampling): short and long prompts, a shared system prompt (prefix
# hits), a sampled request and an n=2 fork, in a pool small enough to preempt.
WORKLOAD: tuple[tuple[int, str, SamplingParams], ...] = (
    (0, SYSTEM + "Name a prime.", SamplingParams(max_tokens=12)),
    (0, "Hi", SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=1)),
    (2, SYSTEM + "Say hello.", SamplingParams(max_tokens=12)),
    (4, "A longer prompt that needs several prefill chunks " * 2, SamplingParams(max_tokens=8)),
    (6, SYSTEM + "Count to three.", SamplingParams(max_tokens=10, n=2, temperature=1, seed=7)),
)


def demo_main(timeline_path: str | Path | None = None, proposer: Proposer | None = None) -> int:
    """Run the demo workload on ``"tiny-trained"`` with the byte tokenizer.

    Streams the finished outputs, then prints the per-step table, per-request TTFT/ITL and
    a summary, and writes the timeline picture (HTML) to ``timeline_path`` (default
    ``refserve-demo-timeline.html`` in the current directory) and a PNG beside it (same
    name, ``.png``). Every spec invariant is checked after every step. The model learned
    simple English sentences from a generated corpus, so the text is short readable
    sentences. With a ``proposer`` the decodes speculate (docs/SPECULATIVE.md) and the
    summary gives the acceptance rate.
    """
    cfg = CONFIG
    engine = LLMEngine(TINY_TRAINED, scheduler_config=cfg, check_invariants=True, proposer=proposer)
    print(
        f"refserve demo: tiny trained Llama ({cfg.block_size}-token blocks, {cfg.num_blocks} "
        f"blocks, budget {cfg.max_num_batched_tokens} tokens/step), byte tokenizer"
    )
    start = time.perf_counter()
    final = _run(engine)
    wall_ms = (time.perf_counter() - start) * 1e3
    _print_steps(engine, cfg)
    metrics = _print_requests(final)
    _print_summary(engine, cfg, metrics, wall_ms)
    path = Path(timeline_path) if timeline_path is not None else Path("refserve-demo-timeline.html")
    write_timeline_html(path, engine.steps, cfg.num_blocks, "refserve demo: tiny model")
    print(f"timeline: {path.resolve()}")
    # Beside the HTML under the same stem; never onto the HTML itself (``--timeline x.png``).
    png = path.with_suffix(".png") if path.suffix != ".png" else path.with_suffix(".png.png")
    write_timeline_png(png, engine.steps, cfg.num_blocks, "refserve demo: tiny model")
    print(f"timeline (PNG): {png.resolve()}")
    return 0


def _run(engine: LLMEngine) -> dict[tuple[str, int], RequestOutput]:
    """Feed the workload at its arrival steps and stream each sample's text as it ends."""
    texts: dict[tuple[str, int], str] = {}
    final: dict[tuple[str, int], RequestOutput] = {}
    pending = list(WORKLOAD)
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= step:
            _, prompt, sp = pending.pop(0)
            rid = engine.add_request(prompt, sp)
            print(f"[step {step:3d}] + {rid}: {prompt!r} (n={sp.n}, max_tokens={sp.max_tokens})")
        for out in engine.step():
            key = (out.request_id, out.index)
            texts[key] = texts.get(key, "") + out.new_text
            if out.finished:
                final[key] = out
                print(
                    f"[step {step:3d}] = {out.request_id}[{out.index}] {out.finish_reason}: "
                    f"{texts[key]!r}"
                )
        step += 1
    return final


def _print_steps(engine: LLMEngine, cfg: SchedulerConfig) -> None:
    print(f"\n{'step':>4} {'ms':>6} {'prefill':>7} {'dec':>3} {'KV':>5}  tokens per request")
    for rec in engine.steps:
        per = " ".join(f"{r}:{n}" for r, n in rec.tokens)
        pre = f"  preempted {','.join(rec.plan.preempted)}" if rec.plan.preempted else ""
        kv = f"{rec.kv_blocks_used}/{cfg.num_blocks}"
        print(
            f"{rec.step_index:>4} {rec.end_ms - rec.start_ms:>6.1f} {rec.num_prefill_tokens:>7} "
            f"{rec.num_decodes:>3} {kv:>5}  {per}{pre}"
        )


def _print_requests(final: dict[tuple[str, int], RequestOutput]) -> list[RequestMetrics]:
    print(
        f"\n{'request':<10} {'idx':>3} {'prompt':>6} {'out':>4} {'ttft ms':>8} {'mean itl ms':>11}"
    )
    metrics: list[RequestMetrics] = []
    for (rid, idx), out in sorted(final.items()):
        m = out.metrics
        metrics.append(m)
        ttft = "-" if m.ttft_ms is None else f"{m.ttft_ms:.2f}"
        itl = "-" if m.tpot_ms is None else f"{m.tpot_ms:.2f}"
        row = f"{rid:<10} {idx:>3} {m.num_prompt_tokens:>6} {len(out.token_ids):>4}"
        print(f"{row} {ttft:>8} {itl:>11}")
    return metrics


def _pct(xs: list[float], q: float) -> str:
    v = percentile(xs, q)
    return "-" if v is None else f"{v:.1f}"


def _print_summary(
    engine: LLMEngine, cfg: SchedulerConfig, metrics: list[RequestMetrics], wall_ms: float
) -> None:
    run = RunMetrics.of(metrics, wall_ms)
    itls = [x for m in metrics for x in m.itl_ms]
    ttfts = [t for m in metrics if (t := m.ttft_ms) is not None]
    peak_kv = max((r.kv_blocks_used for r in engine.steps), default=0)
    print(
        f"\n{len(engine.steps)} steps in {wall_ms:.0f} ms; {run.output_tokens} output tokens "
        f"({run.output_tokens_per_s:.0f} tok/s), {run.input_tokens} prompt tokens\n"
        f"TTFT p50/p95 {_pct(ttfts, 50)}/{_pct(ttfts, 95)} ms; "
        f"ITL p50/p95 {_pct(itls, 50)}/{_pct(itls, 95)} ms\n"
        f"KV blocks peak {peak_kv}/{cfg.num_blocks}; prefix-cache hits "
        f"{engine.num_prefix_hit_tokens} tokens; preemptions {engine.num_preemptions}; "
        f"forks {engine.num_forks}"
    )
    if engine.proposer is not None:
        print(f"speculation: {engine.speculation}")
    # The engine checks every step and raises on a violation, so reaching here means none.
    # The list is read now, not at import: it is the one check_step ran.
    checks = len(spec_checks.STEP_CHECKS)
    print(
        f"checked: all {len(engine.steps)} steps against the {checks} invariant checks of "
        "refserve.spec.check_step, none violated"
    )
