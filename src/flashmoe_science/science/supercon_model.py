"""The composition transformer behind ``flashmoe-science supercon``, in two builds that share one set of weights.

A composition (``La1.8Sr0.2Cu1O4``) is a set of element tokens. Each token is the element's embedding (initialised
from its periodic-table properties, :mod:`element_table`) plus an encoding of its fractional amount. Pre-norm
transformer blocks (self-attention within the composition, then a mixture-of-experts SwiGLU feed-forward) mix the
tokens; a fraction-weighted mean and a plain mean pool them into one vector which, with statistics of the
composition's element embeddings (fraction-weighted mean and standard deviation, max, min: the classic composition
features, here of trainable rows), an MLP head maps to Tc in kelvin.

- ``forward_packed`` (the library build): the tokens of a batch are packed end to end, ``(total_tokens, d)`` with
  int32 ``cu_seqlens``; attention runs through ``flash_attention_varlen`` and the feed-forward through ``fused_moe``:
  no padding, no per-expert launches.
- ``forward_padded`` (the plain-PyTorch build, as a user would write it): ``(B, L_max, d)`` padded batches,
  ``scaled_dot_product_attention`` with a key-padding mask, and a loop over experts. It is the baseline of the
  screening benchmark and the CPU path.

Both return the same numbers on the real tokens (up to floating-point rounding).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashmoe_science.attention.varlen import flash_attention_varlen
from flashmoe_science.moe.api import fused_moe
from flashmoe_science.nn.moe import FusedMoE
from flashmoe_science.science.element_table import ELEMENT_PROPERTIES

ELEMENT_SYMBOLS = tuple(ELEMENT_PROPERTIES)  # index i <-> atomic number i + 1
ELEMENT_INDEX = {symbol: i for i, symbol in enumerate(ELEMENT_SYMBOLS)}
IMPLEMENTATIONS = ("fused", "plain")
# per composition, over its elements' embedding rows: fraction-weighted mean and standard deviation, max, min
STATISTICS = ("mean", "std", "max", "min")


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 3
    num_experts: int = 8
    top_k: int = 2
    d_ff: int = 256
    fraction_frequencies: int = 8  # sinusoids per scale (linear and log) in the fractional-amount encoding
    dropout: float = 0.1  # residual dropout in the blocks
    head_dropout: float = 0.1  # dropout in the head: also the MC-dropout uncertainty at screening time
    # the head as P(Tc > 0) x (Tc if superconducting), the first factor also trained on "is Tc > 0" (24% of the
    # SuperCon rows are 0 K, many beside superconductors of the same system)
    two_stage: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@functools.cache
def property_table(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """``(96, P)`` float64 on ``device``: every property standardised over elements 1..96 (z-score); unknown values
    get 0, the column mean after standardisation. Built once per device and shared (read it, never write it): the
    composition features of every screening batch index it, and rebuilding it from the Python table and copying it
    to the GPU cost a millisecond and a host-device copy per batch."""
    if device.type != "cpu":
        return property_table(torch.device("cpu")).to(device)
    raw = torch.tensor([[math.nan if v is None else v for v in values] for values in ELEMENT_PROPERTIES.values()],
                       dtype=torch.float64)
    known = ~torch.isnan(raw)
    count = known.sum(0).clamp_min(1)
    mean = torch.where(known, raw, 0).sum(0) / count
    std = (torch.where(known, raw - mean, 0).pow(2).sum(0) / count).sqrt().clamp_min(1e-12)
    return torch.where(known, (raw - mean) / std, 0)


def element_property_matrix() -> torch.Tensor:
    """``(96, P)`` float32, a new tensor (the model's embedding starts from it and trains it): :func:`property_table`
    rounded once."""
    return property_table().float()


def fraction_features(fractions: torch.Tensor, frequencies: int) -> torch.Tensor:
    """Sinusoids of the fraction on a linear scale and of log2(fraction) (fractions from 1e-4 to 1 both resolved):
    ``(..., 4 * frequencies)`` float32."""
    scales = 2.0 ** torch.arange(frequencies, device=fractions.device, dtype=torch.float32)
    linear = fractions.float().unsqueeze(-1) * scales * math.pi  # 2^0..2^(n-1) half-periods over [0, 1]
    log = (torch.log2(fractions.float().clamp_min(1e-6)) / 20.0).unsqueeze(-1) * scales * math.pi
    return torch.cat([linear.sin(), linear.cos(), log.sin(), log.cos()], dim=-1)


class CompositionBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.attn_norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.ffn_norm = nn.LayerNorm(d)
        self.moe = FusedMoE(d, config.d_ff, config.num_experts, config.top_k)
        self.dropout = nn.Dropout(config.dropout)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(..., d) -> q, k, v each (..., H, D): strided views of one projection."""
        q, k, v = self.qkv(self.attn_norm(x)).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        return q, k, v

    def forward_packed(self, x, cu_seqlens, max_seqlen):
        q, k, v = self._qkv(x)  # (T, H, D)
        attn = flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
        x = x + self.dropout(self.attn_out(attn.flatten(-2)))
        h = self.ffn_norm(x)
        dtype = _compute_dtype(h)
        h = h.to(dtype)
        moe = fused_moe(h, self.moe.w1.to(dtype), self.moe.w2.to(dtype), self.moe.router(h), self.moe.top_k)
        return x + self.dropout(moe)

    def forward_padded(self, x, key_mask):
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x))  # (B, H, L, D)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        x = x + self.dropout(self.attn_out(attn.transpose(1, 2).flatten(-2)))
        h = self.ffn_norm(x)
        return x + self.dropout(_experts_loop(self.moe, h.flatten(0, 1)).view_as(h))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would compute a matmul in (x's own dtype outside autocast)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def element_statistics(p: torch.Tensor, elements: torch.Tensor, fractions: torch.Tensor, segment: torch.Tensor,
                       num: int) -> tuple[torch.Tensor, ...]:
    """The classic composition features of packed tokens: per composition (``segment`` (T,) its index, ``num`` of
    them), the fraction-weighted mean and variance, max and min of the rows ``p (T, P)``, and the composition as a
    vector of element fractions ``(num, 96)`` (``elements (T,)`` indices, ``fractions (T,)``)."""
    weights = fractions.to(p.dtype)[:, None]
    p_mean = p.new_zeros(num, p.shape[1]).index_add_(0, segment, p * weights)
    p_var = p.new_zeros(num, p.shape[1]).index_add_(0, segment, (p - p_mean[segment]).square() * weights)
    rows = segment[:, None].expand_as(p)
    p_max = p.new_zeros(num, p.shape[1]).scatter_reduce_(0, rows, p, "amax", include_self=False)
    p_min = p.new_zeros(num, p.shape[1]).scatter_reduce_(0, rows, p, "amin", include_self=False)
    vector = p.new_zeros(num, len(ELEMENT_SYMBOLS)).index_put_((segment, elements), weights[:, 0], accumulate=True)
    return p_mean, p_var, p_max, p_min, vector


