"""A local P/D stack: tiny model, one P and one D vLLM engine (or one engine), and the router.

Usage::

    with Stack(mode="push") as stack:
        client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="-")
        ...
        stack.engine_metrics("decode-0").total("vllm:num_requests_running")

Engines and the router run as :class:`~router.stack.procs.ManagedProcess` groups. ``stop()``
(called by ``__exit__``, on Ctrl-C, on exceptions and at interpreter exit) stops the router
first, then every engine group, SIGKILLing any that outlive the grace period.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import httpx
import yaml

from router.config import Mode
from router.stack import engines as eng
from router.stack import model as tiny_model
from router.stack import ports as portmod
from router.stack.metrics import MetricsPage, scrape
from router.stack.phases import engine_phase
from router.stack.procs import ManagedProcess, live_group_members, stop_all

DEFAULT_STARTUP_TIMEOUT_S = 420.0
# Kept turns (``kept_turns``): how long D keeps a finished turn, and how much sooner the
# router stops handing it out (it never names blocks D may have freed).
KEPT_TURNS_ENGINE_TTL_S = 120
KEPT_TURNS_MARGIN_S = 30
_RELOADED = "reloaded "  # the router's log line for an applied reload (router/reload.py)
_RELOAD_TIMEOUT_S = 10.0
_PROGRESS_EVERY_S = 5.0
# A restarted engine whose API server has no child process this long after its start never
# launched its EngineCore (seen under a steady load: the API server waits for the core's
# handshake forever, with no core in its process group). The child exists within a second
# or two even when the machine is saturated (it may then take minutes to load the model).
_CORE_SPAWN_S = 90.0
_RESTART_LAUNCHES = 3
_KEEP_RUNS = 20


class _NoEngineCore(Exception):
    """The engine's API server runs, but no EngineCore process was ever started."""


class StackError(RuntimeError):
    """The stack could not start (a process died or did not become ready in time)."""


@dataclass(frozen=True)
class RouterSettings:
    """What one router over a stack's engines is configured with: its mode (the engines'
    connector must serve it: push and push-sequential share engines), top-level config
    sections, keys of the model entry, and kept turns."""

    mode: Mode
    router_overrides: Mapping[str, Any] = field(default_factory=dict)
    model_overrides: Mapping[str, Any] = field(default_factory=dict)
    kept_turns: bool = False


@dataclass
class ExtraRouter:
    """A second (third, ...) router process over a running stack's engines
    (:meth:`Stack.start_router`): router settings that differ, without new engines."""

    name: str
    settings: RouterSettings
    port: int
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://{eng.LOCALHOST}:{self.port}"

    def metrics(self) -> MetricsPage:
        return scrape(self.url)

    def pids(self) -> list[int]:
        return live_group_members(self.proc.pgid)


