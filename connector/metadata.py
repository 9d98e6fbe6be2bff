"""Wire format between P and D workers, and the per-step plan the scheduler hands its workers.

Every NIXL notification this connector sends is ``b"PDR" + JSON``; the JSON object carries
``"v"`` (``CONNECTOR_VERSION``) and ``"t"`` (the message kind). A message with another version is
never interpreted: the receiver answers ``REFUSE`` so both sides log a clear error.

Message kinds (``Kind``; ``tid`` = the router's ``transfer_id``):

============  =========  ==================================================================
kind          direction  meaning
============  =========  ==================================================================
``HELLO``     both       first message on a new agent pair: compatibility (``Compat``), the
                         sender's address and its registered KV layout (``CacheLayout``:
                         where the peer writes into it)
``REFUSE``    both       the peer's HELLO does not match; ``reason`` says which field
``REG``       D -> P     D's blocks for ``tid``: ``start`` (first logical block) and ``blocks``
``W``         P -> D     attached to every WRITE; delivered after that WRITE's data
``DONE``      P -> D     all ``writes`` WRITEs for ``tid`` were posted; D completes once it
                         has seen that many ``W`` notices
``FAIL``      P -> D     P gave up on ``tid`` (abort, error, timeout, unknown tid)
``ABORT``     D -> P     D gave up on ``tid`` (client gone, timeout): stop writing, free
``ACK``       D -> P     D's receive of ``tid`` completed (every ``W`` and ``DONE`` seen): P
                         may free its blocks and stop stepping for it
============  =========  ==================================================================

Kept turns (a finished turn kept on D for the conversation's next P; ``tid`` = the
*kept* turn's transfer id). The roles turn round: D writes, P receives, with ``W``/``DONE``/
``FAIL``/``ABORT`` meaning what they mean above:

============  =========  ==================================================================
``ASK``       P -> D     what do you hold for ``tid``? (the entry is taken: used once)
``HELD``      D -> P     ``tokens`` (how many tokens' KV) and ``hashes`` (the chained block
                         hashes of their ids, ``connector.kept_turns.prefix_hashes``)
``PULL``      P -> D     WRITE kept blocks ``start``.. into P's ``blocks``, then ``DONE``;
                         no ``blocks``: not wanted, free them
============  =========  ==================================================================
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from connector.address import NixlAddress

__all__ = [
    "CONNECTOR_VERSION",
    "Compat",
    "KeepSpec",
    "Kind",
    "Message",
    "RecvSpec",
    "SendSpec",
    "StepMeta",
    "WorkerRank",
    "agent_name",
    "decode",
    "encode",
]

# Version history (bump on any change to messages, their fields or their meaning):
#   1: HELLO/REFUSE/REG/W/DONE/FAIL/ABORT; JSON body after the b"PDR" prefix.
#   2: ASK/HELD/PULL (kept turns).
#   3: HELLO's Compat adds kv_layout, attn_backend, kv_cache_dtype, mem_type, use_mla, pp_size,
#      dp_size, dcp_size; its layout is one base address per layer (a block is one piece).
#   4: ACK (D -> P): P holds a send until D acknowledges it (a notice leaves NIXL only while
#      its sender progresses, so P must keep stepping until D has everything).
CONNECTOR_VERSION = 4

_PREFIX = b"PDR"


class Kind(enum.StrEnum):
    """Message kinds (the table above); each member's value is its ``"t"`` on the wire."""

    HELLO = "HELLO"
    REFUSE = "REFUSE"
    REG = "REG"
    W = "W"
    DONE = "DONE"
    FAIL = "FAIL"
    ABORT = "ABORT"
    ACK = "ACK"
    ASK = "ASK"
    HELD = "HELD"
    PULL = "PULL"
    # Never sent: ``decode``'s kind for a message of another wire version, so the receiver can
    # refuse that peer instead of misreading it.
    VERSION = "VERSION"


def agent_name(engine_id: str, tp_rank: int, pp_rank: int = 0) -> str:
    """Name of ``engine_id``'s NIXL agent for a worker (a rank talks to the peer's same rank).

    Deterministic, so a peer knows it from the engine id alone. Pipeline stage 0 keeps the
    name it had before stages were named.
    """
    stage = f"-pp{pp_rank}" if pp_rank else ""
    return f"pdr-{engine_id}{stage}-tp{tp_rank}"


@dataclass(frozen=True, slots=True)
class WorkerRank:
    """A worker's place in its engine. P's worker talks to D's worker with the same place (both
    engines run the same TP and PP sizes, which the handshake checks)."""

    tp_rank: int = 0
    pp_rank: int = 0
    tp_size: int = 1

    @property
    def index(self) -> int:
        """Position among the engine's workers (TP inner, as vLLM ranks them): the offset of
        this worker's NIXL listener from the engine's side-channel port."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def agent_name(self, engine_id: str) -> str:
        return agent_name(engine_id, self.tp_rank, self.pp_rank)


def engine_address(
    engine_id: str, base_port: int, dp_index: int, dp_size: int, workers: int
) -> tuple[str, int]:
    """(engine id, side-channel port) of one data-parallel rank of an engine: each rank is an
    engine of its own. vLLM already gives a rank's connector ``<engine_id>_dp<rank>`` (the
    suffix is added here only where it is missing), and the ports of a rank's ``workers``
    (TP x PP) workers follow the previous rank's."""
    # vLLM runs a dense model's DP ranks as independent engines with a DP size of 1 but keeps
    # the rank's index: the index alone says this is a DP rank.
    if (dp_size > 1 or dp_index > 0) and not engine_id.endswith(f"_dp{dp_index}"):
        engine_id = f"{engine_id}_dp{dp_index}"
    return engine_id, base_port + dp_index * workers


