"""``splitserve up``'s own flags, declared once (``common/settings.py``): its parser is
generated from ``UpSettings``. Its flags have no environment twins (a child's twin, say
``SPLITSERVE_PORT``, must not move ``up`` too); its groups (membership, TLS, API keys) keep
theirs, as every role's do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from splitserve.common.api_keys import ApiKeySettings
from splitserve.common.settings import default_group, setting
from splitserve.discovery.flags import MembershipSettings
from splitserve.gateway.settings import ResponseStoreSettings
from splitserve.launch.cpu_priority import MAX_NICE
from splitserve.launch.layout import LAYOUTS, RECHECK_INTERVAL_S
from splitserve.proto.tls import TlsSettings

CORE_LENDING = ("decode", "both", "off")
CONTROL_CORES = ("prefill", "any")
WORKER_NICE = 10
"""The workers' default niceness: CFS weighs a nice-10 thread at about a ninth of a nice-0 one
(110 against 1024), so the front end gets ~90% of a core the engines also want."""


@dataclass(frozen=True)
class LayoutSettings:
    """How ``up`` chooses its workers when no counts are given (``launch/layout.py``)."""

    ENV: ClassVar[bool] = False
    layout: str = setting(
        "auto",
        "how the machine's cores serve the two phases: split (a prefill and a decode worker, "
        "half the cores each), aggregated (one dual-role worker on all cores), hybrid (split, "
        "each worker borrowing the other's cores while it idles: --core-lending both), or auto "
        "(the default: hybrid or aggregated, from a measurement of this machine cached per "
        "configuration). Explicit --prefill/--decode/--dual override it",
        choices=LAYOUTS,
    )
    layout_workload: str = setting(
        "320,96,2000,50",
        "what auto chooses for: prompt tokens, output tokens, TTFT target ms, ITL target ms "
        "(default: the chat workload and SLO of bench/bench_goodput.py)",
    )
    layout_recheck_s: float = setting(
        RECHECK_INTERVAL_S,
        "re-check the running layout every this many seconds from the step times the workers "
        "learn serving, where a probe of this machine is at hand (auto, or split / aggregated "
        "with the probe cached); it says what a restart would run and writes the served times "
        "to the probe's cache for the next start (launch/layout_recheck.py). 0: off",
    )


@dataclass(frozen=True)
class AutoscaleSettings:
    """``--autoscale``: ``up`` adds and drains its own prefill and decode workers
    (``launch/local_autoscaler.py``; the policy is ``launch/scale_policy.py``'s)."""

    ENV: ClassVar[bool] = False
    TITLE: ClassVar[str] = "autoscaling"
    autoscale: bool = setting(
        False,
        "add and drain prefill and decode workers as the coordinators' "
        "splitserve_desired_workers asks (up at once; down one at a time once the figure has "
        "stayed lower for --scale-down-window-s, always by draining); --prefill/--decode are "
        "the counts it starts with, at least 1 each; workers are not pinned",
    )
    max_workers: int = setting(4, "with --autoscale: the most workers of each role")
    autoscale_interval_s: float = setting(
        15.0, "with --autoscale: how often the coordinators' figure is read"
    )
    scale_down_window_s: float = setting(
        300.0,
        "with --autoscale: a role shrinks only below the most workers its figure asked for "
        "over this many seconds (the HPA's stabilization window)",
    )
    scale_down_period_s: float = setting(
        60.0, "with --autoscale: at most one worker of a role drained per this many seconds"
    )


@dataclass(frozen=True)
class UpSettings:
    """Every flag of ``splitserve up`` (``up.py``)."""

    ENV: ClassVar[bool] = False
    host: str = setting("127.0.0.1", "address every child binds")
    port: int = setting(50051, "coordinator's public gRPC port (0: any free)")
    internal_port: int = setting(
        50052, "coordinator's internal gRPC port, for workers (0: any free port)"
    )
    model: str = setting(
        "default",
        "GGUF file, HF folder, 'default', or random:SHAPE[:SEED] (random weights each worker "
        "draws on its device at start, no file: llama-8b, llama-1b, tiny)",
    )
    extra_model: tuple[str, ...] = setting(
        (),
        "another model to serve beside --model (a GGUF file or an HF folder; python -m "
        "splitserve.engine.random_checkpoint writes one of random weights), on a coordinator "
        "and a dual-role worker of its own (unpinned); the gateway routes each request by its "
        "model",
    )
    coordinators: int = setting(
        1,
        "coordinators (ports 2 apart from --port / --internal-port); every worker registers "
        "with all, the gateway balances over them and continues a stream whose coordinator "
        "dies through another",
    )
    layout: LayoutSettings = default_group(LayoutSettings)
    prefill: int = setting(1, "prefill workers (overrides --layout)")
    decode: int = setting(1, "decode workers (overrides --layout)")
    dual: int = setting(
        0,
        "dual-role workers (prefill and decode on one engine: `splitserve worker`), started "
        "after the others; e.g. --prefill 0 --decode 0 --dual 2 (overrides --layout)",
    )
    workers_per_process: int = setting(
        1,
        "workers of a role one process hosts (--host-workers; above 1 only for simulated "
        "workers, -- --engine sim, whose processes are then not pinned): e.g. --prefill 16 "
        "--decode 112 --workers-per-process 16 runs 128 workers in 8 processes",
    )
    decode_worker_args: str = setting(
        "",
        "flags for the decode workers only, after those after -- (one string, split as a "
        "shell would), e.g. '--no-prefix-caching': decode workers that keep no finished "
        "request's KV, so no conversation's next turn finds its history there",
    )
    no_pin: bool = setting(False, "do not pin workers to cores")
    core_lending: str | None = setting(
        None,
        "pinned workers lend their cores while their engine idles: 'decode': decode worker i "
        "also runs its steps on prefill worker i's cores while that one waits for prompts, "
        "where that measures faster; 'both': prefill worker i borrows decode worker i's too; "
        "'off': each keeps to its own. Default: the layout's ('both' for hybrid, which auto "
        "runs for a worker pair; 'off' otherwise)",
        choices=CORE_LENDING,
    )
    control_cores: str = setting(
        "any",
        "where the coordinators and the gateway run: 'prefill': on the prefill workers' cores "
        "(pinned workers, at least one prefill and one decode worker), leaving the decode "
        "workers' cores to their steps; 'any': unpinned",
        choices=CONTROL_CORES,
    )
    worker_nice: int = setting(
        WORKER_NICE,
        "niceness of the worker processes (0-19; 0: the default priority, as the coordinators "
        "and gateways keep), so the front end takes a core whenever it has work however busy "
        "the engines keep every core: a crowd's 429s do not wait behind engine steps "
        "(launch/cpu_priority.py)",
    )
    local_prefill_max_tokens: int | None = setting(None, "passed to the coordinator")
    max_inflight: int | None = setting(None, "passed to the coordinator")
    placement: str | None = setting(
        None, "where prompts are computed (rule, adaptive, remote, local); for the coordinator"
    )
    http_port: int = setting(8000, "OpenAI-compatible gateway port (0: any free)")
    no_gateway: bool = setting(False, "do not start the gateway")
    apart: bool = setting(
        False,
        "run the gateway and the coordinator as processes of their own (by default, with one "
        "coordinator, one gateway and one model, they share one: splitserve frontend, whose "
        "gateway hands streams to the coordinator without gRPC)",
    )
    gateways: int = setting(
        1,
        "gateway processes sharing --http-port (SO_REUSEPORT: the kernel spreads connections "
        "over them; each also serves its own /metrics on a port it prints)",
    )
    drain_timeout: float = setting(
        30.0, "seconds each child may drain on SIGTERM (passed to coordinator and workers)"
    )
    no_restart: bool = setting(
        False, "stop everything when a child dies (default: restart it with back-off)"
    )
    served_model_name: str | None = setting(
        None, "names --model is served under (comma-separated; the coordinators' flag)"
    )
    metrics_port_base: int = setting(
        9400,
        "Prometheus /metrics ports: coordinator i at base + i, worker i after them (0: any "
        "free port each, printed at start; -1: no metrics)",
    )
    autoscaling: AutoscaleSettings = default_group(AutoscaleSettings)
    membership: MembershipSettings = default_group(MembershipSettings)
    responses: ResponseStoreSettings = default_group(ResponseStoreSettings)
    tls: TlsSettings = default_group(TlsSettings)
    api_keys: ApiKeySettings = default_group(ApiKeySettings)
    health_needs_key: bool = setting(
        False,
        "with API keys, the gateway's /health and /metrics need a key too (default: open, "
        "for probes)",
    )

    def __post_init__(self) -> None:
        if self.workers_per_process < 1:
            raise ValueError("--workers-per-process must be at least 1")
        if not 0 <= self.worker_nice <= MAX_NICE:
            raise ValueError(f"--worker-nice must be from 0 to {MAX_NICE}")
        if self.gateways < 1:
            raise ValueError("--gateways must be at least 1 (--no-gateway starts none)")
        scaling = self.autoscaling
        if scaling.autoscale:
            if min(self.prefill, self.decode) < 1 or max(self.prefill, self.decode) > (
                scaling.max_workers
            ):
                raise ValueError(
                    "--autoscale starts with 1 to --max-workers prefill and decode workers "
                    f"each, not {self.prefill} and {self.decode}"
                )
            if self.workers_per_process > 1:
                raise ValueError("--autoscale moves whole processes: --workers-per-process 1")
            if self.metrics_port_base < 0:
                raise ValueError("--autoscale reads the coordinators' metrics: not with -1")
            if scaling.autoscale_interval_s <= 0:
                raise ValueError("--autoscale-interval-s must be positive")
