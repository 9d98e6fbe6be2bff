"""Worker-level check: the connector's P and D halves with real NIXL agents, KV written late.

Usage: ``python -m scripts.gpu_check.worker_check --device cuda`` (or ``cpu``).

For each ``write_batch`` mode (``layer``, ``step``) and readiness gate (on; off: the negative
control), two ``connector.worker.WorkerSide``s with real NIXL agents (``ObservedAgent``, a
``RealNixlAgent``) are built in this process, each over KV tensors in vLLM 0.32's per-layer
layout over one buffer on the device (``kv``: VRAM on CUDA, DRAM on CPU). Every ``steps.CASES``
prompt is then transferred with the hooks called in vLLM's order: D's plan bound, and once D's
REG has reached P, per P step ``bind``, per layer the kernel that writes the layer's KV (late,
``kernels``) then ``save_layer`` (skipped in a full-graph step), ``end_step``,
``get_finished``; then both sides step until D reports the receive and P the send, within a
deadline.

Checked per case: D's bytes as they are in the step D reports the receive (when vLLM would
start decoding on them) equal P's final bytes for every layer and block of the prompt, P's own
cache holds them, and the bytes P wrote (its stats) equal the bytes D received. P's readiness
is the connector's own pick on CUDA (an event per mark), ``kernels.SimReadiness`` on CPU. With
the gate off (``HostReadiness``, what ``readiness_gate: false`` gives) the connector posts
layers before their kernels land: D's bytes must differ (always on CPU, where
``kernels.SimKernels`` makes the race certain; on CUDA the result is reported, as a race may
or may not show).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.address import NixlAddress
from connector.metadata import CONNECTOR_VERSION, StepMeta, agent_name
from connector.worker import WorkerSide
from router.stack.ports import pick_ports
from scripts.gpu_check import kv
from scripts.gpu_check.agent import ObservedAgent
from scripts.gpu_check.kernels import CudaKernels, Index, Kernels, SimKernels, write
from scripts.gpu_check.report import table
from scripts.gpu_check.steps import CASES, Case, prefill_steps, receive_step

if TYPE_CHECKING:
    import torch

    from connector.readiness import Readiness

__all__ = ["Row", "main", "run"]

KV_PORTS = range(6600, 6800)  # the connector tests' range
# A port found free by pick_ports can be taken before the agent binds it (another process on
# the machine, between the probe and the bind): the set-up is tried again on other ports.
SETUP_ATTEMPTS = 3
MODES = ("layer", "step")
STEP_TIMEOUT_S = 30.0  # per wait: D's REG reaching P, the transfer completing
WRITE_TIMEOUT_S = 10.0  # a posted WRITE completing
DEFAULT_SLEEP_CYCLES = 50_000_000  # about 30 ms per layer on a recent GPU


@dataclass(frozen=True, slots=True)
class Row:
    """One case of one configuration, and what the check saw."""

    device: str
    layout: str
    write_batch: str
    gate: bool  # False: the negative control
    case: str
    blocks: int = 0  # (layer, block) pairs compared
    differing: int = 0  # of those, where D's bytes are not P's final bytes
    stale_on_p: int = 0  # where P's own cache lacks them (the kernels did not land)
    written: int = 0  # bytes P's stats say it wrote
    received: int = 0  # bytes D's stats say it received
    error: str = ""

    @property
    def verdict(self) -> str:
        """PASS or FAIL; a negative control on CUDA is INFO (whether a race shows varies)."""
        if self.error or self.stale_on_p:
            return "FAIL"
        if self.gate:
            ok = self.differing == 0 and self.written == self.received > 0
            return "PASS" if ok else "FAIL"
        if self.differing:
            return "PASS"
        return "FAIL" if self.device == "cpu" else "INFO"


@dataclass
class Side:
    """One engine's worker half with its agent and cache."""

    worker: WorkerSide
    agent: ObservedAgent
    cache: kv.KvCache
    addr: NixlAddress
    free: list[int] = field(default_factory=list)  # block ids no case has used yet

    def take(self, count: int) -> list[int]:
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def run(
    device: str,
    layouts: Sequence[str] = (),
    modes: Sequence[str] = MODES,
    cases: Sequence[Case] = CASES,
    sleep_cycles: int = DEFAULT_SLEEP_CYCLES,
    shape: kv.KvShape | None = None,
) -> list[Row]:
    """Every case in every (layout, mode, gate) configuration; one row per case."""
    rows: list[Row] = []
    for layout in layouts or kv.default_layouts(device):
        for mode in modes:
            for gate in (True, False):
                cfg = _Config(device, layout, mode, gate, shape or kv.KvShape(), sleep_cycles)
                rows.extend(cfg.run(cases))
    return rows


