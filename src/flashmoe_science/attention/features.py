"""What one attention call asks for beyond plain q, k, v: its mask, score modifiers and packed layout.

`CallFeatures` carries the checked extras of a call to every kernel (the problem is built once per call; kernels
only read it). `feature_names` turns it into the words the planner reasons with: each backend declares, once, which
of them its kernels take (a backend module's `FORWARD_FEATURES`), so wiring a new feature into a kernel
family is one edit there plus its kernel arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashmoe_science.attention.mask import MaskSpec, make_mask
from flashmoe_science.attention.mods import Mods

# Every feature word a call can carry (the order is the order describe_dispatch lists them in).
FEATURES = ("causal", "window", "softcap", "alibi", "bias", "bias_grad", "varlen", "odd_head_dim", "mask_mod",
            "score_mod")


@dataclass(frozen=True, eq=False)
class Varlen:
    """flash-attn's packed layout: sequence b holds rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q (and the same
    of k/v with cu_seqlens_k). The cu_seqlens are checked int32 tensors on q's device; max_seqlen_* bound every
    sequence's length (the kernels' grids are sized by them)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.numel() - 1


@dataclass(frozen=True, eq=False)
class CallFeatures:
    """The checked extras of one call, in the kernels' 4-D terms.

    alibi_slopes: float32 `(B, Hq)` (a stride-0 batch dim when the user gave `(Hq,)`); for varlen B is the number
        of sequences. attn_bias: 4-D `(Bb, Hb, Lqb, Lkb)`, each dim 1 (broadcast) or the full size; kernels read
        it through `bias_strides` (stride 0 on broadcast dims). mods: the user's mask_mod / score_mod
        (`mods.Mods`), or None.
    """

    mask: MaskSpec = field(default_factory=lambda: make_mask(False))
    alibi_slopes: torch.Tensor | None = None
    attn_bias: torch.Tensor | None = None
    varlen: Varlen | None = None
    mods: Mods | None = None

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def per_call_tensors(self) -> bool:
        """ALiBi slopes, a bias or mods: tensors of the call's own that a remembered plan or launch would freeze."""
        return self.alibi_slopes is not None or self.attn_bias is not None or self.mods is not None

    @property
    def plain_scores(self) -> bool:
        """The scores are q·kᵀ scaled under a causal mask or none: no window, softcap, ALiBi, bias or mods (a packed
        batch or not). What a prepared launch can repeat: nothing per call beyond the tensors."""
        return self.mask.is_plain and not self.per_call_tensors

    @property
    def is_plain(self) -> bool:
        """Only what the original dense kernels compute: plain scores, not packed."""
        return self.plain_scores and self.varlen is None


def plain_call(window=None, softcap=None, alibi_slopes=None, attn_bias=None, mask_mod=None, score_mod=None) -> bool:
    """Whether a front door's keyword arguments ask for plain scores (CallFeatures.plain_scores) before they are
    checked: the test of the prepared fast paths, which skip the checks."""
    return (window is None and softcap is None and alibi_slopes is None and attn_bias is None and mask_mod is None
            and score_mod is None)


PLAIN = CallFeatures()


def as_features(causal_or_features) -> CallFeatures:
    """Kernel launchers take either the old `causal` bool or a `CallFeatures`."""
    if isinstance(causal_or_features, CallFeatures):
        return causal_or_features
    return CallFeatures(mask=make_mask(bool(causal_or_features)))


def bias_strides(bias: torch.Tensor, shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The bias's strides as read over the full (B, H, Lq, Lk) problem: 0 on its broadcast dims."""
    return tuple(bias.expand(shape).stride())


def feature_names(features: CallFeatures, head_dim: int, bias_grad: bool = False) -> frozenset[str]:
    """The feature words of a call (see FEATURES)."""
    mask = features.mask
    names = set()
    if mask.causal:
        names.add("causal")
    if mask.bounded_left or (mask.bounded_right and not (mask.causal and mask.window_right == 0)):
        names.add("window")
    if mask.softcap > 0:
        names.add("softcap")
    if features.alibi_slopes is not None:
        names.add("alibi")
    if features.attn_bias is not None:
        names.add("bias")
        if bias_grad:
            names.add("bias_grad")
    if features.varlen is not None:
        names.add("varlen")
    if head_dim % 8 or head_dim < 16:
        names.add("odd_head_dim")
    mods = features.mods
    if mods is not None and mods.mask is not None:
        names.add("mask_mod")
    if mods is not None and mods.score is not None:
        names.add("score_mod")
    return frozenset(names)