def composition_features(elements: torch.Tensor, fractions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The classic composition features of packed compositions (``elements (T,)``, ``fractions (T,)``,
    ``cu_seqlens (N + 1,)``), ``(N, 96 + 4 * 29)`` float32: each one's element-fraction vector, then the
    fraction-weighted mean, the standard deviation, the max and the min of its elements' standardised periodic-table
    properties (fixed, not the trained embedding). Computed in float64 and rounded once, so the values do not depend
    on the device or on the model's dtype (the tree members' input, :mod:`supercon_trees`)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=elements.device), lengths,
                                      output_size=elements.numel())
    properties = property_table(elements.device)[elements]
    mean, var, high, low, vector = element_statistics(properties, elements, fractions.double(), segment,
                                                      lengths.numel())
    return torch.cat([vector, mean, var.clamp_min(0).sqrt(), high, low], dim=1).float()


def _pooled(weighted, mean, p_mean, p_var, p_max, p_min, vector, dtype) -> torch.Tensor:
    """The head's input: pooled tokens, the element-embedding statistics (STATISTICS order), the fraction vector."""
    return torch.cat([weighted, mean, p_mean, (p_var + 1e-4).sqrt(), p_max, p_min, vector], dim=-1).to(dtype)


def _accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _experts_loop(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """The plain MoE feed-forward: softmax router, top-k renormalised, one gather/matmul/scatter per expert."""
    logits = moe.router(x)
    accumulate = _accumulate_dtype(logits)
    weights, experts = torch.topk(torch.softmax(logits.to(accumulate), dim=-1), moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=accumulate, device=x.device)
    for expert in range(moe.num_experts):
        token, slot = torch.nonzero(experts == expert, as_tuple=True)
        gate, up = F.linear(x[token], moe.w1[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, moe.w2[expert])
        out.index_add_(0, token, y.to(accumulate) * weights[token, slot, None])
    return out.to(_compute_dtype(x))


class CompositionTransformer(nn.Module):
    """Composition -> Tc (kelvin). ``target_mean``/``target_std`` (buffers) undo the training target's scaling, so
    a saved state dict is the whole model."""

    def __init__(self, config: ModelConfig = ModelConfig()):
        super().__init__()
        self.config = config
        properties = element_property_matrix()
        d = config.d_model
        # the embedding table starts as the standardised periodic-table properties and is trained from there
        self.element_embedding = nn.Embedding.from_pretrained(properties, freeze=False)
        self.element_proj = nn.Linear(properties.shape[1], d)
        self.fraction_proj = nn.Linear(4 * config.fraction_frequencies, d)
        self.blocks = nn.ModuleList(CompositionBlock(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(d)
        # the head reads the pooled tokens and statistics of the composition's element embeddings
        # and the composition as a vector of element fractions
        self.head_hidden = nn.Linear(2 * d + len(STATISTICS) * properties.shape[1] + properties.shape[0], d)
        self.head_out = nn.Linear(d, 2 if config.two_stage else 1)
        self.register_buffer("target_mean", torch.zeros(()))
        self.register_buffer("target_std", torch.ones(()))
        # tree members on the composition features (supercon_trees), attached after the transformer is trained, and
        # the blend's weights: the transformer's first, then each member's
        self.members = nn.ModuleDict()
        self.register_buffer("blend", torch.ones(1))

    def attach_members(self, members: dict[str, nn.Module], weights: torch.Tensor) -> "CompositionTransformer":
        """Tree members (``name -> TreeEnsemble``) and the blend's weights ``(1 + len(members),)``, the
        transformer's first: :meth:`predict_samples` predicts their weighted mixture."""
        if weights.shape != (1 + len(members),):
            raise ValueError(f"weights must have shape ({1 + len(members)},) (the transformer, then each member), got "
                             f"{tuple(weights.shape)}")
        self.members = nn.ModuleDict(members)
        self.blend = weights.to(self.target_mean.device, torch.float32)
        return self

    def cast_parameters(self, dtype: torch.dtype) -> "CompositionTransformer":
        """Parameters to ``dtype`` (bf16 for screening); the target scaling buffers stay float32, where a bf16
        mean would shift every prediction by up to 0.1 K."""
        for parameter in self.parameters():
            parameter.data = parameter.data.to(dtype)
        return self

    def _tokens(self, properties: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
        embedded = self.element_proj(properties)
        features = fraction_features(fractions, self.config.fraction_frequencies)
        encoded = self.fraction_proj(features.to(self.fraction_proj.weight.dtype))
        return embedded + encoded

    # ------------------------------------------------------------------------------------------- library build
    def pooled_packed(self, elements, fractions, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """Packed tokens ``elements (T,)`` int64 element indices, ``fractions (T,)`` (each composition's sum to 1),
        ``cu_seqlens (B + 1,)`` int32 -> pooled ``(B, 2 * d_model + 4 * P)``."""
        properties = self.element_embedding(elements)
        x = self._tokens(properties, fractions)
        for block in self.blocks:
            x = block.forward_packed(x, cu_seqlens, max_seqlen)
        x = self.final_norm(x)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        num = lengths.numel()
        segment = torch.repeat_interleave(torch.arange(num, device=x.device), lengths, output_size=x.shape[0])
        accumulate = _accumulate_dtype(x)
        x = x.to(accumulate)
        fractions = fractions.to(accumulate)[:, None]
        weighted = x.new_zeros(num, x.shape[1]).index_add_(0, segment, x * fractions)
        mean = x.new_zeros(num, x.shape[1]).index_add_(0, segment, x) / lengths.clamp_min(1)[:, None]
        statistics = element_statistics(properties.to(accumulate), elements, fractions[:, 0], segment, num)
        return _pooled(weighted, mean, *statistics, self.final_norm.weight.dtype)

    # --------------------------------------------------------------------------------------------- plain build
    def pooled_padded(self, elements, fractions, mask) -> torch.Tensor:
        """Padded ``elements (B, L)``, ``fractions (B, L)`` (0 on padding), ``mask (B, L)`` bool (True: a real
        element) -> pooled ``(B, 2 * d_model + 4 * P)``."""
        properties = self.element_embedding(elements)
        x = self._tokens(properties, fractions)
        for block in self.blocks:
            x = block.forward_padded(x, mask)
        x = self.final_norm(x)
        x = x.to(_accumulate_dtype(x)) * mask[..., None]
        fractions = fractions.to(x.dtype)[..., None]
        weighted = (x * fractions).sum(1)
        mean = x.sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        p = properties.to(x.dtype)
        p_mean = (p * fractions).sum(1)
        p_var = ((p - p_mean[:, None]).square() * fractions).sum(1)
        p_max = p.masked_fill(~mask[..., None], -torch.inf).amax(1)
        p_min = p.masked_fill(~mask[..., None], torch.inf).amin(1)
        vector = p.new_zeros(p.shape[0], len(ELEMENT_SYMBOLS)).scatter_add_(1, elements, fractions[..., 0])
        return _pooled(weighted, mean, p_mean, p_var, p_max, p_min, vector, self.final_norm.weight.dtype)

    # ------------------------------------------------------------------------------------------------- head
    def head_outputs(self, pooled: torch.Tensor, *, dropout: bool | None = None) -> tuple[torch.Tensor, ...]:
        """Pooled ``(B, 2d + 4P)`` -> (Tc ``(B,)`` float32 (float64 for a float64 model) in kelvin, the logit of
        P(Tc > 0) ``(B,)`` of a two-stage head, else None); ``dropout`` defaults to ``self.training``."""
        active = self.training if dropout is None else dropout
        hidden = F.dropout(F.silu(self.head_hidden(pooled)), self.config.head_dropout, training=active)
        out = self.head_out(hidden)
        out = out.to(_accumulate_dtype(out))
        value = out[:, 0] * self.target_std + self.target_mean
        if not self.config.two_stage:
            return value, None
        return torch.sigmoid(out[:, 1]) * value, out[:, 1]

    def head(self, pooled: torch.Tensor, *, dropout: bool | None = None) -> torch.Tensor:
        """Pooled ``(B, 2d + 4P)`` -> Tc ``(B,)`` in kelvin (:meth:`head_outputs`)."""
        return self.head_outputs(pooled, dropout=dropout)[0]

    def head_samples(self, pooled: torch.Tensor, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MC dropout over the head: ``samples`` stochastic passes -> (mean, std) of Tc, each ``(B,)``."""
        if samples < 2:
            return self.head(pooled, dropout=False), torch.zeros(pooled.shape[0], device=pooled.device)
        draws = self.head(pooled.repeat(samples, 1), dropout=True).view(samples, -1)
        return draws.mean(0), draws.std(0)

    def predict_samples(self, batch: "PackedBatch | PaddedBatch", samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model's (mean, std) Tc ``(B,)``: the transformer's MC-dropout mean and std
        (:meth:`head_samples`), blended with the tree members' predictions and spreads when they are attached. The mixture's
        std: ``sqrt(sum_i w_i (s_i^2 + (m_i - m)^2))``, each member's own spread plus their disagreement."""
        mean, std = self.head_samples(batch.pooled(self), samples)
        if not len(self.members):
            return mean, std
        x = batch.features()
        outputs = [member.predict(x) for member in self.members.values()]
        means = torch.stack([mean, *(m.to(mean.dtype) for m, _ in outputs)])
        spreads = torch.stack([std.to(mean.dtype), *(s.to(mean.dtype) for _, s in outputs)])
        w = self.blend.to(mean.dtype)[:, None]
        blended = (w * means).sum(0)
        return blended, (w * (spreads.square() + (means - blended).square())).sum(0).sqrt()

    def forward(self, batch: "PackedBatch | PaddedBatch") -> torch.Tensor:
        """The transformer's Tc ``(B,)`` of a PackedBatch (library build) or a PaddedBatch (plain build), head
        dropout as in training (the members, fitted apart, join in :meth:`predict_samples`)."""
        return self.head(batch.pooled(self))


@dataclass
class PackedBatch:
    elements: torch.Tensor  # (T,) int64
    fractions: torch.Tensor  # (T,) float
    cu_seqlens: torch.Tensor  # (B + 1,) int32
    max_seqlen: int

    def pooled(self, model: CompositionTransformer) -> torch.Tensor:
        return model.pooled_packed(self.elements, self.fractions, self.cu_seqlens, self.max_seqlen)

    def features(self) -> torch.Tensor:
        """The compositions' classic features (:func:`composition_features`)."""
        return composition_features(self.elements, self.fractions, self.cu_seqlens)

    def padded(self) -> "PaddedBatch":
        """The same compositions as (B, max_seqlen) padded tensors (what a plain-PyTorch pipeline batches)."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        num = lengths.numel()
        segment = torch.repeat_interleave(torch.arange(num, device=lengths.device), lengths,
                                          output_size=self.elements.shape[0])
        position = torch.arange(self.elements.shape[0], device=lengths.device) - self.cu_seqlens[:-1].long()[segment]
        elements = self.elements.new_zeros(num, self.max_seqlen)
        fractions = self.fractions.new_zeros(num, self.max_seqlen)
        mask = torch.zeros(num, self.max_seqlen, dtype=torch.bool, device=lengths.device)
        elements[segment, position] = self.elements
        fractions[segment, position] = self.fractions
        mask[segment, position] = True
        return PaddedBatch(elements, fractions, mask)

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.elements.to(device, non_blocking=True), self.fractions.to(device, non_blocking=True),
                           self.cu_seqlens.to(device, non_blocking=True), self.max_seqlen)


@dataclass
class PaddedBatch:
    elements: torch.Tensor  # (B, L) int64, 0 on padding
    fractions: torch.Tensor  # (B, L) float, 0 on padding
    mask: torch.Tensor  # (B, L) bool

    def pooled(self, model: CompositionTransformer) -> torch.Tensor:
        return model.pooled_padded(self.elements, self.fractions, self.mask)

    def packed(self, total: int | None = None) -> PackedBatch:
        """The real tokens end to end, with int32 cu_seqlens. ``total``: the number of real tokens when the caller
        knows it (a candidate space counts them on the host); else it is read from the device (one host sync).
        Each real token is scattered to its rank among the real tokens, the padding to one spare slot past the end,
        so the compaction itself never waits for the device (boolean indexing would: its output size is data)."""
        lengths = self.mask.sum(1, dtype=torch.int32)
        cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
        torch.cumsum(lengths, 0, out=cu_seqlens[1:])
        total = int(cu_seqlens[-1]) if total is None else total
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        mask = self.mask.flatten()
        slot = torch.where(mask, torch.cumsum(mask, 0) - 1, total)

        def compact(values: torch.Tensor) -> torch.Tensor:
            return values.new_empty(total + 1).scatter_(0, slot, values.flatten())[:total]

        return PackedBatch(compact(self.elements), compact(self.fractions), cu_seqlens, self.elements.shape[1])

    def features(self) -> torch.Tensor:
        """The compositions' classic features (:func:`composition_features`)."""
        return self.packed().features()


def make_batch(packed: PackedBatch, implementation: str) -> "PackedBatch | PaddedBatch":
    """The batch form an implementation takes: ``"fused"`` packed, ``"plain"`` padded."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return packed if implementation == "fused" else packed.padded()


def default_implementation(device: torch.device) -> str:
    """The library build on a CUDA GPU; the plain build (the CPU path) elsewhere."""
    return "fused" if torch.device(device).type == "cuda" else "plain"
