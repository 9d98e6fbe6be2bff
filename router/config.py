"""Routing configuration: the YAML file's schema, validated once at start.

Every field is checked by pydantic; a mistake is reported with its exact path
(``models.0.decode.1.slots: Input should be greater than 0``) by
:func:`load_config`, which raises :class:`ConfigError` carrying all problems.
Every number has its bounds (seconds are positive and finite, counts at least 1 or 0,
ratios within [0, 1]), and fields that only make sense together are checked together, the
message naming both (``retries.backoff_max: must be at least backoff_initial (0.5), got
0.1``).
Secrets (API keys) are resolved here, once, and kept as ``SecretStr`` so they
never end up in logs or reprs. ``${VAR}`` references in the file are expanded before
validation (:mod:`router.config_env`), their problems reported with the file's others.
"""

from __future__ import annotations

import enum
import logging
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from router.config_env import ConfigPath, env_problem, expand_env, require_env

__all__ = [
    "AdaptiveConfig",
    "AdmissionConfig",
    "ApiKey",
    "AuthConfig",
    "BreakerConfig",
    "ConfigError",
    "ConnectionsConfig",
    "CorsConfig",
    "DecodeInstanceConfig",
    "DiscoveryConfig",
    "HealthConfig",
    "KeptTurnsConfig",
    "KeyLimits",
    "KubernetesDiscoveryConfig",
    "KvEventsConfig",
    "LimitsConfig",
    "ListenConfig",
    "LoraConfig",
    "MigrationConfig",
    "Mode",
    "ModelConfig",
    "PolicyName",
    "PrefillInstanceConfig",
    "RetryConfig",
    "RouterConfig",
    "SessionConfig",
    "TimeoutConfig",
    "load_config",
    "parse_config",
]

log = logging.getLogger("pd_router.config")

# A model entry's keys renamed in a release, old -> new: the old one is accepted, with a
# warning, for one more release (CHANGELOG.md says when it goes).
RENAMED_MODEL_KEYS = {"kv_return": "kept_turns"}


class Mode(enum.StrEnum):
    """How a model's requests are split between prefill and decode engines."""

    PULL = "pull"  # NixlConnector: P first, D READs P's blocks
    PUSH = "push"  # NixlPushConnector: both legs at once, P WRITEs into D
    PUSH_SEQUENTIAL = "push-sequential"  # NixlPushConnector, P first (upstream toy order)
    PIPELINED = "pipelined"  # this project's connector: layer-pipelined WRITEs
    AGGREGATED = "aggregated"  # D alone, no disaggregation

    @property
    def uses_prefill(self) -> bool:
        return self is not Mode.AGGREGATED


PolicyName = Literal["round_robin", "least_loaded", "power_of_two", "random", "prefix_hash"]

