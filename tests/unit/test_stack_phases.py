"""The phase the local stack reports for a starting engine, read from vLLM's own log lines."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from router.stack.phases import IMPORTING, engine_phase

# A vLLM 0.32 CPU engine's start-up, trimmed to one line per step (the real log has ~80).
START = [
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'model_tag': '/m', 'port': 8100}",
    "(APIServer pid=1) WARNING [vllm.py:1703] Enforce eager set, disabling torch.compile, ...",
    "(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: ...",
    "(Worker pid=3) INFO [cpu_model_runner.py:68] Starting to load model /m...",
    "Loading safetensors checkpoint shards: 100% Completed | 1/1",
    "(Worker pid=3) INFO [default_loader.py:501] Loading weights took 2.14 seconds",
    "(EngineCore pid=2) INFO [core.py:402] init engine (profile, create kv cache, warmup model)"
    " took 7.18 s",
    "(APIServer pid=1) INFO [entry.py:140] Starting vLLM server on http://127.0.0.1:8100",
]
PHASES = [
    IMPORTING,
    "reading the model's config",
    "reading the model's config",  # "disabling torch.compile" is not compiling
    "starting the engine core",
    "loading weights",
    "loading weights",
    "measuring memory, allocating the KV cache",
    "starting the API server",
    "up, waiting for /health",
]


def test_each_line_of_a_start_moves_the_phase_on() -> None:
    assert engine_phase("") == IMPORTING
    for n, want in enumerate(PHASES, start=1):
        assert engine_phase("\n".join(START[:n])) == want, START[n - 1]


def test_a_compiling_engine_says_so() -> None:
    log = "\n".join([*START[:7], "INFO [backends.py:60] Dynamo bytecode transform time: 9.1 s"])
    assert engine_phase(log) == "compiling"


def test_an_engine_restarted_into_the_same_log_starts_over() -> None:
    first_run = "\n".join(START)
    assert engine_phase(first_run + "\n" + START[1]) == "reading the model's config"


class _Proc:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path


def test_the_stack_says_a_restarted_engines_phase_from_this_start_only(tmp_path: Path) -> None:
    from router.stack import engines as eng
    from router.stack.launcher import Stack

    said = io.StringIO()
    stack = Stack("push", log=said)
    stack.engines = [eng.EngineSpec("prefill-0", "prefill", 8100, 0)]
    log = tmp_path / "prefill-0.log"
    log.write_text("\n".join(START) + "\n")  # the previous start, up and serving
    pending: Any = {"prefill-0": (_Proc(log), lambda: False)}
    phases: dict[str, str] = {}
    log_from = {"prefill-0": log.stat().st_size}
    stack._report_phases(pending, phases, log_from, 1.0)
    assert phases == {"prefill-0": IMPORTING}
    with log.open("a") as f:
        f.write(START[1] + "\n")
    stack._report_phases(pending, phases, log_from, 30.0)
    assert phases == {"prefill-0": "reading the model's config"}
    assert said.getvalue().splitlines() == [
        "[stack push] prefill-0: importing vLLM (1s)",
        "[stack push] prefill-0: reading the model's config (30s)",
    ]
    stack._report_phases(pending, phases, log_from, 31.0)  # no change: nothing said
    assert len(said.getvalue().splitlines()) == 2
