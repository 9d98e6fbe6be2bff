"""Builds small random-weight Llama models with a locally trained tokenizer.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with ``tokenizers`` on the
Python standard library's own sources, and the weights are random with a fixed seed. Output is
gibberish, but greedy decoding is deterministic, which is all the end-to-end tests need.

A model is built once into ``<cache>/models/<variant>-<recipe>`` (see :func:`cache_root`) and
reused; the folder appears atomically, so concurrent builders never see a half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bump when the recipe changes so old cached models are not reused.
RECIPE_VERSION = 2
SEED = 1234
VOCAB_SIZE = 2048
MAX_POSITIONS = 8192
# Weight init std. The transformers default (0.02) gives a random model that repeats one token
# after a few steps; 0.1 makes greedy output depend on the whole context (about 20 distinct
# tokens in 20), so an equality check against a single engine actually exercises the KV.
INIT_STD = 0.1
# Enough text for a stable vocabulary, little enough to train in a couple of seconds.
_TRAINING_TEXT_BYTES = 8 * 1024 * 1024

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML-like template so /v1/chat/completions works.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelVariant:
    """Shape of a random Llama. ``head_dim`` must be one the vLLM CPU attention supports."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V one token occupies across all layers."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * dtype_bytes
        return per_layer * self.num_hidden_layers


VARIANTS: dict[str, ModelVariant] = {
    # Fast to start and run: the e2e tests' model.
    "tiny": ModelVariant("tiny", 256, 512, 2, 4, 2, 64),
    # Wider and deeper so the KV (16 KiB per token, 32 MiB for 2048 tokens) is a visible part
    # of TTFT while a 2048-token prefill still fits in about a second on one core: benchmarks.
    "bench": ModelVariant("bench", 512, 1024, 8, 8, 8, 64),
}

_CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir`` if given, else ``$PD_ROUTER_CACHE``, else ``~/.cache/pd-router``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PD_ROUTER_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pd-router"


def model_dir(variant: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``variant`` lives in the cache (it may not be built yet)."""
    return cache_root(cache_dir) / "models" / f"{variant}-r{RECIPE_VERSION}"


def ensure_model(variant: str = "tiny", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder of ``variant``, building it first if the cache lacks it."""
    spec = VARIANTS.get(variant)
    if spec is None:
        raise ValueError(f"unknown model variant {variant!r}; known: {sorted(VARIANTS)}")
    if spec.head_dim not in _CPU_HEAD_SIZES:
        raise ValueError(f"head_dim {spec.head_dim} is not supported by vLLM's CPU attention")
    target = model_dir(variant, cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        _build(spec, staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its model is identical (same seed and recipe).
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(spec: ModelVariant, out: Path) -> None:
    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(out)
    _write_weights(spec, tokenizer, out)
    (out / "pd_router_model.json").write_text(
        json.dumps({"variant": spec.name, "recipe": RECIPE_VERSION, "seed": SEED}) + "\n"
    )


def _training_files() -> list[Path]:
    """A deterministic slice of the standard library's sources (sorted, size-capped)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[-2] or total >= _TRAINING_TEXT_BYTES:
            continue
        files.append(path)
        total += path.stat().st_size
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train a tokenizer on")
    return files


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in _training_files()], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _write_weights(spec: ModelVariant, tokenizer: Any, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
