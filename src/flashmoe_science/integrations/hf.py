"""Hugging Face transformers: ``attn_implementation="fmoe_science"`` (``ATTN_IMPLEMENTATION``).

Not "flashmoe_science": transformers treats every implementation whose name contains "flash" as a flash-attention
kernel to fetch from its hub (``transformers.utils.generic.is_flash_attention_requested``), and fails on ours.

``register()`` adds ``flashmoe_science_attention`` to transformers' attention-function registry
(``AttentionInterface``) and, for the masks, transformers' own flash-attention mask builder
(``AttentionMaskInterface``): the attention then receives either no mask (plain causal or bidirectional attention)
or the 2-D padding mask of the tokenizer, which it turns into packed variable-length sequences (only the real
tokens are computed, by ``flash_attention_varlen``; the rows' order and lengths are built once per forward on the
device, `attention.padded`, and nothing is read on the host, so a padded step can be captured in a CUDA graph).
A sliding-window config becomes ``window``, a logit soft-cap ``softcap`` where ``flash_attention_science`` has those
arguments. ``check_config`` names any config feature this backend cannot compute (instead of a wrong output);
``from_config`` / ``apply`` build or convert a model in one line, MoE blocks included (``nn.replace_hf_moe_blocks``)::

    model = hf.from_config(config)                       # register, check, build, swap the MoE blocks
    model = hf.apply(AutoModelForCausalLM.from_pretrained(name))

Serving: ``model.set_attn_implementation(hf.register_flash())`` (``FLASH_IMPLEMENTATION``) runs transformers' own
flash-attention path on `integrations.flash_attn_interface`, which is what continuous batching (``generate_batch``,
``transformers serve``) calls: varlen prefill on packed sequences, and on CUDA the block-table decode on the paged
cache (``flash_attn_with_kvcache`` -> ``flash_attention_decode``); with `hf_e4m3_cache.use_e4m3_cache` that cache is
e4m3 with per-KV-head scales.

transformers has no hook that runs a backend's checks while ``AutoModel.from_config(cfg,
attn_implementation="fmoe_science")`` builds a model, so a model built that way meets an unsupported feature at
its first forward (the same ValueError); ``from_config`` and ``apply`` raise it at construction.
"""

from __future__ import annotations

import functools

import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.checks import MAX_HEAD_DIM, MIN_HEAD_DIM, capturing
from flashmoe_science.attention.documents import packed_documents
from flashmoe_science.attention.padded import padded_rows, to_packed, to_tokens
from flashmoe_science.attention.varlen import flash_attention_varlen
from flashmoe_science.integrations import flash_attn_interface as fa
from flashmoe_science.nn.attention import attention_keywords, require_attention_feature
from flashmoe_science.nn.moe import replace_hf_moe_blocks

ATTN_IMPLEMENTATION = "fmoe_science"
# The flash-attention-shaped implementation for transformers' serving paths (continuous batching). Its name must
# contain "flash" (continuous batching takes only "paged|eager", "sdpa" and flash implementations) and match
# "flash...3" for the paged decode path (transformers enables block tables only for flash_attn v2/v3's API, whose
# flash_attn_with_kvcache `integrations.flash_attn_interface` follows).
FLASH_IMPLEMENTATION = "fmoe_science_flash_attn3"
# Continuous batching switches a model to "paged|" + its implementation. transformers 5.17 looks that name up in the
# attention registry (and runs it through `integrations.flash_paged`); 5.24 drops the prefix and runs the plain name.
PAGED_FLASH_IMPLEMENTATION = f"paged|{FLASH_IMPLEMENTATION}"


