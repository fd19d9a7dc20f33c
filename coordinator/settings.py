"""The coordinator's flags, declared once (``common/settings.py``): ``splitserve coordinator``'s
parser is generated from ``CoordinatorSettings``, and ``splitserve up`` starts coordinators
from the same object (``settings_argv``).

Each value is checked here (``ValueError`` naming the flag: a usage error at start); what the
coordinator builds from them is ``admission_config``, ``routing_config`` and ``flow_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitserve.common.api_keys import ApiKeySettings
from splitserve.common.settings import default_group, setting
from splitserve.common.tracing import TracingSettings
from splitserve.coordinator.admission import AdmissionConfig
from splitserve.coordinator.capacity import CapacityTargets
from splitserve.coordinator.flow import FlowConfig
from splitserve.coordinator.placement import PlacementMode, Slo
from splitserve.coordinator.router import DEFAULT_SLO, RoutingConfig
from splitserve.coordinator.service import CoordinatorConfig
from splitserve.coordinator.servicer import SEND_TIMEOUT_S
from splitserve.coordinator.stall_limits import AttemptTimeouts
from splitserve.discovery.flags import MembershipSettings
from splitserve.proto.cluster_access import ClusterAccessSettings
from splitserve.proto.server import ReflectionSettings
from splitserve.proto.streams_server import RELAYS


@dataclass(frozen=True)
class CoordinatorSettings:
    """Every flag of ``splitserve coordinator`` (module docstring)."""

    host: str = setting("127.0.0.1", "address the gRPC server binds")
    port: int = setting(50051, "public gRPC port (clients, gateway); 0 picks a free one")
    internal_port: int = setting(
        50052, "internal gRPC port (worker membership; cluster credential required); 0: any free"
    )
    model: str = setting(
        "default",
        "model whose tokenizer and chat template to use (a GGUF file, an HF folder, 'default' "
        "or random:SHAPE[:SEED]); only workers announcing the same checkpoint are routed to (a "
        "coordinator serves one model)",
    )
    served_model_name: str = setting(
        "",
        "comma-separated names requests may ask for the model by, the first reported "
        "(default: the checkpoint's name: a GGUF file's stem, an HF folder's name, "
        "random-SHAPE for random:SHAPE)",
    )
    cpu_affinity: str | None = setting(None, "pin the process to these cores, e.g. '0' or '0-3'")
    max_inflight: int = setting(
        0,
        "requests admitted at once (then RESOURCE_EXHAUSTED); 0: as many as a quarter of the "
        "memory available at start holds (common/memory_budget.py), printed at start",
    )
    local_prefill_max_tokens: int = setting(
        0, "prompts of at most this many tokens are prefilled on the decode worker"
    )
    placement: PlacementMode = setting(
        PlacementMode.RULE,
        "where prompts are computed: rule (a prefill worker unless short, the default), "
        "adaptive (per request from the workers' learned step times and the latency targets), "
        "remote or local (always, where possible)",
    )
    ttft_slo_ms: float = setting(DEFAULT_SLO.ttft_s * 1000, "TTFT target adaptive placement uses")
    tpot_slo_ms: float = setting(DEFAULT_SLO.tpot_s * 1000, "TPOT target adaptive placement uses")
    ttft_at_risk: float = setting(
        RoutingConfig.ttft_at_risk,
        "adaptive placement computes a prompt on its decode worker only when the prefill "
        "side's predicted TTFT is above this fraction of the target (0: whenever that is "
        "faster and the decode batch keeps its TPOT target)",
    )
    kv_share: float = setting(
        AdmissionConfig.kv_share,
        "share of the decode workers' KV this coordinator admits requests against "
        "(prompt + max_tokens each); 1/N when N coordinators share the workers",
    )
    max_queued: int = setting(
        AdmissionConfig.max_queued_requests,
        "requests that may wait for KV (then RESOURCE_EXHAUSTED)",
    )
    max_queued_prompt_tokens: int = setting(
        AdmissionConfig.max_queued_prompt_tokens,
        "prompt tokens that may wait for KV (then RESOURCE_EXHAUSTED)",
    )
    max_queue_wait: float = setting(
        AdmissionConfig.max_queue_wait_s,
        "seconds a request may wait for KV; one predicted to wait longer is refused at once",
    )
    default_max_tokens: int = setting(
        CoordinatorConfig.default_max_tokens,
        "output tokens of a request without max_tokens (0: up to the context); admission "
        "reserves KV for them",
    )
    max_tokens_cap: int = setting(0, "the most max_tokens a request may ask for (0: no cap)")
    prefill_backlog: float = setting(
        AdmissionConfig.prefill_backlog_s,
        "seconds of the workers' measured prefill rate that may be admitted and not yet "
        "computed; more wait in the coordinator's fair queue, not in the workers' FIFO queues",
    )
    admit_within_tpot: bool = setting(
        False,
        "admit only as many requests as the decode workers' learned step times decode "
        "within --tpot-slo-ms; the rest wait or get 429",
    )
    late_waiters_yield: bool = setting(
        True,
        "a request waiting for admission that can no longer have its first token within "
        "its TTFT target lets those of its priority that still can go first (default on)",
    )
    tenant_max_inflight: int = setting(
        0, "requests each tenant (API key's tenant) may have admitted or waiting; 0: no limit"
    )
    tenant_tokens_per_minute: int = setting(
        0, "tokens (prompt + max_tokens) each tenant may start per minute; 0: no limit"
    )
    tenants_file: Path | None = setting(
        None,
        "TOML file of per-tenant limits, weights and highest priorities "
        "(coordinator/tenants.py), over the two flags above",
    )
    tool_call_parser: str = setting(
        "json",
        "how chat answers call tools (vLLM's flag): json (splitserve's format, the tools "
        "described in a system message; for models without a tool format of their own) or "
        "hermes (Qwen2.5, Qwen3, Hermes: the chat template shows the tools, the model answers "
        "<tool_call> blocks; the template must read tools) or llama3_json (Llama 3.1-3.3: "
        "the template shows the tools, the model answers call objects) or mistral (Mistral "
        "7B v0.3, Nemo, Small, Large: the template shows the tools, the model answers "
        "[TOOL_CALLS] and an array of calls) or pythonic (Llama 3.2, Llama 4: the template "
        "shows the tools, the model answers a Python list of calls) or qwen3_coder "
        "(Qwen3-Coder: the template shows the tools, the model answers <tool_call> blocks of "
        "<function=...> and <parameter=...>)",
        choices=("json", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"),
    )
    reasoning_parser: str = setting(
        "",
        "how answers hold their reasoning (vLLM's flag): deepseek_r1 (DeepSeek-R1 and its "
        "distills: the answer begins inside <think>) or qwen3 (Qwen3, QwQ: an answer that "
        "opens <think>); the gateway returns it as reasoning_content and constrains a "
        "structured output or a forced tool call only after it. Default: none",
        choices=("", "deepseek_r1", "qwen3"),
    )
    enable_auto_tool_choice: bool = setting(
        False, "accepted for vLLM's command lines: tool_choice auto is always served here"
    )
    chat_template: Path | None = setting(
        None,
        "a chat template file (Jinja) used instead of the model's (vLLM's flag), for a model "
        "without one or whose own does not render what is needed",
    )
    trust_request_chat_template: bool = setting(
        False,
        "let requests bring their own chat template (chat_template, Jinja, rendered sandboxed "
        "here); off by default, as in vLLM: a template is code the coordinator runs",
    )
    lora_admin_tenants: str = setting(
        "",
        "with API keys: the tenants (comma-separated) whose callers may load and unload LoRA "
        "adapters at runtime (/v1/load_lora_adapter); none by default. Without keys, anyone",
    )
    client_stall_timeout: float = setting(
        SEND_TIMEOUT_S,
        "seconds a stream may wait for a client that reads nothing; then its request is "
        "aborted and its KV freed",
    )
    relay: str = setting(
        "multiplexed",
        "how decode streams reach this coordinator: 'multiplexed' (many requests' tokens per "
        "gRPC message, on one GenerateStreams call per decode worker) or 'per-stream' (a "
        "Generate call each)",
        choices=RELAYS,
    )
    prefill_timeout: float = setting(300.0, "seconds a prefill (compute + KV push) may take")
    stall_factor: float = setting(
        AttemptTimeouts.stall_factor,
        "a decoding stream silent for this many times its worker's expected step time (from "
        "the worker's reported step-cost model and load) is stalled: counted, logged and "
        "resumed on another decode worker; 0: no watch",
    )
    stall_floor_s: float = setting(
        AttemptTimeouts.stall_floor_s, "... but never before this many seconds of silence"
    )
    scale_wait_budget_s: float = setting(
        CapacityTargets.wait_budget_s,
        "splitserve_desired_workers sizes prefill so that queued prompt tokens are computed "
        "within this many seconds, on top of the arriving ones",
    )
    scale_utilization: float = setting(
        CapacityTargets.utilization,
        "splitserve_desired_workers sizes each role to this share of a worker's measured capacity",
    )
    metrics_port: int = setting(0, "Prometheus /metrics port (0: any free port, -1: off)")
    drain_timeout: float = setting(
        30.0, "on SIGTERM, seconds running streams may take to finish (new calls are refused)"
    )
    reflection: ReflectionSettings = default_group(ReflectionSettings)
    access: ClusterAccessSettings = default_group(ClusterAccessSettings)
    api_keys: ApiKeySettings = default_group(ApiKeySettings)
    health_needs_key: bool = setting(
        False,
        "with API keys, gRPC health checks on the public port need a key too (default: open, "
        "for probes)",
    )
    membership: MembershipSettings = default_group(MembershipSettings)
    tracing: TracingSettings = default_group(TracingSettings)

    def __post_init__(self) -> None:
        if not 0 < self.scale_utilization <= 1:
            raise ValueError(f"--scale-utilization must be in (0, 1], not {self.scale_utilization}")
        if self.scale_wait_budget_s <= 0:
            raise ValueError(
                f"--scale-wait-budget-s must be positive, not {self.scale_wait_budget_s}"
            )
        if not 0 < self.kv_share <= 1:
            raise ValueError(f"--kv-share must be in (0, 1], not {self.kv_share}")
        if not 0 <= self.ttft_at_risk <= 1:
            raise ValueError(f"--ttft-at-risk must be in [0, 1], not {self.ttft_at_risk}")

    @property
    def slo(self) -> Slo:
        """The latency targets of requests that set none."""
        return Slo(ttft_s=self.ttft_slo_ms / 1000, tpot_s=self.tpot_slo_ms / 1000)

    def capacity_targets(self) -> CapacityTargets:
        """What ``splitserve_desired_workers`` sizes the fleet for."""
        return CapacityTargets(
            tpot_s=self.slo.tpot_s,
            wait_budget_s=self.scale_wait_budget_s,
            utilization=self.scale_utilization,
        )

    def routing_config(self) -> RoutingConfig:
        return RoutingConfig(
            local_prefill_max_tokens=self.local_prefill_max_tokens,
            mode=self.placement,
            slo=self.slo,
            ttft_at_risk=self.ttft_at_risk,
        )

    def flow_config(self) -> FlowConfig:
        return FlowConfig(
            timeouts=AttemptTimeouts(
                prefill_s=self.prefill_timeout,
                stall_factor=self.stall_factor,
                stall_floor_s=self.stall_floor_s,
            )
        )

    def admission_config(self) -> AdmissionConfig:
        """Admission's config; its priors are the default targets until figures come."""
        slo = self.slo
        return AdmissionConfig(
            kv_share=self.kv_share,
            max_queued_requests=self.max_queued,
            max_queued_prompt_tokens=self.max_queued_prompt_tokens,
            max_queue_wait_s=self.max_queue_wait,
            prefill_backlog_s=self.prefill_backlog,
            within_tpot=self.admit_within_tpot,
            late_waiters_yield=self.late_waiters_yield,
            prior_tpot_s=slo.tpot_s,
            prior_ttft_s=slo.ttft_s,
        )