# Seconds, rates and factors: a finite number (``.inf`` would overflow a Retry-After).
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    """Unknown keys are errors: a typo in the YAML must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)


# A ZMQ endpoint the router connects to: tcp://host:port or ipc://path.
_ZMQ_ENDPOINT = r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):[0-9]{1,5}|ipc://\S+)$"


# The most data-parallel ranks one entry may declare: each rank is an instance of its own (and
# a value of the bounded ``rank`` metrics label), so a typo like 80 for 8 is refused here.
MAX_DATA_PARALLEL_SIZE = 64


def engine_key(base_url: str, rank: int | None) -> str:
    """The name of one routed engine: its URL, or with data parallelism one rank behind it
    (``<url>#dp<rank>``). The router keys every per-engine table by it (slots, breakers,
    sessions, the KV index, kept turns)."""
    return base_url if rank is None else f"{base_url}#dp{rank}"


def split_engine_key(key: str) -> tuple[str, str]:
    """(URL, rank label) of an :func:`engine_key`: the rank as a string, "" without one."""
    url, sep, rank = key.rpartition("#dp")
    return (url, rank) if sep and rank.isdigit() else (key, "")


class _InstanceConfig(_Strict):
    url: AnyHttpUrl
    # The engine's ``--data-parallel-size``: one API server at ``url``, this many engine
    # cores behind it, each routed as an engine of its own (its legs pinned by the
    # ``X-data-parallel-rank`` header). Declared, not learned: vLLM reports it only on its
    # dev-mode ``/server_info``, and the ledger must know a rank's slots before its first
    # request (docs/deployment.md, "Data-parallel engines").
    data_parallel_size: int = Field(default=1, ge=1, le=MAX_DATA_PARALLEL_SIZE)
    # vLLM's KV events of this engine (kv_events in the model): its publisher and replay
    # endpoints; None: the URL's host with the model's kv_events ports.
    kv_events_endpoint: str | None = None
    kv_events_replay: str | None = None

    @field_validator("kv_events_endpoint", "kv_events_replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.match(_ZMQ_ENDPOINT, v):
            raise ValueError(f"must be tcp://host:port or ipc://path, got {v!r}")
        return v

    @field_validator("url")
    @classmethod
    def _no_path(cls, v: AnyHttpUrl) -> AnyHttpUrl:
        if v.path not in (None, "", "/"):
            raise ValueError("must be a base URL without a path (the router adds /v1/...)")
        return v

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")

    @property
    def ranks(self) -> list[int | None]:
        """The engines this entry routes to: None (the URL's one engine, legs sent without
        a rank), or each data-parallel rank."""
        if self.data_parallel_size == 1:
            return [None]
        return list(range(self.data_parallel_size))

    @property
    def keys(self) -> list[str]:
        """:func:`engine_key` of each of :attr:`ranks`."""
        return [engine_key(self.base_url, r) for r in self.ranks]


class PrefillInstanceConfig(_InstanceConfig):
    """A prefill engine. The NIXL identity is optional: learned from P's responses. With
    ``data_parallel_size`` above 1, ``engine_id`` and ``kv_port`` are the ones given to
    ``vllm serve``: rank ``r`` is ``<engine_id>_dp<r>`` at a port offset by ``r``."""

    engine_id: str | None = None
    kv_host: str | None = None
    kv_port: int | None = Field(default=None, ge=1, le=65535)
    tp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)


class DecodeInstanceConfig(_InstanceConfig):
    """A decode engine and the number of concurrent requests the router may place on it
    (on each of its data-parallel ranks, with ``data_parallel_size`` above 1)."""

    slots: int = Field(default=64, ge=1)
    engine_id: str | None = None  # pipelined mode: D's NIXL identity, sent to P
    kv_host: str | None = None
    kv_port: int | None = Field(default=None, ge=1, le=65535)
    # Pipelined mode: sent to P where they differ from P's (the connector maps KV heads); with
    # data_parallel_size above 1, each rank's side-channel port is offset by its TP x PP
    # workers (connector/metadata.py).
    tp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)


class PolicyConfig(_Strict):
    prefill: PolicyName = "least_loaded"
    decode: PolicyName = "least_loaded"


class KubernetesDiscoveryConfig(_Strict):
    """Find a model's P and D pods by label selector (see :mod:`router.discovery`).

    A pod's NIXL identity comes from its annotations (``pd-router.io/engine-id``,
    ``pd-router.io/kv-port``, ``pd-router.io/slots``, ``pd-router.io/port``) with the
    defaults below; its IP is both the HTTP host and ``kv_host``.
    """

    namespace: str | None = None  # None: the router pod's own namespace, else "default"
    prefill_selector: str | None = None
    decode_selector: str = Field(min_length=1)
    port: int = Field(default=8000, ge=1, le=65535)
    kv_port_default: int = Field(default=5600, ge=1, le=65535)
    slots_default: int = Field(default=64, ge=1)
    # Talk to this URL without credentials (``kubectl proxy``, tests); None: the
    # in-cluster service account, else the local kubeconfig.
    api_url: AnyHttpUrl | None = None
    # Server-side watch timeout: each watch is renewed after this long.
    watch_seconds: int = Field(default=300, ge=1)


class DiscoveryConfig(_Strict):
    kubernetes: KubernetesDiscoveryConfig


_SESSION_HEADERS = [
    "x-session-id",
    "session-id",
    "x-conversation-id",
    "conversation-id",
    "x-dynamo-session-id",
    "thread-id",
]


class SessionConfig(_Strict):
    """Soft session affinity for P and D (router/engines/affinity.py).

    A request's session is the first of ``headers`` it carries, else the ``body_field`` of
    its JSON body (removed before the body reaches an engine), else, with
    ``prefix_fallback``, the start of its prompt or messages (a conversation's history
    starts the same at every turn). Off by default, the fallback would pin every request
    with a shared prompt start (a common system prompt) to one engine until it nears its
    capacity, in place of the ``policy``.

    Spill rule: a session stays on its engine while the engine's load, this request
    included, is at most ``max(1, floor(spill_at x capacity))``; capacity is a D's ``slots``
    and, P having no slots, ``prefill_capacity`` prompts in flight for a P. Load is this
    router's count, or with ``admission.replicas > 1`` what the engine reports, so replicas
    spill alike. A session spilled (or new) goes to the first engine with room in its
    rendezvous-hash order, else to the least loaded. ``load_factor`` no longer bounds
    sessions: it is the load bound of cache-aware routing (``kv_events``) alone."""

    enabled: bool = True
    headers: list[str] = Field(default_factory=lambda: list(_SESSION_HEADERS))
    body_field: str | None = "session_id"
    prefix_fallback: bool = False
    spill_at: float = Field(default=0.9, gt=0.0, le=1.0, allow_inf_nan=False)
    prefill_capacity: int = Field(default=16, ge=1)
    load_factor: float = Field(default=1.25, ge=1.0, allow_inf_nan=False)
    max_sessions: int = Field(default=100_000, ge=1)
    ttl_seconds: PositiveFloat = 1800.0

    @field_validator("headers")
    @classmethod
    def _lower(cls, v: list[str]) -> list[str]:
        return [h.lower() for h in v]


class KeptTurnsConfig(_Strict):
    """Kept turns (router/pd/kept_turn_params.py, its table router/engines/kept_turns.py): D
    keeps a finished turn's blocks and the conversation's next P reads them instead of
    recomputing the history. In pull mode with
    vLLM's ``bidirectional_kv_xfer`` (both engines must run with it; vLLM's D then holds
    every finished request's blocks until a P reads them or its ``decoder_kv_blocks_ttl``
    ends, which costs D capacity); in pipelined mode with this project's connector, which
    keeps only the turns the router asks it to (``connector/kept_turns.py``), streamed or not.
    Off by default.

    ``ttl_seconds`` must stay below the engines' ``decoder_kv_blocks_ttl`` (vLLM's default
    480) or the connector's ``keep_ttl_s`` (300): the router never hands P blocks D may
    already have freed. In pull mode a turn reuses at most
    ``max_entries`` kept turns (least recently kept dropped first), and only turns whose
    verified common prefix with the new prompt is at least ``min_tokens`` long (vLLM's
    ``kv_recompute_threshold`` is the same idea, on P)."""

    enabled: bool = False
    ttl_seconds: PositiveFloat = 240.0
    min_tokens: int = Field(default=64, ge=1)
    max_entries: int = Field(default=10_000, ge=1)


class KvEventsConfig(_Strict):
    """vLLM's KV cache events (``router/kvindex``): the router follows what every P and D of
    the model holds in its prefix cache and routes each request, with or without a session,
    to the engines that would compute (or receive) the fewest of its prompt tokens, load
    counted. The engines run with ``--kv-events-config`` (``docs/kv-events.md``). Off by
    default.

    Each engine publishes on ``port`` of its URL's host and answers replays on
    ``replay_port`` (None: no replay; an engine is then known only from its first event and
    stays unknown after a gap), unless the instance names its own endpoints. ``topic``: the
    engines' ``topic``. The index keeps at most ``max_blocks_per_engine`` blocks per engine
    (least recently stored dropped first); every ``verify_interval`` seconds without an
    event each stream is checked against its replay buffer; a replay that does not answer
    within ``replay_timeout`` leaves the engine unknown (routed as without events).

    ``load_cost_tokens``: what one more request on an engine costs, in prompt tokens to
    compute: an engine is chosen by ``uncached prompt tokens + load_cost_tokens x load``,
    among those within the sessions' load bound (``sessions.load_factor``). The router gets a
    request's token ids from an engine's ``/tokenize``, within ``tokenize_timeout`` seconds
    (else the request is routed as without events)."""

    enabled: bool = False
    port: int = Field(default=5557, ge=1, le=65535)
    replay_port: int | None = Field(default=5558, ge=1, le=65535)
    topic: str = ""
    max_blocks_per_engine: int = Field(default=262_144, ge=1)
    verify_interval: PositiveFloat = 10.0
    replay_timeout: PositiveFloat = 2.0
    load_cost_tokens: int = Field(default=256, ge=0)
    tokenize_timeout: PositiveFloat = 2.0

    @field_validator("replay_port")
    @classmethod
    def _two_ports(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v == info.data.get("port"):
            raise ValueError(f"must differ from port ({v}): the publisher has both")
        return v


class AutoscalingConfig(_Strict):
    """The targets the demand gauges are computed for (``router/demand.py``,
    ``pdrouter_autoscale_desired_engines``): P kept at ``prefill_utilization`` of its
    measured prefill capacity (the headroom that keeps prompts from queueing behind each
    other), D at a step time of ``tpot_ms`` per output token (None: D's demand is not
    computed)."""

    prefill_utilization: float = Field(default=0.7, gt=0, le=1)
    tpot_ms: PositiveFloat | None = None


class LoraConfig(_Strict):
    """LoRA adapters served on this model's engines (``router/engines/adapters.py``,
    ``docs/operations.md#lora-adapters``). Off by default: a request naming anything but the
    model is then an unknown model (404), and no engine is asked for its adapters.

    With ``enabled``, every engine's ``GET /v1/models`` is read when it answers its first
    health check, when it comes back, and then at the first health check at least
    ``refresh_interval`` seconds after the last read (never on a request's path); an
    adapter is a card whose ``parent`` is set. A request naming an adapter goes to a P and
    a D that both hold it (D alone: a D that holds it); none: vLLM's 404.
    ``max_adapter_labels``: adapters with a label of their own in
    ``pdrouter_lora_requests_total``, the first seen first; the rest count as ``other``
    (a bounded label set, whatever the clients send).

    ``modules``: adapters the router may load itself, name to path as the engines see it
    (``router/engines/adapter_loads.py``). A request for one goes to engines that hold it
    where a P and a D do, else to the usual engines, and each chosen engine that lacks it
    is first asked to load it (``POST /v1/load_lora_adapter``; the engines run with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), once per engine however many requests wait,
    within ``load_timeout`` seconds; a failed load answers a 502 ``adapter_load_failed``."""

    enabled: bool = False
    refresh_interval: float = Field(default=10.0, gt=0, le=3600, allow_inf_nan=False)
    max_adapter_labels: int = Field(default=32, ge=0, le=1000)
    modules: dict[str, str] = Field(default_factory=dict)
    load_timeout: float = Field(default=60.0, gt=0, le=3600, allow_inf_nan=False)

    @field_validator("modules")
    @classmethod
    def _named_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not name.strip() or not path.strip():
                raise ValueError(f"an adapter needs a name and a path, got {name!r}: {path!r}")
        return v

    @model_validator(mode="after")
    def _modules_need_enabled(self) -> LoraConfig:
        if self.modules and not self.enabled:
            raise ValueError("modules needs enabled: true (the router must know who holds what)")
        return self


class AdaptiveConfig(_Strict):
    """The per-request choice between P/D, D alone and P alone (``router/pd/adaptive.py``;
    the rule in ``docs/policy.md``). Off by default: every request is then served as the
    model's ``mode`` says.

    ``ttft_ms`` and ``tpot_ms`` are the SLO a request served by one engine must keep: its own
    TTFT, and the TPOT of the streams that engine is decoding while it computes this prompt.
    ``stall_tokens``: the output tokens over which a stream's TPOT spreads one stall (the
    typical answer length: a 1-second stall adds 1000/stall_tokens ms to its TPOT).
    ``single_engine``: which engine may serve a request alone: only D (the default: P keeps
    to prefills, since a stream P serves alone waits behind every P/D prompt P is given after
    it), ``either`` (D first: every prompt D computes is one the rule gave it), or only P."""

    enabled: bool = False
    ttft_ms: float = Field(default=1500.0, gt=0, le=3_600_000, allow_inf_nan=False)
    tpot_ms: float = Field(default=40.0, gt=0, allow_inf_nan=False)  # at most ttft_ms
    stall_tokens: int = Field(default=64, ge=1, le=1_000_000)
    single_engine: Literal["decode", "either", "prefill"] = "decode"

    @model_validator(mode="after")
    def _ttft_not_below_tpot(self) -> AdaptiveConfig:
        # The first token costs at least one step: a TTFT target under the TPOT one is a typo.
        if self.ttft_ms < self.tpot_ms:
            raise ValueError(
                f"ttft_ms ({self.ttft_ms:g}) must be at least tpot_ms ({self.tpot_ms:g}): "
                "the first token takes at least one decode step"
            )
        return self


class ModelConfig(_Strict):
    name: str = Field(min_length=1)
    mode: Mode = Mode.PUSH
    # Instances found at run time; the static lists below may then be empty. Declared
    # before them so that their validator can see it.
    discovery: DiscoveryConfig | None = None
    prefill: list[PrefillInstanceConfig] = Field(default_factory=list)
    decode: list[DecodeInstanceConfig] = Field(default_factory=list, validate_default=True)
    policy: PolicyConfig = PolicyConfig()
    sessions: SessionConfig = SessionConfig()
    kept_turns: KeptTurnsConfig = KeptTurnsConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    adaptive: AdaptiveConfig = AdaptiveConfig()
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    lora: LoraConfig = LoraConfig()
    # Prompts estimated shorter than this go to D alone: a prefill that small costs
    # less than the handoff. 0 disables conditional disaggregation.
    disagg_min_prompt_tokens: int = Field(default=0, ge=0)
    # When every routable P already runs this many prefill legs for this router, and a D has
    # fewer D-alone prompts still before their first token than that, a new request is served
    # by D alone (D computes its prompt) instead of queueing behind them: P/D pays off while P
    # keeps up, and one engine beats a saturated P. 0 disables it.
    disagg_max_prefill_queue: int = Field(default=0, ge=0)
    # The model's context length; None: read from the engines' /v1/models (max_model_len).
    max_model_len: int | None = Field(default=None, ge=1)
    # "checked": P and D are paired only where their vLLM versions and block sizes let the
    # mode's handshake succeed (router/engines/pairing.py); "any": every pair (engines run
    # with enforce_handshake_compat false).
    pairing: Literal["checked", "any"] = "checked"
    # The engines run with ``--scheduling-policy priority``: the legs carry the request's
    # priority. False: a non-zero priority is never sent (vLLM documents it as an error on an
    # engine without priority scheduling; 0.32 ignores it).
    engine_priority_scheduling: bool = False

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """An old key (:data:`RENAMED_MODEL_KEYS`) is read as its new name, with a warning;
        both at once is an error, since they would disagree."""
        if not isinstance(data, dict) or not RENAMED_MODEL_KEYS.keys() & data.keys():
            return data
        renamed = dict(data)
        for old, new in RENAMED_MODEL_KEYS.items():
            if old not in renamed:
                continue
            if new in renamed:
                raise ValueError(f"{old} is the old name of {new}: give only {new}")
            log.warning(
                "event=config_key_renamed model=%s old=%s new=%s: rename it in the file; "
                "the old name goes in the next release",
                data.get("name"),
                old,
                new,
            )
            renamed[new] = renamed.pop(old)
        return renamed

    @field_validator("decode")
    @classmethod
    def _decode_given(
        cls, v: list[DecodeInstanceConfig], info: ValidationInfo
    ) -> list[DecodeInstanceConfig]:
        if not v and info.data.get("discovery") is None:
            raise ValueError("List should have at least 1 item (or add a discovery section)")
        return v

    @model_validator(mode="after")
    def _check_roles(self) -> ModelConfig:
        if self.name in self.lora.modules:
            raise ValueError(
                f"lora.modules: {self.name!r} is the model's own name (vLLM refuses an adapter "
                "named as its base model)"
            )
        if self.kept_turns.enabled and self.mode not in (Mode.PULL, Mode.PIPELINED):
            raise ValueError(
                f"kept_turns needs mode 'pull' or 'pipelined', not {self.mode.value!r}: "
                "vLLM 0.32's bidirectional KV transfer exists in NixlConnector only, and "
                "this project's connector has its own"
            )
        if self.adaptive.enabled and not self.mode.uses_prefill:
            raise ValueError(
                "adaptive needs a disaggregated mode: in 'aggregated' every request is served "
                "by D alone already"
            )
        if self.adaptive.enabled and self.kept_turns.enabled:
            raise ValueError(
                "adaptive and kept_turns cannot both be on: a turn served by one engine keeps "
                "nothing on D for the next turn's P to read"
            )
        if self.discovery is not None:
            if self.mode.uses_prefill and not self.discovery.kubernetes.prefill_selector:
                raise ValueError(
                    f"mode {self.mode.value!r} needs discovery.kubernetes.prefill_selector"
                )
        elif self.mode.uses_prefill and not self.prefill:
            raise ValueError(f"mode {self.mode.value!r} needs at least one prefill instance")
        if self.mode is Mode.PIPELINED:
            insts: list[PrefillInstanceConfig | DecodeInstanceConfig] = [
                *self.prefill,
                *self.decode,
            ]
            for inst in insts:
                if not (inst.engine_id and inst.kv_host and inst.kv_port):
                    role = "prefill" if isinstance(inst, PrefillInstanceConfig) else "decode"
                    raise ValueError(
                        f"{role} {inst.base_url}: mode 'pipelined' needs engine_id, kv_host "
                        "and kv_port"
                    )
        self._check_data_parallel()
        urls = [i.base_url for i in (*self.prefill, *self.decode)]
        dup = {u for u in urls if urls.count(u) > 1}
        if dup:
            raise ValueError(f"instance URL listed twice: {sorted(dup)}")
        self._check_context()
        return self

    def _check_data_parallel(self) -> None:
        """Every rank's ports must fit: its KV-events ports and its side-channel port are the
        engine's plus the rank (plus TP x PP workers per rank, this project's connector)."""
        insts: list[PrefillInstanceConfig | DecodeInstanceConfig] = [*self.prefill, *self.decode]
        for inst in insts:
            last = inst.data_parallel_size - 1
            if last == 0:
                continue
            role = "prefill" if isinstance(inst, PrefillInstanceConfig) else "decode"
            for name in ("kv_events_endpoint", "kv_events_replay"):
                endpoint = getattr(inst, name)
                if endpoint is not None and not endpoint.startswith("tcp://"):
                    raise ValueError(
                        f"{role} {inst.base_url}: {name} must be tcp:// with "
                        "data_parallel_size above 1 (vLLM offsets each rank's port; it "
                        "refuses other transports)"
                    )
            step = inst.tp_size * inst.pp_size if self.mode is Mode.PIPELINED else 1
            if inst.kv_port is not None and inst.kv_port + last * step > 65535:
                raise ValueError(
                    f"{role} {inst.base_url}: kv_port {inst.kv_port} leaves no side-channel "
                    f"port for data-parallel rank {last} (the port plus {last * step})"
                )
            self._check_events_ports(f"{role} {inst.base_url}", inst, last)

    def _check_events_ports(
        self, name: str, inst: PrefillInstanceConfig | DecodeInstanceConfig, last: int
    ) -> None:
        """The model's KV-events ports, offset by each rank up to ``last``: distinct, in range."""
        ev = self.kv_events
        if not ev.enabled or inst.kv_events_endpoint is not None:
            return
        if ev.replay_port is not None and abs(ev.port - ev.replay_port) <= last:
            raise ValueError(
                f"{name}: kv_events port {ev.port} and replay_port {ev.replay_port} must be "
                f"at least data_parallel_size ({inst.data_parallel_size}) apart: each rank "
                "binds both plus its rank"
            )
        top = max(ev.port, ev.replay_port or 0)
        if top + last > 65535:
            raise ValueError(
                f"{name}: kv_events port {top} leaves no port for data-parallel rank {last} "
                "(each rank publishes on the port plus its rank)"
            )

    def _check_context(self) -> None:
        """Thresholds in tokens that a prompt must reach, against the context it must fit."""
        context = self.max_model_len
        if context is None:
            return
        if self.disagg_min_prompt_tokens >= context:
            raise ValueError(
                f"disagg_min_prompt_tokens ({self.disagg_min_prompt_tokens}) must be below "
                f"max_model_len ({context}): no prompt that long fits the context, so none "
                "would be disaggregated"
            )
        if self.kept_turns.enabled and self.kept_turns.min_tokens >= context:
            raise ValueError(
                f"kept_turns.min_tokens ({self.kept_turns.min_tokens}) must be below "
                f"max_model_len ({context}): no turn that long fits the context, so none "
                "would be reused"
            )


