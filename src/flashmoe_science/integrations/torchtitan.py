"""TorchTitan (0.3.0): our attention and routed experts in TorchTitan's decoders, chosen through its override registry.

TorchTitan builds every model component from a ``Configurable.Config`` tree, and its ``@override`` registry
(``torchtitan.config.override``) swaps a config node for another before anything is built. This module registers
one override, ``flash_decoder``, on the decoder's own config; a job turns it on by name, from the command line or
in a config function (on another TorchTitan release than `integrations.versions` states, importing it raises a
RuntimeError naming that release)::

    torchrun --nproc-per-node 1 -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports flashmoe_science.integrations.torchtitan.flash_decoder

Its keywords (``'...flash_decoder={"experts": null}'`` on the command line) are ``attention`` and ``experts``:
our backend for each ("auto", or a backend's name), or None to keep TorchTitan's module; and ``exchange``, who moves
the tokens under expert parallelism ("flashmoe", the default: `expert_parallel_experts`; or "titan", its dispatcher).

- ``attention``: :class:`FlashAttention`, the inner attention of every ``GQAttention`` layer (in place of
  ``FlexAttention`` or ``VarlenAttention``), through ``flash_attention_varlen``; and the decoder becomes its subclass
  whose ``get_attention_masks`` is :func:`document_metadata`: the per-document varlen metadata (packed documents
  attend only within themselves) in a few device ops and one host synchronisation, where TorchTitan's
  ``create_varlen_metadata_for_document`` loops over the batch rows (a ``nonzero`` and a synchronisation per row).
  The override sits on the decoder because the decoder builds the masks; TorchTitan's registry refuses an override
  nested in another's node, hence one override for the attention and the experts. ``FlashAttention.Config``
  subclasses ``VarlenAttention.Config``, so TorchTitan treats it as varlen attention everywhere else (its refusal of
  context parallel included); without positions (no masks) every row is one causal sequence. ``window_size``
  (left, right) is TorchTitan's sliding window: ``(-1, 0)`` causal, ``(W, 0)`` causal over the last W+1 keys,
  ``(-1, -1)`` bidirectional. GQA runs natively (no repeated K/V); ``out_transform`` epilogues receive our
  log-sum-exp. Decoders with masks of their own (``get_attention_masks`` other than ``Decoder``'s: gpt-oss,
  Qwen3.5) are refused.
- ``experts``: :class:`FlashRoutedExperts` with :class:`FlashGroupedExperts` inside, in place of every
  ``RoutedExperts``. The parameters keep TorchTitan's names and shapes
  (``routed_experts.inner_experts.w1_EFD / w2_EDF / w3_EFD``), so checkpoints, FSDP2 sharding, TorchTitan's
  state-dict adapters and its initialisation apply unchanged. Without expert parallelism (``LocalTokenDispatcher``,
  or the ``AllToAllTokenDispatcher`` that TorchTitan's configs build by default, before an EP mesh is wired into it:
  it then falls back to the local reorder) the layer hands the router's ``(T, K)`` choices straight to
  ``fused_experts`` (gather, SwiGLU experts, weighted combine in our
  kernels: TorchTitan's argsort permutation and scatter-add are skipped). With expert parallelism
  `expert_parallel_experts` moves the tokens on TorchTitan's EP group and runs its local shard of experts: each
  token travels once per rank it visits instead of once per (token, expert) pair. With ``exchange="titan"`` (and
  where the experts' hidden dim is also split) TorchTitan's token dispatcher moves them, and ``fused_experts`` runs
  the local shard on the rows it receives (capacity-padding rows beyond the counts are dropped).

What composes (TorchTitan's own code paths, unchanged):
- FSDP2 (``fully_shard`` wraps the same parameters; mixed precision hands bf16 weights to our kernels, which run
  in the input's dtype) and HSDP; activation checkpointing (full and selective: our ops are ordinary autograd
  nodes; TorchTitan's per-op selective policy saves the outputs of the ops it lists, its own attention and GEMMs,
  and recomputes ours); ``torch.compile`` per block (``flash_attention_varlen`` and ``fused_experts`` trace as the custom ops
  ``torch.ops.flashmoe_science.*``, registered when ``flashmoe_science`` is imported); expert parallel with the
  ``standard`` all-to-all dispatcher (and any dispatcher that returns rows grouped by local expert); tensor parallel
  of attention heads and of the experts' hidden dimension (each rank's shard is a smaller problem of the same
  shape); pipeline parallel (nothing here is stage-aware).

Not supported:
- Context parallel: TorchTitan refuses CP for varlen attention (``VarlenAttention.Config`` in its Llama 3 / Qwen3
  ``update_from_config``), and our config is one; ``flashmoe_science.distributed.ring_attention`` has no hook in
  TorchTitan's CP wrapper (``apply_cp_to_forward`` only knows SDPA and Flex), so a CP job keeps TorchTitan's Flex.
  The SDPA route, where a ring could stand in, is closed for language models (``get_attention_config`` refuses
  "sdpa"), and the Flex route shards only ``BlockMask`` masks (``cp_shard``), so per-document varlen metadata
  cannot pass through TorchTitan's input sharding either.
- ``spmd_backend`` ``"full_dtensor"`` / ``"spmd_types"`` typechecking: our kernels are opaque to ``spmd_types``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashmoe_science.integrations import versions

versions.require("torchtitan")  # before its internals are imported: a release they moved in fails in one line

from torchtitan.config import derive, override  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, GQAttention, VarlenAttention, VarlenMetadata  # noqa: E402
from torchtitan.models.common.decoder import Decoder  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher  # noqa: E402
from torchtitan.distributed.utils import get_spmd_backend  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from flashmoe_science.attention.checks import capturing  # noqa: E402
from flashmoe_science.attention.documents import packed_documents  # noqa: E402
from flashmoe_science.attention.varlen import flash_attention_varlen  # noqa: E402
from flashmoe_science.distributed import expert_parallel_experts  # noqa: E402
from flashmoe_science.moe import fused_experts, grouped_experts  # noqa: E402
from flashmoe_science.prepared_cache import remember  # noqa: E402
from flashmoe_science.warmup import WarmupCase, packed_lengths  # noqa: E402

__all__ = ["BuiltMetadata", "FlashAttention", "FlashGroupedExperts", "FlashRoutedExperts", "dispatches_locally",
           "document_metadata", "expert_parallel_group", "flash_decoder", "warmup_cases"]


def _causal_and_window(window_size: tuple[int, int]) -> tuple[bool, tuple[int, int] | None]:
    """TorchTitan's ``window_size`` (left, right; -1 unbounded) as our ``causal`` and ``window``."""
    left, right = window_size
    if (left, right) in ((-1, 0), (-1, -1)):
        return right == 0, None
    if left >= 0 and right >= 0:
        return right == 0, (left, right)
    raise ValueError(f"window_size={tuple(window_size)}: expected (-1, 0), (-1, -1) or (left >= 0, right >= 0)")


