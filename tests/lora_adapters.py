"""LoRA adapters for the random-weight model, made with ``peft`` (the ``lora`` extra) at test time.

An adapter is what ``peft``'s ``save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors``), the folder ``vllm serve --lora-modules name=path`` and
``POST /v1/load_lora_adapter`` read. Its weights are random with a fixed seed, both halves:
``init_lora_weights=False`` gives ``lora_B`` non-zero values (peft's default zeroes it, and an
adapter that adds nothing could not show that it was applied). Rank 8 on ``q_proj`` and
``v_proj``, the target modules vLLM's CPU LoRA layers cover for a Llama.

Made in a child process: importing torch, transformers and peft into the test process would
keep their memory and threads for the rest of the run.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["RANK", "make_adapters"]

RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")
_TIMEOUT_S = 300  # torch's import alone takes tens of seconds on a saturated machine


def make_adapters(base_model: Path, out_dir: Path, seeds: Mapping[str, int]) -> dict[str, Path]:
    """One adapter per ``seeds`` entry (name to seed) for the model in ``base_model``, each in
    ``out_dir/<name>``; returns name to folder. Raises ``CalledProcessError`` (with peft's
    output) if one could not be made."""
    folders = {name: out_dir / name for name in seeds}
    args = [f"{folders[name]}={seed}" for name, seed in seeds.items()]
    subprocess.run(
        [sys.executable, "-m", "tests.lora_adapters", str(base_model), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        cwd=Path(__file__).resolve().parents[1],  # where ``tests`` is a package
    )
    return folders


def _make(base_model: str, targets: list[tuple[str, int]]) -> None:
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    for folder, seed in targets:
        torch.manual_seed(seed)
        model = copy.deepcopy(base)  # peft wraps the model it is given in place
        config = LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=list(TARGETS),
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        get_peft_model(model, config).save_pretrained(folder)


if __name__ == "__main__":  # python -m tests.lora_adapters BASE FOLDER=SEED ...
    pairs = [arg.rsplit("=", 1) for arg in sys.argv[2:]]
    _make(sys.argv[1], [(folder, int(seed)) for folder, seed in pairs])