class TimeoutConfig(_Strict):
    """Seconds. ``total`` bounds a whole request, whatever else happens."""

    connect: PositiveFloat = 5.0
    prefill: PositiveFloat = 120.0
    decode_first_byte: PositiveFloat = 120.0
    idle: PositiveFloat = 60.0
    total: PositiveFloat = 1800.0


class PriorityClass(_Strict):
    """One priority class: vLLM's ``priority`` value for it (lower is more urgent)."""

    priority: int = Field(ge=-(2**31), lt=2**31)
    # The class's TTFT deadline: a request still waiting for a decode slot this long after it
    # arrived is refused (503, deadline_exceeded); x-slo-ttft-ms overrides it. None: none.
    ttft_deadline_ms: PositiveFloat | None = None


class AdmissionConfig(_Strict):
    """Bounded queue for requests that find no free decode slot: by priority class, then
    fair between API keys (router/engines/fair_queue.py, router/priority.py)."""

    queue_size: int = Field(default=1024, ge=0)
    max_wait: PositiveFloat = 30.0
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    # Router replicas sharing the same decode engines. Above 1, each replica reads
    # every decode engine's own load (see router/engines/load.py) and takes only its
    # fair part of the capacity the engine reports free.
    replicas: int = Field(default=1, ge=1)
    # Named classes; a request picks one by the x-priority header (a name) or the body's
    # vLLM ``priority`` (a configured value). Empty: one class, priority passed as given.
    priority_classes: dict[str, PriorityClass] = Field(default_factory=dict)
    # The class of a request that names none; None: vLLM's default, priority 0.
    default_priority_class: str | None = None
    # Seconds of waiting that raise a queued request's class by one level (no starvation).
    priority_aging: PositiveFloat = 10.0

    @model_validator(mode="after")
    def _default_class_known(self) -> AdmissionConfig:
        name = self.default_priority_class
        if name is not None and name not in self.priority_classes:
            known = ", ".join(sorted(self.priority_classes)) or "none configured"
            raise ValueError(f"default_priority_class {name!r} is not a priority class ({known})")
        values = [c.priority for c in self.priority_classes.values()]
        if len(values) != len(set(values)):
            raise ValueError("two priority classes have the same priority value")
        return self


