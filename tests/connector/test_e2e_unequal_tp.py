"""End-to-end on real vLLM CPU engines (tiny model: 2 KV heads) with P at tensor-parallel
size 1 and D at 2, and P at 2 and D at 1, both legs driven like the router's pipelined mode
(each naming the other's size): D's greedy outputs equal both engines' aggregated outputs,
the KV was moved (every byte P wrote D received), and both engines end idle (no block left
behind).

vLLM's CPU build runs TP 2 with one worker per core (``VLLM_CPU_OMP_THREADS_BIND=0|1``),
sharing the two cores with the other engine's worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.connector.engines import (
    Engine,
    connector_lines,
    engine_pair,
    local,
    pipelined,
    wait_idle,
    warm_up,
)
from tests.engine_stacks import CONNECTOR_EXTRA, CONNECTOR_FLAGS

pytestmark = [pytest.mark.e2e]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return ",
    "In a distant galaxy, long ago, " * 20,
]


@pytest.fixture(scope="module", params=[(1, 2), (2, 1)], ids=["p-tp1-d-tp2", "p-tp2-d-tp1"])
def unequal(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[Engine, Engine]]:
    run_dir = Path(tmp_path_factory.mktemp("unequal-tp"))
    # Three workers on two shared cores: the first handshakes take longer than the default 5 s.
    extra = {**CONNECTOR_EXTRA, "handshake_timeout_s": 60}
    # float32: TP 1 and TP 2 compute the same K and V to the bit (bf16 GEMMs of other shapes
    # may round apart, and a random model's near-tied logits then pick other tokens).
    args = (*CONNECTOR_FLAGS, "--dtype", "float32")
    with engine_pair(run_dir, extra=extra, engine_args=args, tp=request.param) as (p, d):
        warm_up(p, d, alone_first=True)  # TP 2 compiles on its first forwards
        yield p, d


def test_outputs_equal_aggregated_and_kv_moved(unequal: tuple[Engine, Engine]) -> None:
    p, d = unequal
    for prompt in PROMPTS:
        res = pipelined(p, d, prompt, max_tokens=16)
        why = f"{res.text}\n{connector_lines(p, d)}"
        assert (res.status, res.prefill_status) == (200, 200), why
        assert res.text == local(d, prompt, max_tokens=16) == local(p, prompt, max_tokens=16)
    # Every head P's workers wrote, D's workers received (the warm-up's too: only this pair
    # ever moved KV): nothing lost, nothing twice. vLLM publishes a step's connector counts
    # with a later step's outputs, so a count taken between two transfers may lag one of
    # them: the totals are compared once they agree, or as they stand after 30 s.
    written, received = _totals(p, d)
    deadline = time.monotonic() + 30
    while written != received and time.monotonic() < deadline:
        time.sleep(0.2)
        written, received = _totals(p, d)
    assert written > 0 and written == received
    assert wait_idle(p) and wait_idle(d)


def _totals(p: Engine, d: Engine) -> tuple[float, float]:
    return (
        p.metrics().total("vllm:pdr_bytes_written_total"),
        d.metrics().total("vllm:pdr_bytes_received_total"),
    )