@dataclass(frozen=True)
class _Config:
    device: str
    layout: str
    mode: str
    gate: bool
    shape: kv.KvShape
    sleep_cycles: int

    def row(self, case: Case, **found: Any) -> Row:
        return Row(self.device, self.layout, self.mode, self.gate, case.name, **found)

    def run(self, cases: Sequence[Case]) -> list[Row]:
        for _ in range(SETUP_ATTEMPTS):
            try:
                p, d, kernels = self._setup()
                break
            except Exception as exc:  # the connector may refuse this layout: say so once
                why = f"{type(exc).__name__}: {exc}"
        else:
            return [Row(self.device, self.layout, self.mode, self.gate, "(set-up)", error=why)]
        rows = []
        try:
            with _compute_stream(self.device):
                for case in cases:
                    try:
                        found = _transfer(p, d, kernels, case, self.device)
                    except Exception as exc:
                        found = {"error": f"{type(exc).__name__}: {exc}"}
                    rows.append(self.row(case, **found))
        finally:
            p.worker.shutdown()
            d.worker.shutdown()
        return rows

    def _setup(self) -> tuple[Side, Side, Kernels]:
        """P and D on fresh ports; P's kernels, and the readiness P's worker is given."""
        ports = pick_ports(2, KV_PORTS)
        tag = uuid.uuid4().hex[:6]
        p_addr, d_addr = (
            NixlAddress(f"gpu-check-{role}-{tag}", "127.0.0.1", port)
            for role, port in zip(("p", "d"), ports, strict=True)
        )
        p_agent = ObservedAgent(agent_name(p_addr.engine_id, 0), p_addr.port)
        kernels: Kernels
        if self.device == "cpu":
            kernels = SimKernels(lambda: p_agent.wait_writes(WRITE_TIMEOUT_S))
        else:
            kernels = CudaKernels(self.sleep_cycles)
        readiness = kernels.readiness() if self.gate else _host_readiness()
        p = self._side(p_addr, p_agent, readiness)
        d = self._side(d_addr, ObservedAgent(agent_name(d_addr.engine_id, 0), d_addr.port), None)
        return p, d, kernels

    def _side(self, addr: NixlAddress, agent: ObservedAgent, readiness: Readiness | None) -> Side:
        """``readiness`` None: the worker's own pick for the cache's device."""
        import torch

        shape = self.shape
        cache = kv.build(shape, self.layout, self.device)
        gen = torch.Generator().manual_seed(addr.port)
        # Stale bytes everywhere: P's "before the kernel", D's "never written".
        cache.buffer.copy_(torch.randint(-128, 128, cache.buffer.shape, generator=gen))
        worker = WorkerSide(
            agent,
            engine_id=addr.engine_id,
            tp_rank=0,
            host=addr.host,
            port=addr.port,
            compat_fields=_compat(shape, self.layout),
            write_per_layer=self.mode == "layer",
            readiness=readiness,
        )
        worker.register_kv_caches(cache.views, shape.blocks, kv.mem_type(self.device))
        free = torch.randperm(shape.blocks, generator=gen).tolist()
        return Side(worker, agent, cache, addr, free)


@contextlib.contextmanager
def _compute_stream(device: str) -> Iterator[None]:
    """On CUDA, a stream of its own is the current one, as in a vLLM worker (which avoids the
    legacy default stream, and with it that stream's implicit synchronisation)."""
    if device == "cpu":
        yield
        return
    import torch

    with torch.cuda.stream(torch.cuda.Stream()):
        yield


def _host_readiness() -> Readiness:
    """The negative control: every mark ready at once, as with ``readiness_gate: false``."""
    from connector.readiness import HostReadiness

    return HostReadiness()


def _compat(shape: kv.KvShape, layout: str) -> dict[str, Any]:
    """What the engine would put in its HELLO besides what registration reads from the cache."""
    return {
        "kv_layout": layout,
        "version": CONNECTOR_VERSION,
        "model": "gpu-check",
        "block_size": shape.block_size,
        "num_kv_heads": shape.heads,
        "head_size": shape.head_size,
        "tp_size": 1,
    }