class RetryConfig(_Strict):
    """Retries happen only before the first byte reaches the client."""

    max_attempts: int = Field(default=2, ge=1)
    backoff_initial: float = Field(default=0.05, ge=0, allow_inf_nan=False)
    backoff_max: float = Field(default=1.0, ge=0, allow_inf_nan=False)

    @field_validator("backoff_max")
    @classmethod
    def _max_not_below_initial(cls, v: float, info: ValidationInfo) -> float:
        # A cap below the first wait would silently make every wait the cap.
        initial = info.data.get("backoff_initial")
        if initial is not None and v < initial:
            raise ValueError(f"must be at least backoff_initial ({initial:g}), got {v:g}")
        return v


class MigrationConfig(_Strict):
    """Mid-stream migration (docs/operations.md#migration): a streamed completion or chat
    completion whose D leg fails after the client's first byte is continued on another
    engine, with the tokens generated so far as the prompt's tail.

    ``max_attempts`` continuations per request (0: off, D's failure ends the stream with an
    SSE error event as before). ``stall_timeout``: seconds without a byte from D, once its
    stream has started, after which D counts as stalled and the request moves on.
    ``prefill_alone``: with no other D in rotation, a P serves the continuation alone."""

    max_attempts: int = Field(default=2, ge=0, le=100)
    stall_timeout: PositiveFloat = 30.0
    # Non-streamed requests too: D's leg is streamed to the router and the answer assembled
    # there (vLLM's fields, the router's bytes). Off: a non-streamed answer is D's own, and a
    # D failing before it is whole is retried from the start (``retries``).
    non_streamed: bool = False
    # In a disaggregated mode, when no D that has not failed this request is in rotation (the
    # only D died), the continuation is served by a P alone (``prefill_alone``, as the adaptive
    # rule serves a request: P is a whole vLLM engine). Off: no migration without another D.
    prefill_alone: bool = True

    @property
    def enabled(self) -> bool:
        return self.max_attempts > 0