class Stack:
    """Context manager owning the engines and the router of one mode.

    Contract: after ``start()`` returns, every engine's ``/health`` and (if ``with_router``) the
    router's ``/ready`` answered 200. After ``stop()`` returns, no process of the stack is alive.
    Logs and the router config are kept under ``run_dir`` for debugging.
    """

    def __init__(
        self,
        mode: str | Mode = Mode.PUSH,
        *,
        variant: str = tiny_model.DEFAULT_VARIANT,
        cache_dir: str | os.PathLike[str] | None = None,
        model_name: str | None = None,
        with_router: bool = True,
        router_port: int | None = None,
        max_model_len: int = 4096,
        decode_slots: int = 64,
        cores: tuple[int, int] = (0, 1),
        aggregated_cpus: str | None = None,
        aggregated_replicas: int = 1,
        pin: str = "engine",
        connector_extra: Mapping[str, Any] | None = None,
        dtype: str | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        log: TextIO | None = None,
        router_overrides: Mapping[str, Any] | None = None,
        engine_args: Mapping[str, Sequence[str]] | None = None,
        kept_turns: bool = False,
        model_overrides: Mapping[str, Any] | None = None,
        prefix_caching: bool = False,
        kv_events: bool = False,
        engine_env: Mapping[str, str] | None = None,
    ) -> None:
        """``router_overrides``: top-level sections merged into the router config (e.g.
        ``{"timeouts": {"prefill": 5}}``). ``engine_args``: extra ``vllm serve`` arguments per
        engine name (e.g. ``{"prefill-0": ["--max-model-len", "2048"]}``); later flags win.
        ``variant``: the model (:func:`router.stack.model.known_variants`), served under
        ``model_name`` (default: the variant's name). ``aggregated_cpus``: where the aggregated
        engine runs (``"0-1"``: both cores; default ``cores[1]``); ``aggregated_replicas=2``: two
        aggregated engines, one on each of ``cores``, the router over both. ``pin``: ``"engine"``
        keeps every process of an engine (API server, EngineCore, Worker) on its cores;
        ``"worker"`` pins only the forward pass, as vLLM alone does, and lets the rest run on any
        core (then one engine's scheduler and API server take time from the other's forward).
        ``connector_extra``: more
        ``kv_connector_extra_config`` keys for this project's connector (pipelined mode). ``dtype``:
        what the engines compute in (default: the model's, ``serving_dtype``). ``kept_turns``
        (pull or pipelined mode): D keeps a conversation's finished turn and the router hands it
        to its next P (router/pd/kept_turn_params.py); in pull mode both engines run vLLM's
        ``bidirectional_kv_xfer``, in pipelined this project's connector keeps it.
        ``model_overrides``: keys merged into the router config's model entry (e.g.
        ``{"disagg_max_prefill_queue": 2}``). ``prefix_caching``: on in every engine (vLLM's
        default for serving; the tests keep it off so that every prompt is computed and moved).
        ``kv_events``: every engine publishes its KV cache events (``--kv-events-config``, with a
        replay endpoint) and every router over the stack routes by them (``kv_events`` in its
        model entry; vLLM publishes only with prefix caching on). ``engine_env``: variables set in
        every engine's environment on top of this process's (e.g.
        ``{"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}``); restarts keep them."""
        self.mode = Mode(mode)
        self.variant = variant
        self.cache_dir = cache_dir
        self.model_name = model_name or variant  # the name clients send as "model"
        self.with_router = with_router
        self.decode_slots = decode_slots
        self.cores = cores
        self.aggregated_cpus = aggregated_cpus
        self.aggregated_replicas = aggregated_replicas
        if pin not in ("engine", "worker"):
            raise StackError(f"pin must be 'engine' or 'worker', not {pin!r}")
        self.pin = pin
        self.connector_extra = dict(connector_extra or {})
        if kept_turns and self.mode not in (Mode.PULL, Mode.PIPELINED):
            raise StackError(f"kept_turns needs mode pull or pipelined, not {self.mode.value}")
        self.kept_turns = kept_turns
        self.model_overrides = dict(model_overrides or {})
        self.prefix_caching = prefix_caching
        self.kv_events = kv_events
        self.engine_env = dict(engine_env or {})
        if kept_turns and self.mode is Mode.PIPELINED:  # this project's connector
            self.connector_extra = {"keep_ttl_s": KEPT_TURNS_ENGINE_TTL_S, **self.connector_extra}
        elif kept_turns:  # vLLM's NixlConnector
            self.connector_extra = {
                "bidirectional_kv_xfer": True,
                "decoder_kv_blocks_ttl": KEPT_TURNS_ENGINE_TTL_S,
                **self.connector_extra,
            }
        self.dtype = dtype or tiny_model.serving_dtype(variant)
        self.startup_timeout_s = startup_timeout_s
        self.max_model_len = max_model_len
        self._router_port_wanted = router_port
        self.router_overrides = dict(router_overrides or {})
        self.engine_args = {name: tuple(args) for name, args in (engine_args or {}).items()}
        self._log = log if log is not None else sys.stderr
        self.engines: list[eng.EngineSpec] = []
        self.router_port: int | None = None
        self.run_dir: Path | None = None
        self.model_path: Path | None = None
        self.startup_s: dict[str, float] = {}
        self._procs: list[ManagedProcess] = []
        self._engine_options_used: eng.EngineOptions | None = None
        self._router_proc: ManagedProcess | None = None
        self._extra_routers: list[ExtraRouter] = []
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Build the model if needed, start the engines and the router, wait for readiness."""
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the router, then all engines; idempotent and safe to call from ``atexit``."""
        with self._lock, _sigint_deferred():
            routers = [r.proc for r in self._extra_routers]
            if self._router_proc is not None:
                routers.append(self._router_proc)
            stop_all(routers, grace_s=5.0)
            self._extra_routers.clear()
            killed = stop_all(self._procs, grace_s=grace_s)
            if killed:
                self._say(f"needed SIGKILL: {', '.join(killed)}")
            self._procs.clear()
            self._router_proc = None
        atexit.unregister(self.stop)

    def signal_engine(self, name: str, sig: int) -> None:
        """Send ``sig`` to every process of engine ``name`` (API server, EngineCore, Worker).

        For fault injection: SIGKILL crashes the engine, SIGSTOP/SIGCONT freeze and thaw it.
        """
        self._engine_proc(name).signal_group(sig)

    def engine_pids(self, name: str) -> list[int]:
        """Pids of every live process of engine ``name`` (API server, EngineCore, Worker)."""
        return live_group_members(self._engine_proc(name).pgid)

    def router_pids(self) -> list[int]:
        """Pids of the router's live processes (with ``--workers N``, its workers too)."""
        return [] if self._router_proc is None else live_group_members(self._router_proc.pgid)

    def engine_core_pids(self, name: str) -> list[int]:
        """Pids of engine ``name``'s EngineCore process(es) (scheduler and model; vLLM titles
        them ``VLLM::EngineCore...``), without its API server.

        For fault injection: SIGSTOP on these freezes the engine while its API server keeps
        accepting requests (and aborts), which reach the core together on SIGCONT.
        """
        pids = []
        for pid in live_group_members(self._engine_proc(name).pgid):
            with contextlib.suppress(OSError):
                if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
        return pids

    def restart_engine(self, name: str, grace_s: float = 5.0) -> float:
        """Stop engine ``name`` (if still running) and start it again with the same ports and
        flags; returns once its ``/health`` answers 200, with the seconds taken.

        The router keeps running and sees the engine come back through its health checks.
        A restarted engine is a new incarnation, as at start: an engine without a pinned
        engine id (D in pull and push mode) gets a fresh NIXL identity from vLLM, and a P (or
        a pipelined D) gets a fresh pinned one. Reusing P's id breaks its peers: vLLM 0.32's
        ``NixlConnector`` on D keeps the NIXL agent it cached for that id and fails every READ
        from the new P with ``NIXL_ERR_REMOTE_DISCONNECT``; this project's connector on P keeps
        its link to a pipelined D's old agent the same way. The routers learn the new id from a
        reload of their config (SIGHUP), as they would from discovery, before the engine starts.
        """
        with self._lock:
            old = self._engine_proc(name)
            index = self._procs.index(old)
            old.signal_group(signal.SIGCONT)  # a stopped group cannot act on SIGTERM
            stop_all([old], grace_s=grace_s)
            spec = self._new_incarnation(name)
        t0 = time.monotonic()
        for launch in range(1, _RESTART_LAUNCHES + 1):
            with self._lock:
                self._procs[index] = proc = self._launch(spec)
            try:
                self._wait_ready({name: (proc, _http_ok(f"{spec.url}/health"))}, t0, proc)
                return time.monotonic() - t0
            except _NoEngineCore:
                # As a supervisor would restart a pod that never gets ready; its stacks are
                # in the log (SIGUSR1) for whoever wants to find vLLM's hang.
                proc.signal_group(signal.SIGUSR1)
                time.sleep(1.0)
                self._say(f"{name}: no EngineCore {_CORE_SPAWN_S:g}s after launch {launch}")
                stop_all([proc], grace_s=grace_s)
        raise StackError(f"{name}: no EngineCore in {_RESTART_LAUNCHES} launches ({proc.log_path})")

    def _new_incarnation(self, name: str) -> eng.EngineSpec:
        """The spec to restart ``name`` with: an engine with a pinned engine id (a P; a
        pipelined D) gets a new one, which the running routers are given (config rewritten,
        SIGHUP, the reload seen in each log). A pipelined D restarted with its old id is
        never written again: P's connector keeps its link to the old incarnation's agent
        by that id, and D's requests fail with "no handshake ... within 5.0s"."""
        spec = self.engine(name)
        if spec.engine_id is None:
            return spec
        spec = replace(spec, engine_id=f"{name}-{uuid.uuid4().hex[:8]}")
        self.engines = [spec if s.name == name else s for s in self.engines]
        if self._router_proc is not None:
            self._reload_router("router", self._router_proc, self.router_config())
        for extra in self._extra_routers:
            config = self.config_for(extra.settings, extra.port)
            self._reload_router(extra.name, extra.proc, config)
        return spec

    def _reload_router(self, name: str, proc: ManagedProcess, config: dict[str, Any]) -> None:
        """Rewrite router ``name``'s config, SIGHUP it, return once its log says reloaded."""
        assert self.run_dir is not None
        log = self.log_path(name)
        before = log.read_text(errors="replace").count(_RELOADED)
        (self.run_dir / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        proc.signal_group(signal.SIGHUP)
        deadline = time.monotonic() + _RELOAD_TIMEOUT_S
        while log.read_text(errors="replace").count(_RELOADED) == before:
            if time.monotonic() > deadline:
                raise StackError(f"{name} did not reload its config in {_RELOAD_TIMEOUT_S:g}s")
            time.sleep(0.05)

    def start_router(
        self,
        name: str,
        *,
        mode: str | Mode | None = None,
        router_overrides: Mapping[str, Any] | None = None,
        model_overrides: Mapping[str, Any] | None = None,
        kept_turns: bool = False,
    ) -> ExtraRouter:
        """Start another router over this stack's running engines, with its own settings
        (``mode``: default the stack's; push-sequential runs on push engines); returns once
        its ``/ready`` answers 200. It stops with the stack (or by :meth:`stop_router`), and
        a restarted P's new engine id reaches it as it reaches the stack's own router.
        ``kept_turns`` in pull mode needs engines started with ``kept_turns`` (vLLM's
        ``bidirectional_kv_xfer``); this project's connector keeps turns on request."""
        settings = RouterSettings(
            Mode(mode or self.mode),
            dict(router_overrides or {}),
            dict(model_overrides or {}),
            kept_turns,
        )
        if eng.connector_of(settings.mode) != eng.connector_of(self.mode):
            raise StackError(f"{settings.mode.value} cannot run on {self.mode.value} engines")
        if kept_turns and not (self.kept_turns or settings.mode is Mode.PIPELINED):
            raise StackError("kept_turns in pull mode needs engines started with kept_turns")
        if name == "router" or any(r.name == name for r in self._extra_routers):
            raise StackError(f"a router named {name!r} runs already")
        assert self.run_dir is not None
        taken = {s.port for s in self.engines} | {r.port for r in self._extra_routers}
        if self.router_port is not None:
            taken.add(self.router_port)
        port = portmod.pick_ports(1, portmod.ROUTER_PORTS, taken)[0]
        proc = self._launch_router(name, self.config_for(settings, port))
        router = ExtraRouter(name, settings, port, proc)
        with self._lock:
            self._extra_routers.append(router)
        self._wait_ready({name: (proc, _http_ok(f"{router.url}/ready"))}, time.monotonic())
        return router

    def stop_router(self, router: ExtraRouter) -> None:
        """Stop a router started by :meth:`start_router`."""
        with self._lock:
            self._extra_routers.remove(router)
        stop_all([router.proc], grace_s=5.0)

    def _engine_proc(self, name: str) -> ManagedProcess:
        self.engine(name)  # KeyError for an unknown name
        for proc in self._procs:
            if proc.name == name:
                return proc
        raise StackError(f"engine {name!r} is not running")

    def _start(self) -> None:
        t0 = time.monotonic()
        self._say(f"model {self.variant}: preparing (built once, then cached)")
        self.model_path = tiny_model.ensure_model(self.variant, self.cache_dir)
        self.startup_s["model"] = time.monotonic() - t0
        self._say(f"model {self.variant}: ready in {self.startup_s['model']:.1f}s")
        self.run_dir = _new_run_dir(self.cache_dir, self.mode.value)
        self.engines = self._plan()
        self._engine_options_used = self._engine_options(self.model_path)
        for spec in self.engines:
            self._procs.append(self._launch(spec))
        checks = {
            proc.name: (proc, _http_ok(f"{spec.url}/health"))
            for proc, spec in zip(self._procs, self.engines, strict=True)
        }
        self._wait_ready(checks, t0)
        if self.with_router:
            self._start_router(t0)
        self._say(f"ready in {time.monotonic() - t0:.1f}s (logs: {self.run_dir})")

    def _launch(self, spec: eng.EngineSpec) -> ManagedProcess:
        assert self.run_dir is not None and self._engine_options_used is not None
        self._say(f"starting {spec.name} on :{spec.port} (core {spec.core}, {self.mode.value})")
        return ManagedProcess(
            spec.name,
            eng.engine_argv(spec, self._engine_options_used),
            self.engine_environment(spec),
            self.run_dir / f"{spec.name}.log",
            cpus=eng.cpu_set(spec.core) if self.pin == "engine" else None,
        )

    def engine_environment(self, spec: eng.EngineSpec) -> dict[str, str]:
        """The environment engine ``spec`` runs with: this process's, ``engine_env`` over it,
        then the stack's own variables (pinning, side channel, offline mode)."""
        return eng.engine_env(spec, {**os.environ, **self.engine_env})

    def _plan(self) -> list[eng.EngineSpec]:
        http_ports = portmod.pick_ports(2, portmod.ENGINE_HTTP_PORTS)
        kv_ports = portmod.pick_ports(2, portmod.SIDE_CHANNEL_PORTS)
        engine_id = f"prefill-0-{uuid.uuid4().hex[:8]}"  # unique per P incarnation
        specs = eng.plan_engines(
            self.mode,
            http_ports,
            kv_ports,
            engine_id,
            self.cores,
            self.aggregated_cpus,
            self.aggregated_replicas,
        )
        unknown = set(self.engine_args) - {s.name for s in specs}
        if unknown:
            raise StackError(f"engine_args for engines this stack does not run: {sorted(unknown)}")
        events: list[tuple[int, int] | None] = [None] * len(specs)
        if self.kv_events:
            picked = portmod.pick_ports(2 * len(specs), portmod.KV_EVENTS_PORTS)
            events = [(picked[2 * i], picked[2 * i + 1]) for i in range(len(specs))]
        return [
            replace(
                s,
                extra_args=s.extra_args + self._caching + self.engine_args.get(s.name, ()),
                connector_extra=self.connector_extra,
                kv_events=ports,
            )
            for s, ports in zip(specs, events, strict=True)
        ]

    @property
    def _caching(self) -> tuple[str, ...]:
        return ("--enable-prefix-caching",) if self.prefix_caching else ()

    def _engine_options(self, model_path: Path) -> eng.EngineOptions:
        per_token = tiny_model.kv_bytes_per_token(model_path, self.dtype)
        return eng.EngineOptions(
            model_path=model_path,
            served_model_name=self.model_name,
            max_model_len=self.max_model_len,
            kv_cache_bytes=eng.kv_cache_bytes_for(per_token, self.max_model_len),
            dtype=self.dtype,
        )

    def _start_router(self, t0: float) -> None:
        assert self.run_dir is not None
        exclude = {s.port for s in self.engines}
        self.router_port = (
            self._router_port_wanted or portmod.pick_ports(1, portmod.ROUTER_PORTS, exclude)[0]
        )
        self._router_proc = self._launch_router("router", self.router_config())
        self._wait_ready({"router": (self._router_proc, _http_ok(f"{self.router_url}/ready"))}, t0)

    def _launch_router(self, name: str, config: dict[str, Any]) -> ManagedProcess:
        assert self.run_dir is not None
        config_path = self.run_dir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [sys.executable, "-m", "router", "serve", "--config", str(config_path)]
        self._say(f"starting {name} on :{config['listen']['port']}")
        return ManagedProcess(name, argv, _router_env(os.environ), self.run_dir / f"{name}.log")

    # -- readiness -------------------------------------------------------------------------

    def _wait_ready(
        self,
        checks: dict[str, tuple[ManagedProcess, Callable[[], bool]]],
        t0: float,
        watch_core: ManagedProcess | None = None,
    ) -> None:
        """Wait until every check passes. ``watch_core``: raise :class:`_NoEngineCore` if
        that engine's API server is still alone in its group ``_CORE_SPAWN_S`` after now."""
        pending = dict(checks)
        last_report = time.monotonic()
        phases: dict[str, str] = {}
        # An engine restarted logs into the same file: only what this start wrote counts.
        log_from = {name: _log_size(proc) for name, (proc, _) in pending.items()}
        core_by = time.monotonic() + _CORE_SPAWN_S
        while pending:
            if watch_core is not None and time.monotonic() > core_by:
                if not _children(watch_core):
                    raise _NoEngineCore
                watch_core = None
            for name, (proc, ok) in list(pending.items()):
                code = proc.exit_code()
                if code is not None:
                    raise StackError(
                        f"{name} exited with {code} during start-up; last output "
                        f"({proc.log_path}):\n{proc.log_tail()}"
                    )
                if ok():
                    self.startup_s[name] = time.monotonic() - t0
                    self._say(f"{name} ready after {self.startup_s[name]:.1f}s")
                    del pending[name]
            elapsed = time.monotonic() - t0
            if pending and elapsed > self.startup_timeout_s:
                for proc, _ in pending.values():
                    proc.signal_group(signal.SIGUSR1)  # stacks into its log (sitecustomize)
                time.sleep(1.0)
                tails = "\n".join(
                    f"{n} ({p.log_path}):\n{p.log_tail()}" for n, (p, _) in pending.items()
                )
                raise StackError(f"not ready after {elapsed:.0f}s: {', '.join(pending)}\n{tails}")
            self._report_phases(pending, phases, log_from, elapsed)
            if pending and time.monotonic() - last_report >= _PROGRESS_EVERY_S:
                waiting = ", ".join(f"{n} ({phases[n]})" if n in phases else n for n in pending)
                self._say(f"waiting for {waiting} ... {elapsed:.0f}s")
                last_report = time.monotonic()
            time.sleep(0.25)

    def _report_phases(
        self,
        pending: dict[str, tuple[ManagedProcess, Callable[[], bool]]],
        phases: dict[str, str],
        log_from: dict[str, int],
        elapsed: float,
    ) -> None:
        """Say each pending engine's phase when it changes (``phases``: the last said), read
        from its log past ``log_from`` (the log's size when the wait began)."""
        engines = {s.name for s in self.engines}
        for name, (proc, _) in pending.items():
            if name not in engines:
                continue
            try:
                with open(proc.log_path, "rb") as log:
                    log.seek(log_from.get(name, 0))
                    phase = engine_phase(log.read().decode(errors="replace"))
            except OSError:
                continue
            if phases.get(name) != phase:
                phases[name] = phase
                self._say(f"{name}: {phase} ({elapsed:.0f}s)")

    # -- accessors -------------------------------------------------------------------------

    @property
    def router_url(self) -> str:
        """Base URL of the router (``http://127.0.0.1:PORT``); requires ``with_router``."""
        if self.router_port is None:
            raise StackError("this stack runs no router")
        return f"http://{eng.LOCALHOST}:{self.router_port}"

    def engine(self, name: str) -> eng.EngineSpec:
        """The engine called ``name`` (``prefill-0``, ``decode-0`` or ``aggregated-0``)."""
        for spec in self.engines:
            if spec.name == name:
                return spec
        raise KeyError(f"no engine {name!r} in this {self.mode.value} stack")

    @property
    def prefill(self) -> eng.EngineSpec:
        return self.engine("prefill-0")

    @property
    def decode(self) -> eng.EngineSpec:
        """The engine that answers clients: D, or the single engine in aggregated mode."""
        return self.engines[-1]

    def engine_metrics(self, name: str) -> MetricsPage:
        """Scrape engine ``name``'s ``/metrics``."""
        return scrape(self.engine(name).url)

    def router_metrics(self) -> MetricsPage:
        """Scrape the router's ``/metrics``."""
        return scrape(self.router_url)

    def log_path(self, name: str) -> Path:
        """Log file of process ``name`` (an engine name or ``router``)."""
        assert self.run_dir is not None
        return self.run_dir / f"{name}.log"

    def router_config(self) -> dict[str, Any]:
        """The router config for this stack (the shape ``pd-router serve --config`` reads)."""
        assert self.router_port is not None
        settings = RouterSettings(
            self.mode, self.router_overrides, self.model_overrides, self.kept_turns
        )
        return self.config_for(settings, self.router_port)

    def config_for(self, settings: RouterSettings, port: int) -> dict[str, Any]:
        """The config of a router with ``settings`` over this stack's engines on ``port``."""
        config = router_config(
            settings.mode, self.engines, self.model_name, port, self.decode_slots
        )
        if settings.kept_turns:
            ttl = KEPT_TURNS_ENGINE_TTL_S - KEPT_TURNS_MARGIN_S
            config["models"][0]["kept_turns"] = {"enabled": True, "ttl_seconds": ttl}
        config["models"][0] |= settings.model_overrides
        return config | dict(settings.router_overrides)

    def _say(self, message: str) -> None:
        print(f"[stack {self.mode.value}] {message}", file=self._log, flush=True)


def router_config(
    mode: Mode,
    engines: list[eng.EngineSpec],
    model_name: str,
    port: int,
    decode_slots: int = 64,
) -> dict[str, Any]:
    """Router config routing ``model_name`` over ``engines`` in ``mode``, listening on ``port``.

    P entries carry the NIXL identity (pinned engine id, side channel) that push mode needs
    before the first request; the single engine of aggregated mode is a decode entry.
    """
    prefill = [
        {"url": s.url, "engine_id": s.engine_id, "kv_host": eng.LOCALHOST, "kv_port": s.kv_port,
         **eng.kv_events_endpoints(s)}
        for s in engines
        if s.role == "prefill"
    ]  # fmt: skip
    decode: list[dict[str, Any]] = [
        {"url": s.url, "slots": decode_slots, **eng.kv_events_endpoints(s)}
        for s in engines
        if s.role in ("decode", "aggregated")
    ]
    if mode is Mode.PIPELINED:  # P writes into D: the router gives P D's identity
        d_specs = [s for s in engines if s.role == "decode"]
        for entry, s in zip(decode, d_specs, strict=True):
            entry |= {"engine_id": s.engine_id, "kv_host": eng.LOCALHOST, "kv_port": s.kv_port}
    model: dict[str, Any] = {
        "name": model_name,
        "mode": mode.value,
        "prefill": prefill,
        "decode": decode,
    }
    if any(s.kv_events is not None for s in engines):  # route by the engines' KV events
        model["kv_events"] = {"enabled": True}
    return {"listen": {"host": eng.LOCALHOST, "port": port}, "models": [model]}


def _log_size(proc: ManagedProcess) -> int:
    try:
        return proc.log_path.stat().st_size
    except OSError:
        return 0


def _http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def _router_env(base: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The router runs without the engine fixes folder on its path."""
    env = dict(base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [p for p in parts if Path(p).resolve() != eng.ENGINE_SITE_DIR]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        env.pop("PYTHONPATH", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _children(proc: ManagedProcess) -> list[int]:
    """Live members of ``proc``'s group besides its leader and multiprocessing's resource
    tracker: the engine's EngineCore and Worker (or the process that becomes one)."""
    out = []
    for pid in live_group_members(proc.pgid):
        if pid == proc.pid:
            continue
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


def _new_run_dir(cache_dir: str | os.PathLike[str] | None, mode: str) -> Path:
    runs = tiny_model.cache_root(cache_dir) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for old in sorted(runs.iterdir())[:-_KEEP_RUNS]:
        _remove_tree(old)
    run_dir = runs / f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    run_dir.mkdir()
    return run_dir


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ignore Ctrl-C while tearing down (main thread only), so teardown always finishes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