@dataclass(frozen=True, slots=True)
class Compat:
    """What two engines must agree on before KV blocks can be copied byte for byte.

    The fields after ``mem_type`` have defaults only for callers that build a worker by hand
    (tests, checks); ``HELLO`` always carries every field, and a peer's HELLO with the same
    ``version`` therefore does too.
    """

    version: int
    model: str
    dtype: str  # the KV cache tensors' torch dtype
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    block_bytes: int  # bytes of one block of one layer
    mem_type: str  # NIXL memory type of the registered cache: DRAM or VRAM
    kv_layout: str = ""  # vLLM's KVCacheLayout name: the byte order inside a block
    attn_backend: str = ""  # the attention backends' names, sorted, comma-separated
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype (fp8 variants share a torch dtype)
    use_mla: bool = False
    pp_size: int = 1
    dp_size: int = 1
    dcp_size: int = 1

    def mismatches(self, other: Compat, me: str = "local", peer: str = "peer") -> list[str]:
        """The fields that differ with both values, each labelled by its engine (``me``,
        ``peer``: their agent names), so the line reads the same in either engine's log."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {me}={mine[k]!r} {peer}={theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


@dataclass(frozen=True, slots=True)
class Message:
    """One decoded notification. ``body`` keeps the kind-specific fields."""

    kind: Kind
    tid: str = ""
    body: dict[str, Any] = field(default_factory=dict)


def encode(kind: Kind, tid: str = "", **body: Any) -> bytes:
    """Serialise one message; ``body`` values must be JSON-serialisable."""
    payload = {"v": CONNECTOR_VERSION, "t": kind.value, "tid": tid, **body}
    return _PREFIX + json.dumps(payload, separators=(",", ":")).encode()


def decode(raw: bytes) -> Message | None:
    """Parse a notification; None for foreign notifications and for kinds not in ``Kind``
    (which no handler would act on).

    A message of another version decodes as ``Kind.VERSION`` with the peer's version in
    ``body["v"]``, so the caller can refuse the peer instead of misreading it.
    """
    if not raw.startswith(_PREFIX):
        return None
    try:
        obj = json.loads(raw[len(_PREFIX) :])
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if obj.get("v") != CONNECTOR_VERSION:
        return Message(Kind.VERSION, str(obj.get("tid", "")), {"v": obj.get("v")})
    try:
        kind = Kind(str(obj.pop("t", "")))
    except ValueError:
        return None
    tid = str(obj.pop("tid", ""))
    obj.pop("v", None)
    return Message(kind, tid, obj)


# ---------------------------------------------------------------------------------------------
# Scheduler -> worker plan, rebuilt every step (travels inside KVConnectorMetadata).


@dataclass(slots=True)
class SendSpec:
    """P side: blocks of ``req_id`` whose KV this step computes (or that were prefix-cached).

    ``first_block`` is the logical index of ``block_ids[0]``; ``final`` marks the step that
    completes the prompt, after which the worker sends ``DONE`` once everything is posted.
    """

    req_id: str
    tid: str
    peer: NixlAddress
    first_block: int
    block_ids: list[int]
    num_tokens: int
    final: bool


@dataclass(slots=True)
class RecvSpec:
    """Blocks of ``req_id`` that the peer must fill, from logical block ``start_block`` on.

    D: P fills them with the prompt's KV (``REG``). ``pull`` (P): a kept turn's D fills them
    with its KV of ``num_tokens`` more tokens (``PULL``; ``tid`` is the kept turn's).
    """

    req_id: str
    tid: str
    peer: NixlAddress
    start_block: int
    block_ids: list[int]
    num_tokens: int
    pull: bool = False


@dataclass(slots=True)
class KeepSpec:
    """D side: a finished request whose blocks stay for a next turn's P (``tid`` is its
    transfer id): ``block_ids`` hold the KV of its first ``num_tokens`` tokens, whose chained
    hashes (``connector.kept_turns.prefix_hashes``) are ``hashes``."""

    req_id: str
    tid: str
    block_ids: list[int]
    num_tokens: int
    hashes: list[str]


@dataclass(slots=True)
class StepMeta:
    """Everything the scheduler tells its workers in one step.

    ``fail_sends`` (P: request aborted or errored; notify D, stop, free) and ``abort_recvs``
    (D: request aborted while waiting; notify P, report the receive finished) map
    ``req_id -> (tid, peer)`` so the worker can act even for requests it never saw.
    ``keeps`` (D: finished turns to keep), ``asks`` (P: ``req_id -> (kept tid, D)``, what
    does D hold) and ``releases`` (P: ``kept tid -> D``, not wanted after all) are the kept
    turns' (see the second table above); ``expecting`` and ``unexpected`` (D: keep ids of
    requests admitted to be kept, and of those that finished without being kept) tell D's
    worker which ASKs may wait for a turn still running and which are refused at once.
    """

    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    fail_sends: dict[str, tuple[str, NixlAddress]] = field(default_factory=dict)
    abort_recvs: dict[str, tuple[str, NixlAddress]] = field(default_factory=dict)
    keeps: list[KeepSpec] = field(default_factory=list)
    asks: dict[str, tuple[str, NixlAddress]] = field(default_factory=dict)
    releases: dict[str, NixlAddress] = field(default_factory=dict)
    expecting: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.sends
            or self.recvs
            or self.fail_sends
            or self.abort_recvs
            or self.keeps
            or self.asks
            or self.releases
            or self.expecting
            or self.unexpected
        )