class BreakerConfig(_Strict):
    """Outlier detection per instance (rules in router/engines/breaker.py and docs/operations.md).

    A refused connection ejects at once; ``failure_threshold`` engine faults in a row
    (timeouts, resets, dropped streams, 502/503/504) eject; ``consecutive_5xx`` error
    answers in a row eject unless the instance is the last of its role in rotation.
    An ejection lasts ``open_seconds``, or until a health probe answers again.
    """

    failure_threshold: int = Field(default=5, ge=1)
    consecutive_5xx: int = Field(default=5, ge=1)
    open_seconds: PositiveFloat = 10.0


class HealthConfig(_Strict):
    interval: PositiveFloat = 5.0
    # A vLLM API server on a saturated host can take seconds to answer /health (one took
    # 9.9 s next to a CPU hog here): a short timeout or a single pair of misses takes a
    # working engine out of rotation. Dead engines are caught sooner by the request path
    # (connection refused fails the attempt, which is retried on another pair).
    timeout: PositiveFloat = 5.0
    unhealthy_after: int = Field(default=3, ge=1)
    # KV usage (0..1) above which an idle decode engine counts as holding leaked blocks.
    leak_usage_epsilon: float = Field(default=0.0, ge=0, lt=1)
    # With admission.replicas > 1: how often each decode engine's load is read.
    load_interval: PositiveFloat = 1.0