class BuiltMetadata(VarlenMetadata):
    """``VarlenMetadata`` that this module built (`document_metadata`, and rows without positions): valid by
    construction, so :class:`FlashAttention` calls on it with ``check_values=False`` and reads nothing on the host.
    The mark is the type, not the tensors: under ``torch.compile`` the custom op receives new tensor objects for the
    same cu_seqlens (so a memo of checked tensors misses in every layer), while Dynamo specialises on the type."""

    __slots__ = ()


# _dense_metadata's answers per (batch, seq_len, device): one cu_seqlens tensor for every layer and step
_DENSE_METADATA: dict[tuple, BuiltMetadata] = {}


def _dense_metadata(batch: int, seq_len: int, device: torch.device) -> BuiltMetadata:
    """Each of the batch's rows as one whole sequence (what ``attention_masks=None`` means), built once per shape:
    a new tensor per layer would be new to the kernels' work-list memo in every layer. Not kept while a CUDA graph
    is captured (the tensor would live in the graph's memory pool)."""
    key = (batch, seq_len, device)
    meta = _DENSE_METADATA.get(key)
    if meta is None:
        cu_seqlens = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
        meta = BuiltMetadata(cu_seq_q=cu_seqlens, cu_seq_k=cu_seqlens, max_q=seq_len, max_k=seq_len)
        if not capturing(device):
            remember(_DENSE_METADATA, key, meta)
    return meta


