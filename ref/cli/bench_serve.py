"""``refserve bench-serve``: the open-loop HTTP load generator (:mod:`refserve.serve.bench`).

Loopback by default: a base URL on another host needs ``--allow-remote`` (a load
generator pointed at the wrong machine is a denial of service). Everything is checked
before the first request: the options, the trace, the output path.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from refserve.cli.args import EXIT_OK, add_command, finite_float, int_at_most
from refserve.errors import InvalidArgument

MAX_RATE = 1e6


def _rate(text: str) -> float:
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    value: float = finite_float(0, MAX_RATE, lo_open=True)(text)
    return value


def _rates(text: str) -> list[float]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected comma-separated rates, e.g. 1,2,4")
    return [_rate(t) for t in items]


def add_bench_serve_parser(sub: Any) -> argparse.ArgumentParser:
    from refserve.serve.bench import MAX_REQUESTS, TRACES

    p = add_command(sub, "bench-serve", "open-loop load generator for any OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (no /v1)")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument(
        "--trace",
        default="chat",
        help=f"{', '.join(TRACES)}, or a JSONL trace file (default %(default)s)",
    )
    p.add_argument(
        "--rate",
        type=_rate,
        default=1.0,
        help="requests (sessions) per second; inf sends all at once (default %(default)s)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--num-requests",
        type=int_at_most(MAX_REQUESTS, lo=1),
        metavar="N",
        help=f"requests (sessions) to send per rate (default 100 without --duration; 1 to "
        f"{MAX_REQUESTS:,})",
    )
    size.add_argument(
        "--duration",
        type=finite_float(0, 86400, lo_open=True),
        metavar="SECONDS",
        help="instead of --num-requests: send what arrives in this many seconds (at most 86400)",
    )
    p.add_argument(
        "--sweep",
        type=_rates,
        metavar="RATES",
        help="run at each of these rates instead of --rate, e.g. 1,2,4,8",
    )
    p.add_argument(
        "--scale",
        type=finite_float(0, 1e6, lo_open=True),
        default=16.0,
        help="divide the trace's token lengths (default 16: chat ~64 in / 8 out)",
    )
    p.add_argument(
        "--seed",
        type=int_at_most(1 << 62, lo=0),
        default=0,
        help="seed of the arrivals and lengths drawn from the trace (default %(default)s)",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=finite_float(0, 1e7, lo_open=True),
        default=1000.0,
        metavar="MS",
        help="goodput counts a request whose first token came within this (default %(default)s)",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=finite_float(0, 1e7, lo_open=True),
        default=100.0,
        metavar="MS",
        help="... and whose mean time per output token is within this (default %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=finite_float(0, 86400, lo_open=True),
        default=300.0,
        metavar="SECONDS",
        help="a request unanswered after this is recorded as a timeout (default %(default)s)",
    )
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos (OpenAI proper)"
    )
    p.add_argument(
        "--fit",
        action="store_true",
        help="fit the simulator's step cost, its scatter and the time around the engine to "
        "the server's records (refserve serve's /debug/steps and /debug/requests), replay "
        "the same requests and report the simulator's TTFT/TBT/goodput error",
    )
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback server")
    p.add_argument("--json", type=Path, help="write every request's record and the summary")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_bench_serve)
    return p


def _check_url(url: str, allow_remote: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"--base-url must be http(s)://HOST[:PORT], got {url!r}")
    host = parts.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise InvalidArgument(
            f"--base-url {url!r} is not a loopback address; pass --allow-remote to load it"
        )


def _check_args(args: argparse.Namespace) -> Path | None:
    from refserve.serve.bench import TRACES

    _check_url(args.base_url, args.allow_remote)
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    if args.trace not in TRACES and not Path(args.trace).is_file():
        raise InvalidArgument(f"--trace {args.trace!r}: not one of {', '.join(TRACES)} nor a file")
    if args.json is None:
        return None
    from refserve.files import check_output_file

    return check_output_file(args.json, "--json")


def run_bench_serve(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from refserve.serve.bench import Slo, Target, plan, report_doc, run_load, summarize

    json_path = _check_args(args)
    rates = args.sweep or [args.rate]
    plans = {
        rate: plan(
            args.trace,
            rate=rate,
            num_requests=args.num_requests,
            duration_s=args.duration,
            scale=args.scale,
            seed=args.seed,
        )
        for rate in rates
    }  # every plan built (and checked) before the first request
    target = Target(args.base_url, args.model, args.api_key, args.timeout, not args.no_ignore_eos)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    runs = []
    fits: list[Any] = []
    for rate, planned in plans.items():
        since = _fit_start(target) if args.fit else None
        with tqdm(
            total=len(planned), desc=f"rate {rate:g}/s", unit="req", disable=args.no_progress
        ) as bar:
            recs, duration = asyncio.run(
                run_load(target, planned, functools.partial(bar.update, 1))
            )
        runs.append((summarize(rate, recs, duration, slo), recs))
        if since is not None:
            fits.append(_fit(target, since, recs, slo, duration))
    doc = report_doc(target, args.trace, runs)
    for run, fit in zip(doc["runs"], fits, strict=False):
        run["fit"] = _fit_json(fit)
    _print_summary([s for s, _ in runs], slo, doc["knee_rate"])
    for (summary, _), fit in zip(runs, fits, strict=False):
        from refserve.serve.fit import render

        print(f"\nrate {summary.rate:g}: {render(fit)}")
    if json_path is not None:
        from refserve.serve.bench import write_json

        write_json(json_path, _finite(doc))
        print(f"wrote {args.json}")
    return EXIT_OK


def _client(target: Any) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    return httpx.Client(base_url=target.base_url.rstrip("/"), headers=headers, timeout=60)


def _fit_start(target: Any) -> Any:
    from refserve.serve.fit import fit_start

    with _client(target) as client:
        return fit_start(client)


def _fit(target: Any, since: Any, recs: Any, slo: Any, duration_s: float) -> Any:
    from refserve.serve.fit import fit_and_replay

    with _client(target) as client:
        return fit_and_replay(client, since, recs, slo=slo, duration_s=duration_s)


def _fit_json(fit: Any) -> dict[str, Any]:
    from refserve.serve.fit import fit_json

    result: dict[str, Any] = fit_json(fit)
    return result


def _print_summary(summaries: list[Any], slo: Any, knee_rate: float | None) -> None:
    from refserve.serve.bench import table

    print(table(summaries))
    print(f"\ngoodput: requests with TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms")
    for s in summaries:
        if s.errors:
            shown = ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items()))
            print(f"errors at rate {s.rate:g}: {shown}")
    if len(summaries) > 1:
        k = "none" if knee_rate is None else f"{knee_rate:g}"
        print(f"knee (the highest rate with goodput >= 90% of it): {k}")


def _finite(doc: Any) -> Any:
    """JSON has no infinity (a rate of ``inf``): written as the string ``"inf"``."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return str(doc)
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_finite(v) for v in doc]
    return doc
