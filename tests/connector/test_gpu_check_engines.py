"""The GPU check's engine command lines (scripts/gpu_check/engines.py), without engines: the run
with vLLM's defaults leaves the KV cache's size to vLLM, so 0.34's extensible KV cache stays on."""

from __future__ import annotations

from pathlib import Path

from scripts.gpu_check.engines import Launch, argv


def _launch(kv_cache_bytes: int | None) -> Launch:
    return Launch(
        device="cuda",
        model=Path("/model"),
        dtype="bfloat16",
        max_model_len=4096,
        max_batched_tokens=128,
        kv_cache_bytes=kv_cache_bytes,
        gpu_fraction=0.25,
        run_dir=Path("/run"),
        startup_timeout_s=1.0,
    )


def test_sized_run_passes_the_kv_cache_bytes() -> None:
    args = argv("prefill", 8100, _launch(1 << 30), eager=False, kv=None)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert "--enforce-eager" not in args


def test_vllm_defaults_run_leaves_the_kv_cache_to_vllm() -> None:
    args = argv("decode", 8200, _launch(None), eager=False, kv="{}")
    assert "--kv-cache-memory-bytes" not in args
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.25"  # three engines, one GPU
    assert "--enforce-eager" not in args