def register() -> None:
    """Adds ``"fmoe_science"`` to transformers' attention and mask registries (registering again replaces the
    entries with the same functions: harmless)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, flashmoe_science_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)


def padding_mask(*, kv_length: int, attention_mask=None, **kwargs):
    """The mask our attention function receives: transformers' ``flash_attention_mask`` (the tokenizer's 2-D mask,
    None where every token is real), except while torch.compile traces or a CUDA graph is captured: there the 2-D
    mask comes as it is, since testing it for padding (``.all()``) reads it on the host (a graph break, a capture
    error); the padded path then computes the unpadded batch's result."""
    from transformers.masking_utils import flash_attention_mask

    if attention_mask is not None and (torch.compiler.is_compiling() or capturing(attention_mask.device)):
        return attention_mask[:, -kv_length:]
    return flash_attention_mask(kv_length=kv_length, attention_mask=attention_mask, **kwargs)


def register_flash() -> str:
    """Makes ``attn_implementation=FLASH_IMPLEMENTATION`` run transformers' own flash-attention path
    (``integrations.flash_attention.flash_attention_forward``: padding-free varlen calls, and in continuous batching
    the paged prefill and the block-table decode) on `integrations.flash_attn_interface`. Returns the name.

    transformers resolves the functions of a "flash" implementation once per name in
    ``modeling_flash_attention_utils.lazy_import_flash_attention``, which knows only the flash_attn packages and
    the kernels hub (a download); its answer is cached per name. This fills that cache with our module's functions
    for our name (the wrappers below fill it again before each call, since the cache holds one implementation at a
    time), and registers the attention and mask functions under the name, and the paged attention function under
    ``PAGED_FLASH_IMPLEMENTATION`` (no mask: transformers builds none for a paged implementation)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    _provide_flash_functions()
    AttentionInterface.register(FLASH_IMPLEMENTATION, flash_attention)
    AttentionInterface.register(PAGED_FLASH_IMPLEMENTATION, paged_flash_attention)
    AttentionMaskInterface.register(FLASH_IMPLEMENTATION, flash_attention_mask)
    return FLASH_IMPLEMENTATION


class _LoadedName(str):
    """``FLASH_IMPLEMENTATION`` as transformers' flash-function cache records it: equal to the name with or
    without the "paged|" prefix. Continuous batching renames the model to the paged name and transformers 5.17
    asks the cache for it before any of our functions runs (``set_attn_implementation``, the decode-path
    probe); both names resolve to the same functions, so the cache answers for both."""

    def __eq__(self, other):
        return isinstance(other, str) and other in (FLASH_IMPLEMENTATION, PAGED_FLASH_IMPLEMENTATION)

    def __ne__(self, other):
        return not self == other

    __hash__ = str.__hash__


def _provide_flash_functions() -> None:
    from transformers import modeling_flash_attention_utils as loader

    if loader._loaded_implementation == FLASH_IMPLEMENTATION:
        return
    loader._flash_fn, loader._flash_varlen_fn = fa.flash_attn_func, _padded_batch_varlen
    loader._flash_with_kvcache_fn = torch.compiler.disable(_padded_batch_with_kvcache)
    loader._pad_fn, loader._unpad_fn = loader._pad_input, loader._unpad_input
    loader._process_flash_kwargs_fn = loader._lazy_define_process_function(fa.flash_attn_varlen_func)
    loader._process_with_kvcache_kwargs_fn = _with_cache_scales(
        loader._lazy_define_process_function(fa.flash_attn_with_kvcache))
    loader._loaded_implementation = _LoadedName(FLASH_IMPLEMENTATION)


def _with_cache_scales(select):
    """transformers' choice of the block-table call's keywords (``select``: the names it knows), passing on the
    ``k_scale`` / ``v_scale`` an e4m3 paged cache (`hf_e4m3_cache`) puts among the attention's keywords."""

    def select_with_scales(*args, k_scale=None, v_scale=None, **kwargs):
        chosen = select(*args, **kwargs)
        if k_scale is not None or v_scale is not None:
            chosen.update(k_scale=k_scale, v_scale=v_scale)
        return chosen

    return select_with_scales