class KeyLimits(_Strict):
    """What one API key may use (None: unbounded). ``requests_per_second`` refills a
    token bucket of ``burst`` requests (default: the rate rounded up, at least 1)."""

    max_concurrent: int | None = Field(default=None, ge=1, le=1_000_000)
    requests_per_second: float | None = Field(default=None, gt=0, le=1_000_000)
    burst: int | None = Field(default=None, ge=1, le=1_000_000)

    @field_validator("burst")
    @classmethod
    def _burst_needs_rate(cls, v: int | None, info: ValidationInfo) -> int | None:
        # Without a rate there is no bucket: the burst would be silently ignored.
        if v is not None and info.data.get("requests_per_second") is None:
            raise ValueError("needs requests_per_second (it sizes that rate's bucket)")
        return v

    @property
    def bucket_size(self) -> int:
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.requests_per_second or 1))


# A key's name is a metric label and a log field: short, printable, no spaces or quotes.
_KEY_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"


class ApiKey(_Strict):
    """A client key with a name (what metrics and logs show, never the key) and, if set,
    its own limits instead of ``limits.per_key``."""

    name: str = Field(pattern=_KEY_NAME)
    key: SecretStr
    limits: KeyLimits | None = None
    # The priority class of this key's requests that name none (admission.priority_classes).
    priority_class: str | None = None

    @field_validator("key")
    @classmethod
    def _not_empty(cls, v: SecretStr) -> SecretStr:
        if not v.get_secret_value().strip():
            raise ValueError("must not be empty")
        return v


