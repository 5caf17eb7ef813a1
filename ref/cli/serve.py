"""``refserve serve``: the OpenAI-compatible HTTP server (:mod:`refserve.serve`).

Wired into ``ref/cli/main.py`` (``add_serve_parser``); the scheduler's options come from
:mod:`refserve.cli.config_args`, as ``simulate``'s do. Everything is checked before the
model is built: the options, the API key, the address (bound before the model loads, so
a port in use is one error line, not a traceback after a minute of loading). Binds
127.0.0.1 unless ``--host`` says otherwise. SIGTERM drains and exits 0; Ctrl-C drains
and exits 130.

``--replicas N`` (N > 1) or ``--backend ray`` serve a cluster instead of one engine
(docs/CLUSTER.md, "Serving"): N replicas of the model, each with the scheduler options
given, behind the ``--router`` policy, in this process or one Ray actor each (Ray
started locally here and shut down at exit). ``--replicas 1 --backend inprocess``, the
default, is the single-engine server, unchanged. ``--roles 2P2D`` disaggregates prefill
and decode among the replicas, ``--deflect-ttft-ms``/``--deflect-tbt-ms`` turn on
deflection (docs/DISAGG.md, "Serving").
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from refserve.cli.args import (
    add_command,
    add_device_args,
    add_speculative_args,
    check_device_args,
    finite_float,
    int_at_most,
    proposer_from_args,
)
from refserve.cli.config_args import add_config_args, config_from_args
from refserve.core.config import SchedulerConfig
from refserve.errors import InvalidArgument

if TYPE_CHECKING:
    from refserve.cluster.disagg import Deflection, Roles, TTFTBound
    from refserve.cluster.ray_replica import RayReplica
    from refserve.serve.cluster_loop import ClusterLoop

#: The environment variable read when ``--api-key`` is not given.
API_KEY_ENV = "REFSERVE_API_KEY"
MAX_WAITING_DEFAULT = 256
BACKENDS = ("inprocess", "ray")
ROUTERS = ("round_robin", "least_loaded", "prefix_aware", "slo_aware")
#: ``--max-replica-restarts``' default: a replica that keeps dying (a model that crashes
#: its process) stops being replaced after this many.
MAX_RESTARTS_DEFAULT = 3


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(sub, "serve", "serve a model over the OpenAI HTTP API (FastAPI + uvicorn)")
    p.add_argument(
        "--model",
        default="tiny-trained",
        help="'tiny-trained' (default), 'tiny' (random weights) or a local HF checkpoint dir",
    )
    p.add_argument("--served-model-name", help="the name clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int_at_most(65535, lo=0),
        default=8000,
        help="port to listen on; 0: any free one (default %(default)s)",
    )
    p.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
        f"(default: ${API_KEY_ENV} if set)",
    )
    p.add_argument(
        "--max-waiting",
        type=int_at_most(1 << 20, lo=1),
        default=MAX_WAITING_DEFAULT,
        help="queued requests beyond this answer 429 (default %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int_at_most(1 << 30, lo=1024),
        default=4 << 20,
        metavar="BYTES",
        help="a request body larger than this answers 413 (default %(default)s; 1024 to "
        f"{1 << 30})",
    )
    p.add_argument(
        "--drain-timeout",
        type=finite_float(0, 3600),
        default=30.0,
        metavar="SECONDS",
        help="time in-flight requests get to finish after SIGTERM, then they are aborted "
        "(default %(default)s; at most 3600)",
    )
    p.add_argument(
        "--torch-threads",
        type=int_at_most(1024, lo=1),
        default=max(1, (os.cpu_count() or 2) - 1),
        help="torch intra-op threads of the engine (default: one core less than the "
        "machine's, left to the HTTP side: spinning torch workers starve it otherwise)",
    )
    p.add_argument(
        "--replicas",
        type=int_at_most(64, lo=1),
        default=1,
        help="engine replicas behind the router (default 1: one engine, no router)",
    )
    p.add_argument(
        "--router",
        choices=ROUTERS,
        default="prefix_aware",
        help="routing policy of a cluster (docs/CLUSTER.md; default %(default)s)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="inprocess",
        help="where the replicas run: threads of this process (default) or one Ray actor "
        "each (needs the [cluster] extra: make cluster-deps)",
    )
    p.add_argument(
        "--max-replica-restarts",
        type=int_at_most(1000, lo=0),
        default=MAX_RESTARTS_DEFAULT,
        metavar="N",
        help="times each replica of a cluster that dies is replaced by a fresh one "
        '(docs/CLUSTER.md, "Faults"; 0 to 1000, default %(default)s; 0: a dead replica '
        "stays dead)",
    )
    p.add_argument(
        "--roles",
        metavar="ROLES",
        help="each replica's role, counts in slot order: P prefill, D decode, C both, e.g. "
        "2P2D (docs/DISAGG.md; default: every replica C)",
    )
    p.add_argument(
        "--deflect-ttft-ms",
        type=_ttft_bound,
        metavar="BASE[,PER_TOKEN]",
        help="with --roles and --deflect-tbt-ms: a request's TTFT SLO, BASE ms plus "
        "PER_TOKEN ms a prompt token; a prefill whose prefill side misses it goes to a "
        'decode replica that does better (docs/DISAGG.md, "Placement")',
    )
    p.add_argument(
        "--deflect-tbt-ms",
        type=finite_float(0, 1e6, lo_open=True),
        metavar="MS",
        help="with --deflect-ttft-ms: the TBT bound a decode replica's steps keep while "
        "they prefill a deflected request (its scheduler's tbt_slo_ms, priced by --cost)",
    )
    add_device_args(p)
    add_speculative_args(p)
    add_config_args(p)
    p.add_argument(
        "--fault-endpoints",
        action="store_true",
        help="add POST /debug/replicas/{i}/kill, which kills a replica as a crash would "
        "(make soak: conformance/bench/soak.py); never on a server others use",
    )
    p.set_defaults(func=run_serve, num_blocks=1024, max_model_len=1 << 20)
    return p


def _ttft_bound(text: str) -> TTFTBound:
    """``BASE[,PER_TOKEN]`` in ms (``--deflect-ttft-ms``)."""
    from refserve.cluster.disagg import TTFTBound

    parts = text.split(",")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"expected BASE[,PER_TOKEN] in ms, got {text!r}")
    num = finite_float(0, 1e6)
    return TTFTBound(num(parts[0]), num(parts[1]) if len(parts) == 2 else 0.0)


class Disaggregation(NamedTuple):
    """What ``--roles`` and the deflection options say (None: not given)."""

    roles: Roles | None
    deflection: Deflection | None


def disaggregation(args: argparse.Namespace) -> Disaggregation:
    """``--roles`` for ``--replicas`` and the deflection they turn on; each bad value
    a typed error naming its option."""
    from refserve.cluster.disagg import Deflection, Role, Roles

    ttft, tbt = args.deflect_ttft_ms, args.deflect_tbt_ms
    if (ttft is None) != (tbt is None):
        raise InvalidArgument("--deflect-ttft-ms and --deflect-tbt-ms go together")
    if args.roles is None:
        if ttft is not None:
            raise InvalidArgument("--deflect-ttft-ms/--deflect-tbt-ms need --roles")
        return Disaggregation(None, None)
    try:
        roles = Roles.parse(args.roles, args.replicas)
    except InvalidArgument as e:
        raise InvalidArgument(f"--roles: {e}") from None
    if ttft is None:
        return Disaggregation(roles, None)
    if Role.DECODE not in roles.roles:
        raise InvalidArgument(f"--deflect-ttft-ms: roles {roles.text} have no decode replica")
    return Disaggregation(roles, Deflection(ttft, tbt))


def _api_key(given: str | None) -> str | None:
    key = given if given is not None else os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not key or not key.isprintable() or not key.isascii() or " " in key:
        raise InvalidArgument(
            "--api-key: must be non-empty printable ASCII without spaces (it travels in an "
            "HTTP header)"
        )
    return key


def run_serve(args: argparse.Namespace) -> int:
    check_device_args(args)
    key = _api_key(args.api_key)
    config = replace(config_from_args(args), max_waiting=args.max_waiting)
    name = args.served_model_name or str(args.model)

    cluster = args.replicas > 1 or args.backend != "inprocess"
    if cluster and args.speculative is not None:
        raise InvalidArgument("--speculative serves one engine: not with --replicas/--backend")
    pd = disaggregation(args)
    if pd.roles is not None and not cluster:
        raise InvalidArgument("--roles: roles are a cluster's (--replicas N > 1)")
    if args.backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise InvalidArgument(
                "--backend ray needs Ray: pip install -e '.[cluster]' (or make cluster-deps)"
            )
    from refserve.serve.server import bind

    sock = bind(args.host, args.port)  # before the model loads: a busy port fails fast
    from refserve.engine.llm_engine import LLMEngine
    from refserve.serve.app import ServeSettings
    from refserve.serve.server import Server, build_cluster_server, build_server, serve_forever

    settings = ServeSettings(
        model_name=name,
        api_key=key,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        fault_endpoints=args.fault_endpoints,
    )
    model_dir = Path(args.model) if Path(args.model).is_dir() else None
    server: Server
    stop_ray = False
    if cluster:
        from refserve.cluster.ray_replica import start_ray

        stop_ray = args.backend == "ray" and start_ray()
        loop = cluster_loop(args, config, name)
        server = build_cluster_server(loop, settings, model_dir=model_dir)
    else:
        engine = LLMEngine(
            args.model,
            scheduler_config=config,
            attention_backend=args.attention_backend,
            device=args.device,
            check_invariants=args.check,
            proposer=proposer_from_args(args),
        )
        server = build_server(
            engine, settings, model_dir=model_dir, torch_threads=args.torch_threads
        )
    host, port = sock.getsockname()[:2]
    shown = "" if pd.roles is None else f", roles {pd.roles.text}"
    what = f"{args.replicas} replicas ({args.backend}, {args.router}{shown}) of " if cluster else ""
    print(f"refserve: serving {what}{name!r} on http://{host}:{port}/v1", flush=True)
    try:
        serve_forever(server, sock)
    finally:
        if stop_ray:
            from refserve.cluster.ray_replica import stop_ray as shutdown_ray

            shutdown_ray()
    print("refserve: drained, exiting", flush=True)
    return 0


def cluster_loop(args: argparse.Namespace, config: SchedulerConfig, name: str) -> ClusterLoop:
    """The replicas of ``--replicas``/``--backend`` behind the ``--router`` policy (Ray
    already running for ``--backend ray``)."""
    from refserve.cluster import InProcessReplica, Replica, Router
    from refserve.cluster.disagg import Role
    from refserve.core.cost import StepCost
    from refserve.engine.llm_engine import LLMEngine
    from refserve.serve.cluster_loop import ClusterLoop
    from refserve.serve.metrics import ClusterServeMetrics

    cfg = replace(config, cache_events=True)
    n = args.replicas
    pd = disaggregation(args)
    cost = StepCost.parse(args.cost)

    def cfg_of(slot: int) -> SchedulerConfig:
        """A decode replica under deflection keeps its steps within the TBT bound."""
        if pd.roles is None or pd.deflection is None or pd.roles.of(slot) is not Role.DECODE:
            return cfg
        return replace(cfg, tbt_slo_ms=pd.deflection.tbt_slo_ms, step_cost=cost)

    replicas: list[Replica] = []
    if args.backend == "ray":
        from refserve.cluster.ray_replica import ray_replicas
        from refserve.model.checkpoint import load_model

        def rays(num: int, first: int) -> list[RayReplica]:
            return ray_replicas(
                num,
                model=str(args.model),
                scheduler_config=cfg_of(first),
                torch_threads=max(1, args.torch_threads // n),
                first_id=first,
                attention_backend=args.attention_backend,
                device=args.device,
                check_invariants=args.check,
            )

        made = []
        for run in _runs([cfg_of(i) for i in range(n)]):  # one config a call
            made.extend(rays(run.num, run.first))
        replicas.extend(made)
        # The tokenizer, here: the app tokenizes and detokenizes (loads one model copy).
        tokenizer = load_model(args.model).tokenizer
        max_len = made[0].max_model_len
        threads = None

        def restart(slot: int) -> Replica:  # a fresh actor in the dead one's slot
            return rays(1, slot)[0]

    else:

        def engine(slot: int) -> LLMEngine:
            return LLMEngine(
                args.model,
                scheduler_config=cfg_of(slot),
                attention_backend=args.attention_backend,
                device=args.device,
                check_invariants=args.check,
            )

        engines = [engine(i) for i in range(n)]
        replicas.extend(InProcessReplica(e, cost=cost) for e in engines)
        tokenizer, max_len = engines[0].tokenizer, engines[0].max_model_len
        threads = args.torch_threads

        def restart(slot: int) -> Replica:
            return InProcessReplica(engine(slot), cost=cost)

    return ClusterLoop(
        replicas,
        Router(args.router),
        tokenizer=tokenizer,
        max_model_len=max_len,
        scheduler_config=cfg,
        metrics=ClusterServeMetrics(name),
        torch_threads=threads,
        restart=restart,
        max_restarts=args.max_replica_restarts,
        roles=pd.roles,
        deflection=pd.deflection,
    )


class SlotRun(NamedTuple):
    """Consecutive replica slots that share a config."""

    first: int
    num: int


def _runs(configs: list[SchedulerConfig]) -> list[SlotRun]:
    """Each run of equal consecutive configs."""
    out: list[SlotRun] = []
    for i, c in enumerate(configs):
        if out and configs[i - 1] == c:
            out[-1] = out[-1]._replace(num=out[-1].num + 1)
        else:
            out.append(SlotRun(i, 1))
    return out