class FlashAttention(VarlenAttention):
    """TorchTitan's inner attention ``(B, L, N, H)`` -> ``(B, L, N, H)`` through ``flash_attention_varlen``."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        backend: str = "auto"
        """``flash_attention_varlen``'s backend: "auto", "gluon", "triton" or "reference"."""

    def __init__(self, config: Config) -> None:
        Module.__init__(self)  # VarlenAttention.__init__ only selects PyTorch's flash-attention implementation
        self.window_size = tuple(config.window_size)
        self.causal, self.window = _causal_and_window(self.window_size)
        self.backend = config.backend

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: VarlenMetadata | None = None,
                scale: float | None = None, out_transform=None, **kwargs) -> torch.Tensor:
        B, L, _, head_dim = q_BLNH.shape
        value_head_dim = v_BLNH.shape[-1]
        meta = _dense_metadata(B, L, q_BLNH.device) if attention_masks is None else attention_masks
        if not isinstance(meta, VarlenMetadata):
            raise TypeError(f"attention_masks must be a VarlenMetadata or None, got {type(meta).__name__}")
        result = flash_attention_varlen(
            q_BLNH.reshape(B * L, -1, head_dim), k_BLNH.reshape(B * L, -1, head_dim),
            v_BLNH.reshape(B * L, -1, value_head_dim), meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k,
            causal=self.causal, softmax_scale=scale, window=self.window, return_lse=out_transform is not None,
            backend=self.backend, check_values=False if isinstance(meta, BuiltMetadata) else None)
        if out_transform is None:
            return result.view(B, L, -1, value_head_dim)
        out_TNH, lse_NT = result
        return out_transform(out_TNH.view(B, L, -1, value_head_dim), lse_NT.transpose(0, 1).reshape(B, L, -1))


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class FlashGroupedExperts(GroupedExperts):
    """TorchTitan's ``GroupedExperts`` (same parameters) computed by ``fused_experts``.

    ``forward(x_RD, num_tokens_per_expert_E)`` keeps TorchTitan's contract: rows grouped by (local) expert, the
    counts in expert order; rows past the counts' sum (capacity padding) come back as zeros.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        backend: str = "auto"
        """``fused_experts``' backend: "auto", "triton" or "reference"."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.backend, self.hidden_dim = config.backend, config.hidden_dim

    def swiglu_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(w1, w2)`` in ``fused_experts``' layout: ``w1`` ``(E, 2F, D)`` = [gate; up], ``w2``
        ``(E, D, F)``; local shards under EP/TP, cast to the activations' dtype (a no-op under FSDP2's bf16)."""
        w13 = torch.cat([_local(self.w1_EFD), _local(self.w3_EFD)], dim=1)
        return w13.to(dtype), _local(self.w2_EDF).to(dtype)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.swiglu_weights(x_RD.dtype)
        return grouped_experts(x_RD, w13, w2, num_tokens_per_expert_E, backend=self.backend)


def dispatches_locally(dispatcher) -> bool:
    """Whether TorchTitan's token dispatcher only reorders this rank's tokens among this rank's experts:
    ``LocalTokenDispatcher``, or ``AllToAllTokenDispatcher`` (what TorchTitan's MoE configs build, EP or not) while no
    EP mesh is wired into it, where its ``dispatch`` and ``combine`` are ``LocalTokenDispatcher``'s. Other dispatchers
    (DeepEP, HybridEP, ...) keep their own exchange."""
    if type(dispatcher) is LocalTokenDispatcher:
        return True
    return type(dispatcher) is AllToAllTokenDispatcher and dispatcher.ep_mesh is None


def expert_parallel_group(dispatcher):
    """The process group of TorchTitan's expert parallelism where our exchange can stand in for its dispatcher: an
    ``AllToAllTokenDispatcher`` with its EP mesh wired, under DTensor (not ``spmd_types``) SPMD; else None."""
    if type(dispatcher) is AllToAllTokenDispatcher and dispatcher.ep_mesh is not None \
            and get_spmd_backend() != "spmd_types":
        return dispatcher.ep_mesh.get_group()
    return None


EXCHANGES = ("titan", "flashmoe")


class FlashRoutedExperts(RoutedExperts):
    """TorchTitan's ``RoutedExperts`` (dispatch, experts, combine) with ``fused_experts``.

    Where the dispatcher would only reorder local tokens (``dispatches_locally``) the router's ``(T, K)`` scores and
    ids go to ``fused_experts`` directly: its sort, gathers and weighted combine replace TorchTitan's argsort,
    ``(T·K, D)`` gather and scatter-add, and its kernels see top-K rows per token (one ``(T·K, D)`` product per GEMM
    instead of K=1 over pre-gathered rows). Under expert parallelism, ``exchange`` chooses who moves the tokens:
    "flashmoe" (default), `expert_parallel_experts` on TorchTitan's EP group and its local expert shard (each token
    sent once to each rank owning one of its experts, the partial sums returned and combined in float32); "titan",
    TorchTitan's dispatcher (one row per (token, expert) pair over its all-to-all) with :class:`FlashGroupedExperts`
    on the local experts. Measured side by side on 4 H100s (FSDP2 + EP 4, the Qwen3-MoE job of
    examples/torchtitan): "flashmoe" 41.7k tokens/s per GPU at 29 GiB against "titan" 37.5k at 52 GiB.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        exchange: str = "flashmoe"
        """Under expert parallelism: "flashmoe" (`expert_parallel_experts`) or "titan" (TorchTitan's dispatcher)."""

    def __init__(self, config: Config) -> None:
        if config.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {config.exchange!r}")
        super().__init__(config)
        self.exchange = config.exchange

    def _exchange_group(self):
        """TorchTitan's EP group where our exchange moves the tokens; None under "titan", without expert
        parallelism, or where the experts' hidden dim is also split (expert tensor parallel: TorchTitan's path
        reduces over it)."""
        group = expert_parallel_group(self.token_dispatcher) if self.exchange == "flashmoe" else None
        if group is None:
            return None
        experts = self.inner_experts
        local_experts, hidden, _ = _local(experts.w1_EFD).shape
        if hidden != experts.hidden_dim or local_experts * dist.get_world_size(group) != experts.num_experts:
            return None
        return group

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        ours = isinstance(self.inner_experts, FlashGroupedExperts)
        group = self._exchange_group() if ours else None
        if not ours or (group is None and not dispatches_locally(self.token_dispatcher)):
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        w13, w2 = self.inner_experts.swiglu_weights(x_BLD.dtype)
        routing = (x_BLD.reshape(B * L, D), w13, w2, topk_scores_BLK.reshape(B * L, K),
                   topk_expert_ids_BLK.reshape(B * L, K))
        if group is None:
            out_TD = fused_experts(*routing, backend=self.inner_experts.backend)
        else:
            out_TD = expert_parallel_experts(*routing, group, num_experts=self.inner_experts.num_experts,
                                             backend=self.inner_experts.backend)
        return out_TD.view(B, -1, D)