# Continuous batching pads the batches it captures in CUDA graphs (and runs each once eagerly before capturing it):
# query and key rows after the last sequence (cu_seqlens[-1] < rows), and in the decode path padding sequences of
# no tokens (cache_seqlens -1, block-table rows of -1). Their outputs are never read. transformers builds every
# cu_seqlens it passes to these functions itself (from its scheduler's lengths, or from the padding mask and
# position_ids outside continuous batching), within the tensors it passes: the calls below trust them, as
# flash_attn does, and read nothing on the host (a read per layer and step would drain the device's queue each
# time: the host, which issues every kernel of a small model's step, would then wait for the device layer by layer).


def _padded_batch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
    """`flash_attn_varlen_func` with ``check_values=False``: the packed kernels take padded tensors as they are
    (they attend the rows cu_seqlens name; the outputs of rows after the last sequence are unspecified), and the
    cu_seqlens values are not read on the host, in eager calls as under CUDA-graph capture."""
    return fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, check_values=False, **kwargs)


# `flash_attn_with_kvcache` without the host check: a padding sequence (cache_seqlens -1) gets NaN rows and writes
# nothing (the kernels' rule for out-of-range values), so the padded batch needs no host read. A partial keeps the
# signature, from which transformers picks the block table's argument name (block_table or page_table).
_padded_batch_with_kvcache = functools.partial(fa.flash_attn_with_kvcache, check_values=False)


def flash_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' flash-attention function (``integrations.flash_attention.flash_attention_forward``) with its
    functions resolved to `integrations.flash_attn_interface`."""
    from transformers.integrations.flash_attention import flash_attention_forward

    _provide_flash_functions()
    return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


def paged_flash_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' paged flash-attention function (``integrations.flash_paged.paged_attention_forward``: the
    cache write and varlen prefill, or the block-table decode) with its functions resolved to
    `integrations.flash_attn_interface`: continuous batching's attention on transformers that keep the "paged|"
    name."""
    from transformers.integrations.flash_paged import paged_attention_forward

    _provide_flash_functions()
    return paged_attention_forward(module, query, key, value, attention_mask, **kwargs)


def continuous_batching_config(page_size: int, **options):
    """transformers' ``ContinuousBatchingConfig`` with ``page_size`` tokens a cache page under the installed
    version's name for it (``block_size`` up to 5.17, ``page_size`` after) and the other options as given."""
    import inspect

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = inspect.signature(ContinuousBatchingConfig).parameters
    options["page_size" if "page_size" in names else "block_size"] = page_size
    return ContinuousBatchingConfig(**options)


def paged_sdpa(options: dict) -> str:
    """The name under which continuous batching runs transformers' own paged SDPA attention, with ``options`` (the
    continuous-batching options) completed so that it is not switched to a flash_attn package: 5.17 takes
    ``"paged|sdpa"`` as it is; later versions take ``"sdpa"`` and switch only with ``auto_switch_to_flash``."""
    import inspect

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if "auto_switch_to_flash" in inspect.signature(ContinuousBatchingConfig).parameters:
        options["auto_switch_to_flash"] = False
        return "sdpa"
    return "paged|sdpa"


def head_dim_of(config) -> int | None:
    """The attention head dim of a transformers config: ``head_dim``, else hidden size / heads."""
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "hidden_size", None) and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim


def _uses_sliding_window(config) -> bool:
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _window(sliding_window: int) -> tuple[int, int]:
    return (sliding_window - 1, 0)  # transformers: key j visible from query i iff i - j < window


