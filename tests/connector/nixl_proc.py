"""A worker half with a real NIXL agent in its own process, driven over a ``Pipe`` by a test.

Commands (tuples): ``("step", StepMeta | None, forward: bool)`` runs one engine step and replies
``get_finished``'s triple; ``("finish", req_id)`` marks a request finished by vLLM;
``("blocks", ids)`` replies those blocks of every layer as a tensor; ``("stats",)``;
``("removed",)`` replies the peer agents whose metadata the worker removed;
``("exit",)``.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from connector.address import NixlAddress
from connector.metadata import StepMeta, agent_name


def serve(
    conn: Connection,
    addr: NixlAddress,
    fill: float | None,
    timeouts: dict[str, float],
    compat: dict[str, Any],
    tp_rank: int = 0,
    seed: int = 7,
) -> None:
    """One worker: TP rank ``tp_rank`` of ``addr``'s engine (listening on its port plus the
    rank), with ``compat["num_kv_heads"]`` heads, random from ``seed`` unless ``fill``."""
    import torch

    from connector.transport import RealNixlAgent
    from connector.worker import Timeouts, WorkerSide
    from tests.connector.helpers import BLOCKS, HEADS, compat_fields, kv_caches

    removed: list[str] = []  # the peers whose metadata the worker removed (``("removed",)``)

    class Agent(RealNixlAgent):
        def remove_remote(self, agent: str) -> None:
            removed.append(agent)
            super().remove_remote(agent)

    agent = Agent(agent_name(addr.engine_id, tp_rank), addr.port + tp_rank)
    worker = WorkerSide(
        agent,
        engine_id=addr.engine_id,
        tp_rank=tp_rank,
        host=addr.host,
        port=addr.port,
        compat_fields=compat_fields(**compat),
        timeouts=Timeouts(**timeouts),
    )
    caches = kv_caches(fill, int(compat.get("num_kv_heads", HEADS)), seed)
    worker.register_kv_caches(caches, BLOCKS, "DRAM")
    finished: set[str] = set()
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "step":
            worker.bind(cmd[1] or StepMeta())
            if cmd[2]:
                for name in caches:
                    worker.save_layer(name)
            worker.end_step()
            conn.send(worker.get_finished(finished))
        elif cmd[0] == "finish":
            finished.add(cmd[1])
            conn.send(None)
        elif cmd[0] == "blocks":
            conn.send(torch.stack([caches[n][cmd[1]] for n in caches]))
        elif cmd[0] == "removed":
            conn.send(list(removed))
        elif cmd[0] == "stats":
            conn.send(worker.stats.take())
        else:
            worker.shutdown()
            conn.send(None)
            return