class AuthConfig(_Strict):
    """Client keys (``Authorization: Bearer``) and the key sent to the engines.

    Keys may be given inline (``${VAR}`` references included) or as the name of an
    environment variable (``*_env``); either way they are read once here. ``keys`` names
    each key (and may give it limits); a key of ``api_keys`` is named by its position,
    ``api_keys.0``, ``api_keys.1``, ... (those of ``api_keys_env`` follow the inline ones).
    """

    keys: list[ApiKey] = Field(default_factory=list)
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_keys_env: str | None = None
    upstream_api_key: SecretStr | None = None
    upstream_api_key_env: str | None = None

    @field_validator("api_keys")
    @classmethod
    def _no_empty_key(cls, keys: list[SecretStr]) -> list[SecretStr]:
        # An empty key would let "Authorization: Bearer " in.
        if any(not k.get_secret_value().strip() for k in keys):
            raise ValueError("a key must not be empty")
        return keys

    @field_validator("keys")
    @classmethod
    def _distinct(cls, keys: list[ApiKey]) -> list[ApiKey]:
        names = [k.name for k in keys]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"key name listed twice: {dup}")
        if any(n.startswith("api_keys.") or n == "anonymous" for n in names):
            raise ValueError("key names 'anonymous' and 'api_keys.<n>' are the router's own")
        return keys

    def named_keys(self) -> list[ApiKey]:
        """Every client key with its name: ``keys``, then ``api_keys`` by position."""
        # Not validated again: an empty key here is a variable already reported missing.
        positional = [
            ApiKey.model_construct(name=f"api_keys.{i}", key=k, limits=None)
            for i, k in enumerate(self.api_keys)
        ]
        return [*self.keys, *positional]

    @field_validator("api_keys_env", "upstream_api_key_env")
    @classmethod
    def _env_is_set(cls, name: str | None) -> str | None:
        # A field validator, so that each missing variable is reported at its own path.
        problem = env_problem(name) if name else None
        if problem:
            raise ValueError(problem)
        return name

    @model_validator(mode="after")
    def _resolve_env(self) -> AuthConfig:
        keys = list(self.api_keys)
        if self.api_keys_env:
            raw = require_env(self.api_keys_env)
            keys += [SecretStr(k.strip()) for k in raw.split(",") if k.strip()]
        upstream = self.upstream_api_key
        if self.upstream_api_key_env:
            upstream = SecretStr(require_env(self.upstream_api_key_env))
        object.__setattr__(self, "api_keys", keys)
        object.__setattr__(self, "upstream_api_key", upstream)
        values = [k.key.get_secret_value() for k in self.named_keys()]
        values = [v for v in values if v]  # missing variables are reported on their own
        if len(set(values)) != len(values):
            # One key under two names would make its limits and metrics ambiguous.
            raise ValueError("the same key is given twice (keys must be distinct)")
        return self


class LimitsConfig(_Strict):
    """Per-key limits and the bounds every request is checked against before any work.

    ``per_key`` applies to every key without limits of its own (and, without keys, to all
    clients together). ``max_tokens`` caps the output tokens a request may ask for
    (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``) and is given to
    requests that name none; ``max_n`` caps ``n``, ``max_prompts`` the prompts of one
    completions request (vLLM's ``VLLM_MAX_COMPLETION_PROMPTS`` default). With
    ``tokenize_long_prompts``, a text prompt whose size could exceed the model's context
    is counted by an engine's ``/tokenize`` before any slot is taken."""

    per_key: KeyLimits = KeyLimits()
    max_tokens: int | None = Field(default=None, ge=1)
    max_n: int = Field(default=128, ge=1, le=16384)
    max_prompts: int = Field(default=1024, ge=1, le=1_000_000)
    tokenize_long_prompts: bool = True


class ConnectionsConfig(_Strict):
    """Bounds on client connections (per router process): slow and greedy clients.

    A request's head (request line and headers) must arrive within ``header_timeout``
    seconds of the connection (or of its first byte, on a kept-alive connection), its body
    within ``body_timeout`` of its head; a response that a client stops reading is cut
    after ``write_timeout`` seconds without progress once the client has left
    ``send_buffer_bytes`` (the socket's send buffer, which the kernel doubles) and the
    router's own 64 KiB unread (0: the kernel's default buffer, which grows to megabytes:
    a token stream would take minutes to fill it). A head (request line and headers; the
    body does not count) beyond ``max_header_bytes`` or ``max_headers`` is answered 431;
    beyond ``max_open`` connections a new one is closed at once."""

    max_open: int = Field(default=16384, ge=1)
    header_timeout: PositiveFloat = 10.0
    body_timeout: PositiveFloat = 60.0
    write_timeout: PositiveFloat = 30.0
    send_buffer_bytes: int = Field(default=131072, ge=0, le=64 * 1024 * 1024)
    max_header_bytes: int = Field(default=65536, ge=1024, le=16 * 1024 * 1024)
    max_headers: int = Field(default=100, ge=8, le=10_000)