def attention_masks(config) -> list[dict]:
    """The mask keywords (causal, window, softcap) of each layer type of a transformers decoder config: full
    attention, sliding-window attention, or both (``config.layer_types``)."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    softcap = None if softcap is None else float(softcap)
    types = set(getattr(config, "layer_types", None) or ())
    if not types:
        types = {"sliding_attention" if _uses_sliding_window(config) else "full_attention"}
    masks = []
    for layer_type in sorted(types):
        if layer_type not in ("full_attention", "sliding_attention"):
            raise ValueError(f"layer type {layer_type!r} (config.layer_types) is not supported by "
                             f"{ATTN_IMPLEMENTATION}")
        window = _window(config.sliding_window) if layer_type == "sliding_attention" else None
        masks.append(dict(causal=True, window=window, softcap=softcap))
    return masks


def check_config(config) -> None:
    """A ValueError naming the first feature of a transformers config that this backend cannot compute."""
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(f"attention dropout (config.attention_dropout={dropout}) is not supported by "
                         f"{ATTN_IMPLEMENTATION}: set it to 0.0")
    head_dim = head_dim_of(config)
    if head_dim is not None and not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        source = "config.head_dim" if getattr(config, "head_dim", None) is not None else (
            "config.hidden_size // config.num_attention_heads")
        raise ValueError(f"head dim {head_dim} ({source}) is not supported by {ATTN_IMPLEMENTATION}: the attention "
                         f"kernels take head dims in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if _uses_sliding_window(config):
        require_attention_feature("window", f"a sliding window (config.sliding_window={config.sliding_window})")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        require_attention_feature("softcap", f"logit soft-capping (config.attn_logit_softcapping={softcap})")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        # such models add their bias to the scores themselves: it would not reach this attention function
        raise ValueError(f"ALiBi position biases are not supported by {ATTN_IMPLEMENTATION}")


def _check_model(model) -> None:
    check_config(model.config)
    sinks = [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"]
    if sinks:
        raise ValueError(f"attention sinks (parameter {sinks[0]}) are not supported by {ATTN_IMPLEMENTATION}")


def apply(model, *, swap_moe: bool = True):
    """Switches a built transformers model to this attention (after ``check_config``) and, with ``swap_moe``, its
    Mixtral / Qwen3-MoE blocks to ``FusedMoE`` (sharing their parameters). Returns the model."""
    register()
    _check_model(model)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if swap_moe:
        replace_hf_moe_blocks(model)
    return model


def from_config(config, model_class=None, *, swap_moe: bool = True, **kwargs):
    """``model_class.from_config(config, attn_implementation="fmoe_science", **kwargs)`` (default
    ``AutoModelForCausalLM``) after ``check_config``, with its MoE blocks swapped when ``swap_moe``."""
    register()
    check_config(config)
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    model = model_class.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, **kwargs)
    _check_model(model)
    if swap_moe:
        replace_hf_moe_blocks(model)
    return model


def _attention_options(sliding_window, softcap, kwargs) -> dict:
    for name, what in (("position_bias", "an additive position bias"), ("s_aux", "attention sinks")):
        if kwargs.get(name) is not None:
            raise ValueError(f"{what} ({name}) is not supported by {ATTN_IMPLEMENTATION}")
    options = {}
    if sliding_window is not None:
        require_attention_feature("window", f"a sliding window (sliding_window={sliding_window})")
        options["window"] = _window(sliding_window)
    if softcap is not None:
        require_attention_feature("softcap", f"logit soft-capping (softcap={softcap})")
        options["softcap"] = float(softcap)
    return options


def flashmoe_science_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                               is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function interface: query ``(B, Hq, Lq, D)``, key/value ``(B, Hkv, Lk, D)``, the
    mask from ``flash_attention_mask`` (None, or ``(B, Lk)`` with True at real tokens). Returns
    ``(out (B, Lq, Hq, D), None)``."""
    if dropout:
        raise ValueError(f"attention dropout (p={dropout}) is not supported by {ATTN_IMPLEMENTATION}: set the "
                         "config's attention_dropout to 0.0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = dict(causal=bool(causal), softmax_scale=scaling, **_attention_options(sliding_window, softcap, kwargs))
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"{ATTN_IMPLEMENTATION} takes the 2-D padding mask (batch, keys), got an attention mask of "
                         f"shape {tuple(attention_mask.shape)}: build the model with attn_implementation="
                         f"'{ATTN_IMPLEMENTATION}' so that transformers makes that mask")
    if attention_mask is not None:
        return _padded_attention(query, key, value, attention_mask, options), None
    packed = _packed_sequences(query, key, kwargs)
    if packed is not None:  # several documents in one row: each attends only within itself
        out = flash_attention_varlen(_flat_tokens(query), _flat_tokens(key), _flat_tokens(value), **packed, **options)
        return out.view(query.shape[0], query.shape[2], *out.shape[1:]), None
    return flash_attention_science(query, key, value, **options).transpose(1, 2), None


