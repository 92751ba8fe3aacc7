"""The served model and its tokenizer.

``MODEL_OR_CONFIG`` is a local model directory (``from_pretrained``: weights and tokenizer) or a transformers config
file (``config.json``: the model gets random weights, seeded, and a word tokenizer whose tokens are ``t0``,
``t1``, ... one per vocabulary entry, so that a prompt of n words is n tokens). Nothing is downloaded.

Backends: ``flashmoe`` puts the model on our attention through transformers' flash-attention path
(``hf.register_flash``: the varlen prefill and, on CUDA, the block-table decode that continuous batching calls) and
swaps its Mixtral / Qwen3-MoE blocks for ``FusedMoE``; ``transformers-sdpa`` keeps transformers' own SDPA attention
and experts (the baseline).

KV cache: ``auto`` is transformers' paged cache in the model's dtype; ``e4m3`` (``flashmoe`` only) stores it as e4m3
with per-layer, per-KV-head scales calibrated on the loaded model (`integrations.hf_e4m3_cache`), which the
block-table decode reads as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BACKENDS = ("flashmoe", "transformers-sdpa")
WORD_PREFIX = "t"


def word_tokenizer(vocab_size: int):
    """A fast tokenizer of ``vocab_size`` words ``t0 .. t{vocab_size-1}`` split on whitespace (one word, one token;
    an unknown word reads as ``t0``), with a chat template that joins the messages' contents and a response
    template whose assistant message is the whole generated text (the prompt has no role markers to anchor on:
    the anchor is the prompt's end)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"{WORD_PREFIX}{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=f"{WORD_PREFIX}0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    tokenizer.response_template = {"defaults": {"role": "assistant"}, "start_anchor_pattern": r"\Z",
                                   "fields": {"content": {"content": "text"}}}
    return tokenizer


def words(token_ids) -> str:
    """The text of ``token_ids`` under `word_tokenizer`."""
    return " ".join(f"{WORD_PREFIX}{int(i)}" for i in token_ids)


def token_ids(text: str) -> list[int]:
    """`words`'s inverse: the ids of a text of `word_tokenizer` words."""
    return [int(word[len(WORD_PREFIX):]) for word in text.split()]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype name (bfloat16, float16, float32), got {name!r}")
    return dtype


def default_placement(device: str | None, dtype: str | None) -> tuple[str, str]:
    """(device, dtype) with the defaults filled in: cuda if available, else cpu; bfloat16 on CUDA, float32 on the
    CPU (the reference kernels compute in float32). A ValueError for a CUDA device on a machine without one."""
    from flashmoe_science.device import check_device_option

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device_option(device)
    return device, dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def _is_model_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def load_model(source: str, backend: str = "flashmoe", device: str = "cpu", dtype: str = "bfloat16",
               seed: int = 0):
    """(model in eval mode on ``device``, tokenizer) for ``source`` (a model directory or a config file) on
    ``backend`` (`BACKENDS`)."""
    import transformers

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    path = Path(source)
    torch_dtype = _dtype(dtype)
    if _is_model_directory(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    elif path.is_file():
        config = transformers.AutoConfig.for_model(**json.loads(path.read_text()))
        torch.manual_seed(seed)
        with torch.device(device):  # random weights drawn where they will live (no host copy of a large model)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        tokenizer = word_tokenizer(config.vocab_size)
    else:
        raise ValueError(f"MODEL_OR_CONFIG must be a model directory (with config.json) or a config file; "
                         f"{source!r} is neither")
    model = model.to(device).eval()
    _use_backend(model, backend)
    return model, tokenizer


def check_kv_cache_dtype(backend: str, kv_cache_dtype: str) -> None:
    """A ValueError naming ``--kv-cache-dtype`` when the backend cannot serve that cache."""
    from flashmoe_science.integrations.hf_e4m3_cache import KV_CACHE_DTYPES

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "e4m3" and backend != "flashmoe":
        raise ValueError(f"--kv-cache-dtype e4m3 needs --backend flashmoe (our decode kernels read the e4m3 cache "
                         f"with its scales); {backend} reads the cache in the model's dtype")


def cache_tokens_in(gib: float, config, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """The tokens a KV cache of ``gib`` GiB holds for ``config``'s model: keys and values of every layer's KV heads,
    one byte a value for ``e4m3``, else ``dtype``'s size."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
        raise ValueError(f"--cache-gib must be a positive number, got {gib!r}")
    from flashmoe_science.integrations.hf import head_dim_of

    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    value_bytes = 1 if kv_cache_dtype == "e4m3" else dtype.itemsize
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim_of(text) * value_bytes
    tokens = int(gib * 2**30) // per_token
    if tokens < 1:
        raise ValueError(f"--cache-gib {gib} holds no token of this model ({per_token} bytes a token)")
    return tokens


def kv_cache_scales(model, kv_cache_dtype: str, seed: int = 0):
    """The e4m3 cache's scales (`hf_e4m3_cache.KVScales`, calibrated on ``model``) for ``e4m3``; None for
    ``auto``."""
    from flashmoe_science.integrations import hf_e4m3_cache

    if kv_cache_dtype == "auto":
        return None
    hf_e4m3_cache.check_config(model.config)
    return hf_e4m3_cache.calibrate_scales(model, seed=seed)


def _use_backend(model, backend: str) -> None:
    from flashmoe_science.integrations import hf
    from flashmoe_science.nn.moe import replace_hf_moe_blocks

    if backend == "transformers-sdpa":
        model.set_attn_implementation("sdpa")
        return
    hf.check_config(model.config)
    model.set_attn_implementation(hf.register_flash())
    replace_hf_moe_blocks(model)