def _format_path(loc: ConfigPath) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _related(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """One path is the other or lies under it."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


class CorsConfig(_Strict):
    """Cross-origin requests from browsers, with the defaults of ``vllm serve`` 0.32
    (``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``,
    ``--allow-credentials``): no origin is allowed, so a browser's preflight is answered
    400 and a page on another origin cannot read an answer. List the origins of the web
    apps that may call the router (``["*"]``: any) to open it."""

    allowed_origins: list[str] = Field(default_factory=list)
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


class TracingConfig(_Strict):
    """OpenTelemetry traces over OTLP/HTTP; off unless ``endpoint`` is set. Engines started
    with ``--otlp-traces-endpoint`` join the same traces (``traceparent`` on both legs)."""

    endpoint: str | None = None  # e.g. http://otel-collector:4318/v1/traces
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)  # of traces started here
    service_name: str = "pd-router"


class LoggingConfig(_Strict):
    """``access``: one line per inference request on the ``pd_router.access`` logger (method,
    path, status, model, mode, decision, engines, TTFT, duration, ids). ``format: json``
    writes every router log record as one JSON object per line."""

    access: bool = False
    format: Literal["text", "json"] = "text"


class RouterConfig(_Strict):
    listen: ListenConfig = ListenConfig()
    models: list[ModelConfig] = Field(min_length=1)
    timeouts: TimeoutConfig = TimeoutConfig()
    admission: AdmissionConfig = AdmissionConfig()
    retries: RetryConfig = RetryConfig()
    migration: MigrationConfig = MigrationConfig()
    breaker: BreakerConfig = BreakerConfig()
    health: HealthConfig = HealthConfig()
    auth: AuthConfig = AuthConfig()
    cors: CorsConfig = CorsConfig()
    limits: LimitsConfig = LimitsConfig()
    connections: ConnectionsConfig = ConnectionsConfig()
    tracing: TracingConfig = TracingConfig()
    logging: LoggingConfig = LoggingConfig()
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model name listed twice: {dup}")
        return models

    @field_validator("auth")
    @classmethod
    def _key_classes_known(cls, auth: AuthConfig, info: ValidationInfo) -> AuthConfig:
        admission = info.data.get("admission")
        classes = admission.priority_classes if admission is not None else {}
        for i, key in enumerate(auth.keys):
            if key.priority_class is not None and key.priority_class not in classes:
                known = ", ".join(sorted(classes)) or "none configured"
                raise ValueError(
                    f"keys.{i}.priority_class {key.priority_class!r} is not a priority class "
                    f"({known})"
                )
        return auth

    @field_validator("limits")
    @classmethod
    def _cap_fits_the_context(cls, limits: LimitsConfig, info: ValidationInfo) -> LimitsConfig:
        # The cap is given to every request that names no output limit: over a model's
        # context, each such request would be refused.
        cap = limits.max_tokens
        for i, model in enumerate(info.data.get("models") or []):
            if cap is not None and model.max_model_len is not None and cap > model.max_model_len:
                raise ValueError(
                    f"max_tokens ({cap}) must be at most models.{i}.max_model_len "
                    f"({model.max_model_len}): a request that names no output limit is given "
                    "max_tokens, and would be refused"
                )
        return limits


class ConfigError(Exception):
    """The configuration is invalid; ``str()`` lists every problem with its path."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid configuration\n" + "\n".join(problems))


def _format_errors(exc: ValidationError, skip: list[tuple[str, ...]] | None = None) -> list[str]:
    """One line per error; those at, above or under a path in ``skip`` are left out."""
    out = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        if skip and any(_related(loc, s) for s in skip):
            continue
        msg = err["msg"].removeprefix("Value error, ")
        out.append(f"  {_format_path(err['loc'])}: {msg}")
    return out


def parse_config(data: Any, source: str = "<config>") -> RouterConfig:
    """Validate an already-parsed YAML/JSON document, ``${VAR}`` references included."""
    if not isinstance(data, dict):
        raise ConfigError(source, ["  (top level): expected a mapping"])
    missing: list[tuple[ConfigPath, str]] = []
    data = expand_env(data, (), missing)
    env_problems = [f"  {_format_path(path)}: {msg}" for path, msg in missing]
    try:
        cfg = RouterConfig.model_validate(data)
    except ValidationError as exc:
        # A value left empty by a missing variable is already reported: what the
        # schema says about it (or about what holds it) would only be noise.
        skip = [tuple(str(p) for p in path) for path, _ in missing]
        raise ConfigError(source, env_problems + _format_errors(exc, skip)) from None
    if env_problems:
        raise ConfigError(source, env_problems)
    return cfg


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a YAML routing file; raises :class:`ConfigError`."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, [f"  cannot read file: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"  YAML syntax: {exc}"]) from None
    return parse_config(data, source)