def _packed_sequences(query, key, kwargs):
    """`flash_attention_varlen`'s packing arguments where one batch row packs several sequences, as
    transformers marks them: its flattening collator's ``cu_seq_lens_q/k`` (over the batch's rows one after the
    other, as transformers' flash-attention path flattens them; with ``max_length_q/k``, else the token count bounds
    them; their values are checked once per tensor pair), or ``position_ids`` restarting at 0 (for a
    single row without a cache, as transformers' flash-attention path reads them: `attention.documents`, one host
    synchronisation per forward; these cu_seqlens are built here, unchecked). Else None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        longest_q, longest_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        return dict(cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32),
                    max_seqlen_q=query.shape[0] * query.shape[2] if longest_q is None else int(longest_q),
                    max_seqlen_k=key.shape[0] * key.shape[2] if longest_k is None else int(longest_k))
    positions = kwargs.get("position_ids")
    if positions is None or query.shape[0] != 1 or query.shape[2] != key.shape[2] or query.shape[2] < 2:
        return None
    documents = packed_documents(positions if positions.dim() == 2 else positions.reshape(1, -1))
    if not documents.several_per_row:
        return None
    return dict(cu_seqlens_q=documents.cu_seqlens, cu_seqlens_k=documents.cu_seqlens, max_seqlen_q=documents.longest,
                max_seqlen_k=documents.longest, check_values=False)


def _flat_tokens(t: torch.Tensor) -> torch.Tensor:
    """``t (B, H, L, D)`` as the varlen calls' token rows ``(B·L, H, D)``: a view for one row (its gradient too:
    no ``select_backward`` copy into a zero buffer) and for a projection's transposed ``(B, L, H, D)`` view; a copy
    only for several rows of a (B, H, L, D)-contiguous KV cache."""
    return t.transpose(1, 2).flatten(0, 1)


def _padded_attention(query, key, value, mask, options) -> torch.Tensor:
    """Attention over the real tokens only (bottom-right causal per sequence): the padding mask ``(B, Lk)`` picks
    the keys, its last Lq columns the queries. The rows move to the packed layout and back as `attention.padded`
    orders them (built once per mask, nothing read on the host); rows of padding queries are zeros. Returns
    ``(B, Lq, Hq, D)``."""
    batch, heads, length_q, head_dim = query.shape
    rows = padded_rows(mask if mask.dtype == torch.bool else mask.bool(), length_q)
    q, k, v = to_packed(query, rows.q), to_packed(key, rows.k), to_packed(value, rows.k)
    # the padded lengths bound every sequence's; the cu_seqlens are built here, within the tensors (no value check)
    out = flash_attention_varlen(q, k, v, rows.q.cu_seqlens, rows.k.cu_seqlens, rows.max_seqlen_q,
                                 rows.max_seqlen_k, check_values=False, **options)
    return to_tokens(out, rows.q).view(batch, length_q, heads, head_dim)


__all__ = ["ATTN_IMPLEMENTATION", "FLASH_IMPLEMENTATION", "PAGED_FLASH_IMPLEMENTATION", "apply",
           "attention_keywords", "attention_masks", "check_config", "continuous_batching_config", "flash_attention",
           "flashmoe_science_attention", "from_config", "head_dim_of", "padding_mask", "paged_flash_attention",
           "paged_sdpa", "register", "register_flash"]