# -- one transfer --------------------------------------------------------------------------------


def _transfer(p: Side, d: Side, kernels: Kernels, case: Case, device: str) -> dict[str, Any]:
    """Move ``case``'s prompt from P to D; what the check found, as ``Row`` fields."""
    nblocks = -(-case.prompt // p.cache.shape.block_size)
    p_ids, d_ids = p.take(nblocks), d.take(nblocks)
    if len(p_ids) < nblocks or len(d_ids) < nblocks:
        raise RuntimeError("the cache has too few blocks for these cases")
    return _Transfer(p, d, kernels, case, device, p_ids, d_ids).run()


@dataclass
class _Transfer:
    """One prompt's KV from P's blocks ``p_ids`` into D's ``d_ids``."""

    p: Side
    d: Side
    kernels: Kernels
    case: Case
    device: str
    p_ids: list[int]
    d_ids: list[int]
    tid: str = field(default_factory=lambda: f"gc-{uuid.uuid4().hex}")

    def run(self) -> dict[str, Any]:
        case, p, d, bs = self.case, self.p, self.d, self.p.cache.shape.block_size
        p_req, d_req = f"p-{case.name}", f"d-{case.name}"
        final = self._final_bytes()
        _step(d, receive_step(case, d_req, self.tid, p.addr, self.d_ids, bs), set())
        _until(lambda: _idle_both(p, d, self.kernels) or self.tid in p.agent.regs, "D's REG at P")
        computed = case.cached
        plans = prefill_steps(case, p_req, self.tid, d.addr, self.p_ids, bs)
        for chunk, plan in zip(case.chunks, plans, strict=True):
            end = computed + chunk.tokens
            index = _index(self.p_ids, computed, end, bs, self.device)
            values = [f[computed:end] for f in final]
            _forward(p, self.kernels, plan, values, index, chunk.hooks)
            computed = end
        # D decodes as soon as it reports the receive: its bytes are compared as they are then.
        done = _Done(p_req, d_req, lambda: self._gather(d, self.d_ids))
        _until(lambda: done.update(p, d, self.kernels), "the transfer")
        self.kernels.finish()
        if done.failed or done.at_receive is None:
            raise RuntimeError("D reported the receive failed")
        p_stats, d_stats = p.worker.stats.take() or {}, d.worker.stats.take() or {}
        return {
            "blocks": len(final) * len(self.d_ids),
            "differing": _differing(done.at_receive, final, bs),
            "stale_on_p": _differing(self._gather(p, self.p_ids), final, bs),
            "written": int(p_stats.get("bytes_written", 0)),
            "received": int(d_stats.get("bytes_received", 0)),
        }

    def _final_bytes(self) -> list[torch.Tensor]:
        """Per layer, the KV bytes of every prompt token (``[T, H, C]``); those of the cached
        prefix are in P's cache already, written (and synchronised) long before this request."""
        import torch

        shape, case = self.p.cache.shape, self.case
        gen = torch.Generator().manual_seed(case.prompt)
        size = (case.prompt, shape.heads, shape.content_bytes)
        final = [
            torch.randint(-128, 128, size, generator=gen).to(torch.int8).to(self.device)
            for _ in range(shape.layers)
        ]
        index = _index(self.p_ids, 0, case.cached, shape.block_size, self.device)
        for layer, slots in enumerate(self.p.cache.slots):
            write(slots, index, final[layer][: case.cached])
        if self.device != "cpu":
            torch.cuda.synchronize()
        return final

    def _gather(self, side: Side, blocks: list[int]) -> list[torch.Tensor]:
        """A copy of the prompt's KV bytes in ``side``'s ``blocks``, per layer."""
        index = _index(blocks, 0, self.case.prompt, side.cache.shape.block_size, self.device)
        return [slots[index].clone() for slots in side.cache.slots]


def _forward(
    p: Side,
    kernels: Kernels,
    plan: StepMeta,
    values: list[torch.Tensor],
    index: Index,
    hooks: bool,
) -> None:
    """One P engine step in vLLM's order; each layer's kernel is launched before its hook."""
    _hook(kernels, p.worker.bind, plan)
    for layer, name in enumerate(p.cache.views):
        kernels.launch(p.cache.slots[layer], index, values[layer])
        if hooks:
            _hook(kernels, p.worker.save_layer, name)
    _hook(kernels, p.worker.end_step)
    _hook(kernels, p.worker.get_finished, set())


@dataclass
class _Done:
    """Both sides stepping until D reports the receive and P the send; ``at_receive``: D's
    bytes (``gather``) in the step D reported the receive."""

    p_req: str
    d_req: str
    gather: Callable[[], list[torch.Tensor]]
    at_receive: list[torch.Tensor] | None = None
    sent: bool = False
    failed: bool = False

    def update(self, p: Side, d: Side, kernels: Kernels) -> bool:
        # D first: it sees what P's last step sent before P steps again (an early DONE shows).
        _, recving, failed = _step(d, StepMeta(), set())
        if self.d_req in recving and self.at_receive is None:
            self.at_receive = self.gather()
        self.failed |= self.d_req in failed
        # vLLM finished P's request (one token) with its final prefill step.
        self.sent |= self.p_req in _step(p, StepMeta(), {self.p_req}, kernels)[0]
        return self.failed or (self.sent and self.at_receive is not None)


def _step(
    side: Side, plan: StepMeta, finished: set[str], kernels: Kernels | None = None
) -> tuple[set[str], set[str], set[str]]:
    """An engine step without a forward (vLLM still calls these hooks)."""
    _hook(kernels, side.worker.bind, plan)
    _hook(kernels, side.worker.end_step)
    result: tuple[set[str], set[str], set[str]] = _hook(kernels, side.worker.get_finished, finished)
    return result


def _idle_both(p: Side, d: Side, kernels: Kernels) -> bool:
    _step(p, StepMeta(), set(), kernels)
    _step(d, StepMeta(), set())
    time.sleep(0.001)  # polling interval: nothing is pending on either side yet
    return False


def _hook(kernels: Kernels | None, fn: Callable[..., Any], *args: Any) -> Any:
    """Call one of P's hooks; the simulated stream advances when it returns."""
    result = fn(*args)
    if kernels is not None:
        kernels.hook_returned()
    return result


def _until(cond: Callable[[], bool], what: str, timeout_s: float = STEP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g}s")


def _index(blocks: list[int], start: int, end: int, block_size: int, device: str) -> Index:
    """(block id, slot) of each token in ``[start, end)``."""
    import torch

    tokens = torch.arange(start, end)
    ids = torch.tensor(blocks, dtype=torch.long)[tokens // block_size]
    return ids.to(device), (tokens % block_size).to(device)


def _differing(got: list[torch.Tensor], final: list[torch.Tensor], block_size: int) -> int:
    """(layer, block) pairs where some prompt token's bytes are not the final ones."""
    count = 0
    for have, want in zip(got, final, strict=True):
        bad = (have != want).flatten(1).any(1).nonzero().flatten().tolist()
        count += len({int(t) // block_size for t in bad})
    return count


# -- command line --------------------------------------------------------------------------------

HEADER = ("layout", "write_batch", "gate", "case", "blocks", "differ", "written", "received")


def render(rows: Sequence[Row]) -> str:
    body = [
        (
            r.layout,
            r.write_batch,
            "on" if r.gate else "OFF (negative)",
            r.case,
            r.blocks,
            r.differing,
            r.written,
            r.received,
            _verdict_text(r),
        )
        for r in rows
    ]
    return table((*HEADER, "verdict"), body)


def _verdict_text(row: Row) -> str:
    if row.error:
        return f"{row.verdict}: {row.error}"
    if row.gate:
        return row.verdict
    seen = "stale bytes seen" if row.differing else "no race seen"
    return f"{row.verdict} ({seen})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--layouts", default="", help="comma-separated KVCacheLayout names")
    ap.add_argument("--modes", default=",".join(MODES), help="write_batch modes")
    ap.add_argument("--sleep-cycles", type=int, default=DEFAULT_SLEEP_CYCLES)
    args = ap.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    t0 = time.monotonic()
    rows = run(args.device, layouts, args.modes.split(","), sleep_cycles=args.sleep_cycles)
    print(f"worker check on {args.device} ({time.monotonic() - t0:.1f}s)")
    print(render(rows))
    failed = [r for r in rows if r.verdict == "FAIL"]
    print(f"\nworker check: {'FAIL' if failed else 'PASS'} ({len(failed)} of {len(rows)} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
