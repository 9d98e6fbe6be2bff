#!/usr/bin/env python
"""CPU time the forward thread spends making one layer's WRITE: descriptors built per WRITE
(the connector before prepared lists) against NIXL lists prepared once (``connector/writer.py``).

Two real NIXL agents on DRAM, a cache of 4x the WRITE's blocks each side; every round posts
one WRITE of ``--write-blocks`` scattered blocks each way, alternating the two paths so that
both see the same machine. Reports the median CPU time of making the transfer handle (building
descriptors and ``initialize_xfer``, or ``make_prepped_xfer`` from indices) and the ratio; the
``transfer`` call (on DRAM, UCX copies the bytes in it) and the wait are
outside the timed part. At the GPU block size (16 tokens) a 2,048-token prompt is 128 blocks a
layer; at the CPU's (128) it is 16.

Usage: ``.venv/bin/python bench/write_post.py [--write-blocks 16,128] [--rounds 200]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

BLOCK_BYTES = 16 * 1024  # one block of one layer: 16 tokens x 1 KiB


def _agents(blocks: int) -> tuple[Any, Any, Any, Any]:
    import torch

    from connector.transport import RealNixlAgent
    from router.stack.ports import pick_ports

    ports = pick_ports(2, range(6800, 6900))
    src, dst = (RealNixlAgent(f"post-bench-{i}", ports[i]) for i in range(2))
    bufs = [torch.zeros(blocks * BLOCK_BYTES, dtype=torch.uint8) for _ in range(2)]
    for agent, buf in zip((src, dst), bufs, strict=True):
        agent.register([(buf.data_ptr(), buf.numel(), 0)], "DRAM")
    src.fetch_remote(dst.name, "127.0.0.1", ports[1])
    deadline = time.monotonic() + 10
    while not src.has_remote(dst.name):
        if time.monotonic() > deadline:
            raise RuntimeError("no NIXL metadata from the peer in 10 s")
        time.sleep(0.01)
    return src, dst, bufs[0], bufs[1]


def _wait(src: Any, handle: object) -> None:
    deadline = time.monotonic() + 10
    while src.xfer_state(handle) == "PROC":
        if time.monotonic() > deadline:
            raise RuntimeError("WRITE did not complete in 10 s")
    src.release(handle)


def measure(write_blocks: int, total_blocks: int, rounds: int) -> tuple[float, float]:
    """Median CPU seconds per post: (descriptors per WRITE, prepared lists)."""
    import numpy as np

    src, dst, sbuf, dbuf = _agents(total_blocks)
    raw = src._agent  # the nixl agent: the per-WRITE path is NIXL's own API, as before
    ids = list(range(0, 2 * write_blocks, 2))[:write_blocks]  # scattered: no run merges them

    def rows(buf: Any) -> list[tuple[int, int, int, int, int]]:
        return [(buf.data_ptr(), BLOCK_BYTES, 0, BLOCK_BYTES, total_blocks)]

    local = src.prep_blocks(None, rows(sbuf), "DRAM")
    remote = src.prep_blocks(dst.name, rows(dbuf), "DRAM")

    def per_write() -> object:
        lo = [(sbuf.data_ptr() + b * BLOCK_BYTES, BLOCK_BYTES, 0) for b in ids]
        re = [(dbuf.data_ptr() + b * BLOCK_BYTES, BLOCK_BYTES, 0) for b in ids]
        s = raw.get_xfer_descs(np.array(lo, dtype=np.uint64), "DRAM")
        d = raw.get_xfer_descs(np.array(re, dtype=np.uint64), "DRAM")
        return raw.initialize_xfer("WRITE", s, d, dst.name, b"x")

    def prepared() -> object:
        # What RealNixlAgent.post_write does before transfer().
        idx = np.asarray(ids, dtype=np.int32)
        return raw.make_prepped_xfer("WRITE", local, idx, remote, idx, b"x")

    times: dict[str, list[float]] = {"per_write": [], "prepared": []}
    paths: dict[str, Callable[[], object]] = {"per_write": per_write, "prepared": prepared}
    for _ in range(rounds):
        for name, post in paths.items():
            t0 = time.thread_time()
            handle = post()
            times[name].append(time.thread_time() - t0)
            raw.transfer(handle)
            _wait(src, handle)
    src.release_prepped(local)
    src.release_prepped(remote)
    for agent in (src, dst):
        agent.deregister()
        agent.close()
    return statistics.median(times["per_write"]), statistics.median(times["prepared"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-blocks", default="16,128", help="blocks per WRITE, comma-separated")
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    print("blocks/WRITE  descs per WRITE (us)  prepared lists (us)  ratio")
    for n in (int(x) for x in args.write_blocks.split(",")):
        old, new = measure(n, 4 * n, args.rounds)
        print(f"{n:>12}  {1e6 * old:>20.1f}  {1e6 * new:>19.1f}  {old / new:>5.1f}x")


if __name__ == "__main__":
    main()