def document_metadata(positions: torch.Tensor) -> BuiltMetadata:
    """The per-document varlen metadata of a packed batch, ``positions`` ``(B, L)`` restarting at 0 at each document
    (`attention.documents.packed_documents`: a document also starts at every row's first token, as in Flex's
    per-row document mask). ``cu_seq_q = cu_seq_k`` (int32, documents + 1), ``max_q = max_k`` the longest document.
    The whole batch at once: a few device ops and one host synchronisation, and none in the attention calls on it
    (`BuiltMetadata`). Where every row starts a document (TorchTitan's loaders), equal to TorchTitan's
    ``create_varlen_metadata_for_document``.
    """
    documents = packed_documents(positions)
    return BuiltMetadata(cu_seq_q=documents.cu_seqlens, cu_seq_k=documents.cu_seqlens, max_q=documents.longest,
                          max_k=documents.longest)


def warmup_cases(model_config: Decoder.Config, *, seq_len: int, batch: int = 1, dtype: str = "bf16",
                 backward: bool = True) -> list[WarmupCase]:
    """The `warmup.WarmupCase` of every attention call a TorchTitan decoder config makes with our attention on a
    training batch of ``batch`` rows of ``seq_len`` tokens: per attention layer kind (heads, KV heads, head dim,
    window), packed calls whose longest document is each of `warmup.packed_lengths` (TorchTitan's loaders pack
    documents of any length; rows without positions are one sequence of seq_len), each over the batch's tokens.
    The config may be the job's before or after `flash_decoder` (its Flex or varlen layers are what ours replace).
    `warmup.warmup` compiles them into Triton's cache before the job starts."""
    if not isinstance(model_config, Decoder.Config):
        raise TypeError(f"model_config must be a TorchTitan Decoder.Config, got {type(model_config).__name__}")
    cases = []
    for _, attention, _, _ in model_config.traverse(GQAttention.Config):
        inner = attention.inner_attention
        if not isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)):
            continue
        causal, window = _causal_and_window(getattr(inner, "window_size", (-1, 0)))
        heads = attention.n_heads
        base = dict(head_dim=attention.head_dim or attention.dim // heads, heads=heads,
                    kv_heads=attention.n_kv_heads or heads, dtype=dtype, causal=causal, window=window,
                    layout="varlen", backward=backward)
        for length in packed_lengths(seq_len):
            cases.append(WarmupCase(seq_len=length, batch=max(1, batch * seq_len // length), **base))
    return list(dict.fromkeys(cases))


def _document_masks(self, positions: torch.Tensor):
    """``get_attention_masks`` of a decoder whose attention is ours: :func:`document_metadata`."""
    attention = self.config.first_attention
    if attention is not None and isinstance(attention.inner_attention, FlashAttention.Config):
        return document_metadata(positions)
    return Decoder.get_attention_masks(self, positions)


@functools.cache
def _flash_decoder_class(model_cls: type) -> type:
    """``model_cls`` (a TorchTitan ``Decoder`` with ``Decoder``'s masks) whose masks are :func:`document_metadata`,
    with a ``Config`` of its own (TorchTitan builds a config's owner class); one class per decoder class."""
    name = f"Flash{model_cls.__name__}"
    config = dataclass(kw_only=True, slots=True)(
        type("Config", (model_cls.Config,), {"__module__": __name__, "__qualname__": f"{name}.Config"}))
    return type(name, (model_cls,), {"Config": config, "get_attention_masks": _document_masks,
                                     "__module__": __name__, "__qualname__": name,
                                     "__doc__": f"{model_cls.__name__} with flashmoe-science's document metadata."})


def _replace(root, config_cls, make) -> None:
    """Every config of ``config_cls`` in ``root``'s tree replaced by ``make(config)``, in place."""
    for _, config, parent, attr in list(root.traverse(config_cls)):
        if isinstance(parent, list):
            parent[attr] = make(config)
        else:
            setattr(parent, attr, make(config))


@override(target=Decoder.Config, description="flashmoe-science attention (flash_attention_varlen, per-document "
                                             "metadata in one pass) and routed experts (fused_experts)")
def flash_decoder(cfg: Decoder.Config, attention: str | None = "auto", experts: str | None = "auto",
                  exchange: str = "flashmoe") -> Decoder.Config:
    """The decoder config with our attention (and the decoder class whose masks are :func:`document_metadata`)
    where ``attention`` names a backend, our routed experts where ``experts`` does; None keeps TorchTitan's.
    ``exchange``: who moves the tokens under expert parallelism (:class:`FlashRoutedExperts`)."""
    for name, value in (("attention", attention), ("experts", experts)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"flash_decoder's {name} must be a backend name or None, got {type(value).__name__}")
    if exchange not in EXCHANGES:
        raise ValueError(f"flash_decoder's exchange must be one of {EXCHANGES}, got {exchange!r}")
    model_cls = cfg._owner
    ours = model_cls.get_attention_masks is _document_masks  # the override applied before
    if attention is not None and not ours and model_cls.get_attention_masks is not Decoder.get_attention_masks:
        raise ValueError(f"flash_decoder: {model_cls.__name__} builds attention masks of its own; pass "
                         f"attention=None to keep TorchTitan's attention")
    if experts is not None:
        def flash_experts(routed: RoutedExperts.Config) -> FlashRoutedExperts.Config:
            inner = derive(routed.inner_experts, FlashGroupedExperts.Config, backend=experts)
            return derive(routed, FlashRoutedExperts.Config, inner_experts=inner, exchange=exchange)

        _replace(cfg, RoutedExperts.Config, flash_experts)
    if attention is None:
        return cfg
    # Flex's language-model masks are causal per document: varlen metadata with window (-1, 0), the default
    _replace(cfg, (FlexAttention.Config, VarlenAttention.Config),
             lambda inner: derive(inner, FlashAttention.Config, backend=attention))
    return cfg if ours else derive(cfg, _flash_decoder_class(model_cls).Config)
