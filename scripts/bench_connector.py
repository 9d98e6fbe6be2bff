#!/usr/bin/env python
"""Benchmark the pipelined push connector on real vLLM CPU engines, in one run.

1. Client TTFT at about 2048-token prompts (the ``bench`` model: 8 layers, 16 KiB of KV per
   token, so a prompt's KV is about 32 MiB) for: this connector (both legs at once),
   vLLM's ``NixlPushConnector`` (both legs at once, same ``X-Request-Id``), vLLM's
   ``NixlConnector`` (pull: P, then D) and aggregated (the whole request on one engine; measured
   on the D engine of the pipelined pair, interleaved with the pipelined requests).
2. Write throughput of the connector's transport path (its layout, per-layer descriptors and
   per-WRITE notices, two real NIXL agents on DRAM) as a fraction of one raw NIXL DRAM->DRAM
   WRITE of the same bytes, measured in this run.

Usage: ``.venv/bin/python scripts/bench_connector.py [--requests 8] [--modes pipelined,push,pull]``
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.connector.engines import (  # noqa: E402
    Engine,
    _stream,
    completion_body,
    engine_pair,
    pipelined,
)

VARIANT = "bench"
PROMPT_TOKENS = 2048


def make_prompts(n: int) -> list[str]:
    """``n`` prompts of about PROMPT_TOKENS tokens, each with a fresh nonce first."""
    from transformers import AutoTokenizer

    from router.stack.model import ensure_model

    tok = AutoTokenizer.from_pretrained(str(ensure_model(VARIANT)))
    unit = " the paged attention kernel reads blocks of keys and values;"
    per_unit = len(tok(unit * 50).input_ids) / 50
    reps = int(PROMPT_TOKENS / per_unit)
    prompts = [f"{uuid.uuid4().hex}:{unit * reps}" for _ in range(n)]
    print(f"prompt tokens: {len(tok(prompts[0]).input_ids)}", flush=True)
    return prompts


def ttft_stream(url: str, body: dict[str, Any], headers: dict[str, str]) -> float:
    t0 = time.monotonic()
    text, status, ttft = _stream(url, body, headers, t0, 120)
    if status != 200:
        raise RuntimeError(f"{url}: {status} {text[:200]}")
    return ttft


def run_pipelined(p: Engine, d: Engine, prompt: str) -> float:
    res = pipelined(p, d, prompt, max_tokens=4)
    if res.status != 200:
        raise RuntimeError(res.text[:200])
    return res.ttft_s


def run_aggregated(_: Engine, d: Engine, prompt: str) -> float:
    return ttft_stream(f"{d.url}/v1/completions", completion_body(prompt, 4, stream=True), {})


def run_push(p: Engine, d: Engine, prompt: str) -> float:
    """vLLM's NixlPushConnector, both legs at once (the concurrent dispatch it is built for)."""
    xid, tid = uuid.uuid4().hex, f"xfer-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": xid}
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    d_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.identity.engine_id,
        "remote_host": p.identity.host,
        "remote_port": p.identity.port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": f"cmpl-{xid}-0",
        "transfer_id": tid,
    }
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            httpx.post,
            f"{p.url}/v1/completions",
            timeout=120,
            headers=headers,
            json={**completion_body(prompt, 1), "kv_transfer_params": p_params},
        )
        ttft = ttft_stream(
            f"{d.url}/v1/completions",
            {**completion_body(prompt, 4, stream=True), "kv_transfer_params": d_params},
            headers,
        )
        fut.result().raise_for_status()
    return ttft


