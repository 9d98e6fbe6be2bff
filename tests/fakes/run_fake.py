"""Serve one fake engine in its own process, so a test can SIGKILL it mid-request.

python -m tests.fakes.run_fake PORT '{"delay": 1.0, "tokens": 50}'
"""

from __future__ import annotations

import json
import sys

import uvicorn

from tests.fakes.fake_vllm import FakeEngine


def main() -> None:
    port, behaviour = int(sys.argv[1]), json.loads(sys.argv[2])
    engine = FakeEngine("killable")
    for key, value in behaviour.items():
        setattr(engine.behaviour, key, value)
    uvicorn.run(engine, host="127.0.0.1", port=port, log_level="critical", lifespan="off")


if __name__ == "__main__":
    main()
