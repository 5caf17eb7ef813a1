"""``refserve conformance-http``: black-box checks of an OpenAI-compatible server against
refserve's engine on the same checkpoint (:mod:`refserve.conformance.http`).

Exit 0 when nothing failed, 1 when the server has findings, 2 on bad options (one
``refserve: error:`` line). A server that hangs or answers garbage is a finding, bounded
by ``--timeout`` per request; it never hangs the tool or ends it with a traceback.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refserve.cli.args import EXIT_FAILED, EXIT_OK, add_command, finite_float, int_at_most
from refserve.errors import InvalidArgument

if TYPE_CHECKING:
    from refserve.conformance.http.checks import Expected
    from refserve.engine.llm_engine import LLMEngine


def add_conformance_http_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "conformance-http",
        "black-box checks of an OpenAI-compatible server against the reference engine",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (no /v1)")
    p.add_argument(
        "--model",
        required=True,
        help="the checkpoint the server serves (a dir, or tiny / tiny-trained): the reference",
    )
    p.add_argument(
        "--served-model-name",
        help="the name to send (default: the server's only model, else --model)",
    )
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--checks", nargs="+", metavar="NAME", help="run only these (default: all; --list)"
    )
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument(
        "--timeout",
        type=finite_float(0, 3600, lo_open=True),
        default=60.0,
        metavar="SECONDS",
        help="limit of one request; past it is a finding (default %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=int_at_most(4096, lo=4),
        default=16,
        metavar="N",
        help="max_tokens of the checks' requests (default %(default)s; 4 to 4096)",
    )
    p.add_argument("--json", type=Path, help="write the JSON report here")
    p.add_argument("--markdown", type=Path, help="write the markdown report here")
    p.set_defaults(func=run_conformance_http)
    return p


def _served_name(client: Any, given: str | None, model: str) -> str:
    if given:
        return given
    try:
        a = client.get("/v1/models")
        data = a.body.get("data") if isinstance(a.body, dict) else None
        if isinstance(data, list) and len(data) == 1 and isinstance(data[0], dict):
            name = data[0].get("id")
            if isinstance(name, str):
                return name
    except Exception:  # the models check will report what is wrong with it
        pass
    return model


def _check_names(given: list[str] | None) -> list[str]:
    from refserve.conformance.http.checks import CHECKS

    names = list(given or CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise InvalidArgument(f"--checks: unknown {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    return names


def _print_results(results: list[Any], summary: dict[str, int]) -> None:
    for r in results:
        line = f"{r.status:>13}  {r.check}"
        if r.failure is not None:
            line += f": {r.failure.message}"
        elif r.note:
            line += f" ({r.note})"
        print(line)
    s = summary
    print(f"\n{s['pass']} pass, {s['fail']} fail, {s['not_supported']} not supported")


def run_conformance_http(args: argparse.Namespace) -> int:
    if args.list:
        from refserve.conformance.http.checks import CHECKS

        print("\n".join(CHECKS))
        return EXIT_OK
    names = _check_names(args.checks)
    from refserve.files import atomic_write_text, check_output_file

    json_path = check_output_file(args.json, "--json") if args.json else None
    md_path = check_output_file(args.markdown, "--markdown") if args.markdown else None
    if not args.base_url.startswith(("http://", "https://")):
        raise InvalidArgument(
            f"--base-url must start with http:// or https://, got {args.base_url!r}"
        )

    from tqdm import tqdm

    from refserve.conformance.http.checks import Context
    from refserve.conformance.http.client import ServerClient
    from refserve.conformance.http.runner import report_json, report_markdown, run_check
    from refserve.engine.llm_engine import LLMEngine

    reference = EngineReference(LLMEngine(args.model))
    client = ServerClient(args.base_url, timeout_s=args.timeout, api_key=args.api_key)
    try:
        served = _served_name(client, args.served_model_name, str(args.model))
        ctx = Context(client, served, reference, max_tokens=args.max_tokens)
        results = [
            run_check(name, ctx)
            for name in tqdm(names, desc="conformance-http", unit="check", leave=False)
        ]
    finally:
        client.close()
    doc = report_json(
        results, base_url=args.base_url, model=served, reference=str(args.model), complete=True
    )
    _print_results(results, doc["summary"])
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(doc, indent=2) + "\n", "--json")
    if md_path is not None:
        atomic_write_text(md_path, report_markdown(doc), "--markdown")
    return EXIT_FAILED if doc["summary"]["fail"] else EXIT_OK


class EngineReference:
    """refserve's engine as the checks' reference
    (:class:`refserve.conformance.http.checks.Reference`): the checks see its greedy
    answers and its context length, not the engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def greedy(self, prompt: str, max_tokens: int, stop: tuple[str, ...]) -> Expected:
        from refserve.conformance.http.checks import Expected
        from refserve.model.sampler import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, stop=stop)
        (r,) = self.engine.generate([prompt], params)
        o = r.outputs[0]
        return Expected(prompt, len(r.prompt_token_ids), o.text, o.token_ids, o.finish_reason or "")