def run_pull(p: Engine, d: Engine, prompt: str) -> float:
    """vLLM's NixlConnector: P first, then D with P's returned parameters."""
    headers = {"X-Request-Id": uuid.uuid4().hex}
    t0 = time.monotonic()
    r = httpx.post(
        f"{p.url}/v1/completions",
        timeout=120,
        headers=headers,
        json={
            **completion_body(prompt, 1),
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
    )
    r.raise_for_status()
    body = {
        **completion_body(prompt, 4, stream=True),
        "kv_transfer_params": r.json()["kv_transfer_params"],
    }
    _, status, ttft_d = _stream(f"{d.url}/v1/completions", body, headers, t0, 120)
    if status != 200:
        raise RuntimeError(f"pull D leg: {status}")
    return ttft_d


Runner = Callable[[Engine, Engine, str], float]
MODES: dict[str, tuple[str, list[tuple[str, Runner]]]] = {
    "pipelined": (
        "PipelinedPushConnector",
        [("pipelined (this connector)", run_pipelined), ("aggregated", run_aggregated)],
    ),
    "push": ("NixlPushConnector", [("NixlPushConnector (concurrent)", run_push)]),
    "pull": ("NixlConnector", [("NixlConnector (pull)", run_pull)]),
}


def bench_mode(mode: str, prompts: list[str], run_dir: Path) -> dict[str, list[float]]:
    connector, runners = MODES[mode]
    out: dict[str, list[float]] = {name: [] for name, _ in runners}
    print(f"[{mode}] starting engines ({connector}) ...", flush=True)
    with engine_pair(run_dir / mode, variant=VARIANT, connector=connector) as (p, d):
        for _, fn in runners:  # warm-up: handshakes, first-request costs
            fn(p, d, prompts[-1])
            fn(p, d, prompts[-2])
        for prompt in prompts[:-2]:
            for name, fn in runners:
                out[name].append(fn(p, d, prompt))
        if mode == "pipelined":
            m = p.metrics()
            writes = m.total("vllm:pdr_writes_total")
            nbytes = m.total("vllm:pdr_bytes_written_total")
            n = m.total("vllm:pdr_writes_per_request_count")
            print(
                f"[{mode}] {nbytes / max(n, 1) / 2**20:.1f} MiB and "
                f"{writes / max(n, 1):.1f} WRITEs per request",
                flush=True,
            )
    return out


# -- transport throughput -----------------------------------------------------------------------


def transport_throughput(repeats: int = 5) -> tuple[float, float, int]:
    """(connector GB/s, raw GB/s, bytes) for one ~2048-token prompt's KV of the bench model."""
    import torch

    from connector.address import NixlAddress
    from connector.metadata import RecvSpec, SendSpec, StepMeta, agent_name
    from connector.transport import RealNixlAgent
    from connector.worker import WorkerSide
    from router.stack.model import VARIANTS
    from router.stack.ports import pick_ports

    spec = VARIANTS[VARIANT]
    layers, block, width = spec.num_hidden_layers, 128, spec.num_key_value_heads * spec.head_dim
    nblocks, used = 40, PROMPT_TOKENS // block
    ports = pick_ports(4, range(6600, 6800))
    compat = {
        "version": 1,
        "model": VARIANT,
        "block_size": block,
        "num_kv_heads": spec.num_key_value_heads,
        "head_size": spec.head_dim,
        "tp_size": 1,
    }
    addrs = [NixlAddress(f"bench-{r}", "127.0.0.1", ports[i]) for i, r in enumerate(("p", "d"))]
    sides, caches = [], []
    for addr in addrs:
        agent = RealNixlAgent(agent_name(addr.engine_id, 0), addr.port)
        w = WorkerSide(
            agent,
            engine_id=addr.engine_id,
            tp_rank=0,
            host=addr.host,
            port=addr.port,
            compat_fields=compat,
        )
        kv = {
            f"model.layers.{i}.self_attn.attn": torch.rand(nblocks, 2, block, width).to(
                torch.bfloat16
            )
            for i in range(layers)
        }
        w.register_kv_caches(kv, nblocks, "DRAM")
        sides.append(w)
        caches.append(kv)
    p, d = sides
    names = list(caches[0])
    times = []
    for rep in range(repeats + 1):
        tid = f"bench-{rep}"
        d.bind(StepMeta(recvs=[RecvSpec(f"d{rep}", tid, addrs[0], 0, list(range(used)), 0)]))
        while True:  # handshake (first time) and REG delivery
            p.bind(StepMeta())
            p.get_finished(set())
            d.get_finished(set())
            if p._sender.knows(tid):
                break
            time.sleep(0.001)
        t0 = time.perf_counter()
        p.bind(
            StepMeta(
                sends=[
                    SendSpec(f"p{rep}", tid, addrs[1], 0, list(range(used)), PROMPT_TOKENS, True)
                ]
            )
        )
        for n in names:
            p.save_layer(n)
        p.end_step()
        # The initiator's completion check is what releases each WRITE's notice to D, so P is
        # polled too, as its engine loop does every step.
        while f"d{rep}" not in d.get_finished(set())[1]:
            p.get_finished(set())
        if rep:  # the first round includes connection set-up
            times.append(time.perf_counter() - t0)
        p.get_finished({f"p{rep}"})
    nbytes = layers * used * 2 * block * width * 2
    conn = nbytes / statistics.median(times) / 1e9

    # Raw: one WRITE of the same number of contiguous bytes, timed to the target's notice.
    raw_agents = [RealNixlAgent(f"raw-{i}", ports[2 + i]) for i in range(2)]
    bufs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
    for a, b in zip(raw_agents, bufs, strict=True):
        a.register([(b.data_ptr(), nbytes, 0)], "DRAM")
    src, dst = raw_agents
    src.fetch_remote("raw-1", "127.0.0.1", ports[3])
    while not src.has_remote("raw-1"):
        time.sleep(0.01)
    raw_times = []
    # One descriptor each side (address, length, device, stride, count), prepared once as the
    # connector prepares its own lists.
    local = src.prep_blocks(None, [(bufs[0].data_ptr(), nbytes, 0, nbytes, 1)], "DRAM")
    remote = src.prep_blocks("raw-1", [(bufs[1].data_ptr(), nbytes, 0, nbytes, 1)], "DRAM")
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        h = src.post_write("raw-1", local, [0], remote, [0], f"r{rep}".encode())
        while not dst.get_notifs():
            src.xfer_state(h)
        if rep:
            raw_times.append(time.perf_counter() - t0)
        src.release(h)
    src.release_prepped(local)
    src.release_prepped(remote)
    raw = nbytes / statistics.median(raw_times) / 1e9
    for w in sides:
        w.shutdown()
    return conn, raw, nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8, help="measured requests per mode")
    ap.add_argument("--modes", default="pipelined,push,pull")
    args = ap.parse_args()
    prompts = make_prompts(args.requests + 2)
    results: dict[str, list[float]] = {}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-connector-"))
    print(f"engine logs: {run_dir}", flush=True)
    for mode in args.modes.split(","):
        results.update(bench_mode(mode, prompts, run_dir))
    conn, raw, nbytes = transport_throughput()

    print(
        f"\nTTFT at ~{PROMPT_TOKENS}-token prompts (median / p90 ms, "
        f"{args.requests} requests each):"
    )
    med = {k: statistics.median(v) for k, v in results.items()}
    for name, vals in results.items():
        p90 = sorted(vals)[max(0, int(0.9 * len(vals)) - 1)]
        print(f"  {name:32s} {1000 * med[name]:8.1f} / {1000 * p90:8.1f}")
    ours = med.get("pipelined (this connector)")
    if ours:
        for ref, target in (("NixlPushConnector (concurrent)", 0.9), ("aggregated", 1.1)):
            if ref in med:
                print(f"  ratio vs {ref}: {ours / med[ref]:.2f} (target <= {target})")
    print(
        f"\nWRITE throughput, {nbytes / 2**20:.0f} MiB per prompt: connector path "
        f"{conn:.2f} GB/s, raw NIXL {raw:.2f} GB/s -> {100 * conn / raw:.0f}% (target >= 80%)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
