"""The Hopper (sm_90) backend: the Gluon attention kernels and the e4m3 FP8 forward, behind the backend contract.

What the Gluon kernels take is declared here, once (`FORWARD_FEATURES`, `BACKWARD_FEATURES`, in the words of
`features.FEATURES`): a call with any other feature runs the portable Triton kernels on Hopper too, and
`describe_dispatch` says which feature sent it there. A kernel that learns a feature adds its word here (and reads
the feature's arguments from `CallFeatures`). The tile and schedule heuristics live in `hopper/tiles.py`.

`HOPPER` plans the forward (`HopperForward`: tiles, persistent CTAs, Q buffers, overlapped work items) and, through
`HOPPER.backward`, the backward (`HopperBackward`); `HOPPER_FP8` plans the FP8 forward on e4m3 operands
(`HopperFp8Forward`) where Gluon builds and TMA can read q, k and Vᵀ. A Gluon kernel is built at its first launch:
each plan carries the `fallback` the planner's walk chose for the case where that build fails on the installed
Triton (`backends.choose`, shown by describe_dispatch; None where the family was asked for by name, which then
raises GluonUnavailable). A failure is remembered (gluon.availability, warned once): every later call's plan
declines these kernels with its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashmoe_science.attention.triton import backend as triton_backend
from flashmoe_science.attention.features import FEATURES
from flashmoe_science.attention.mods import call_block_mask
from flashmoe_science.attention.checks import capturing
from flashmoe_science.attention.seqlen import launch_sizes
from flashmoe_science.attention.layout import bias_tma_view, tma_compatible
from flashmoe_science.attention.hopper.tiles import (
    SM90_CONSUMER_REASONS,
    sm90_backward_wins,
    sm90_band_schedule,
    sm90_bias_tiles,
    sm90_cross_item,
    sm90_forward_pingpong,
    sm90_varlen_band,
    sm90_forward_skip_rescale,
    sm90_forward_tiles,
    sm90_fp8_forward_tiles,
    sm90_fp8_q_buffers,
    sm90_persistent,
    sm90_plan_length,
    sm90_q_buffers,
)
from flashmoe_science.attention.problem import new_outputs
from flashmoe_science.attention.record import ran
from flashmoe_science.attention.tiles import AttentionTiles, autotune_enabled, padded_head_dim
from flashmoe_science.device import device_traits
from flashmoe_science.gluon.availability import function_refusal, plan_time_reason, run_gluon, unavailable_reason
from flashmoe_science.gluon.target import ARCH
from flashmoe_science.prepared_cache import SEEN_ONCE, prepared_table, remember, tensor_signature

# forward: odd head dims reach the kernel padded; the bias's gradient is the backward's; a mask_mod beside causal, a
# window and varlen (HopperAttention.decline), walked through its block mask; a score_mod on every visited score
FORWARD_FEATURES = frozenset({"causal", "window", "softcap", "alibi", "bias", "bias_grad", "varlen", "mask_mod",
                              "score_mod"})
# the backward runs after a Triton forward too (`_HopperAttentionBackward.decline`); attn_bias where the one-pass
# kernel reads it by TMA (bwd_sm90.bias_refusal); a mask_mod where its one pass walks the block mask, a score_mod
# and its derivative on every visited score (bwd_sm90.mod_refusal)
BACKWARD_FEATURES = frozenset({"causal", "window", "softcap", "alibi", "bias", "bias_grad", "varlen", "mask_mod",
                               "score_mod"})

FORWARD_KERNEL = "hopper.fwd_sm90.attention_forward_sm90_kernel"
BACKWARD_KERNEL = "hopper.bwd_sm90.attention_backward_sm90"
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
TMA_RULE = "TMA needs a unit last stride and 16-byte aligned base addresses and strides"


def missing(names: frozenset[str], supported: frozenset[str]) -> list[str]:
    """The features of a call (`names`) outside `supported`, in FEATURES order (empty: the kernels take it)."""
    return [name for name in FEATURES if name in names and name not in supported]


def _on_hopper(q) -> bool:
    return q.is_cuda and device_traits(q.device).arch == ARCH


def gluon_refusal() -> str | None:
    """Why the Gluon kernels are off (gluon.availability.plan_time_reason: on a triton outside the tested range the
    D=64 forward is built offline first, once per process), or None."""
    def build():
        from flashmoe_science.attention.hopper.fwd_sm90 import compile_offline

        compile_offline(64, False, AttentionTiles(128, 128, 8, 2))

    return plan_time_reason("attention forward", build)


# --------------------------------------------------------------------------------------------------- forward
# The forward's launches per call signature (`HopperForward.prepared_key`): a call whose signature ran before skips
# Triton's binding of its arguments (host time: docs/perf-notes.md). A signature is prepared on its second call
# (prepared_cache.SEEN_ONCE marks the first).
PREPARED_FORWARD: dict[tuple, object] = prepared_table("sm_90 attention forward launches")


def varlen_batch(varlen, rows: int, mask, block_m: int, band: int = 1):
    """The persistent forward's view of a packed batch of `rows` query rows under `mask` (seqlen.VarlenBatch: its
    work list of `block_m`-row query tiles, the plan's, ranked in bands of `band` tiles for the causal path), or None
    for a dense call."""
    if varlen is None:
        return None
    from flashmoe_science.attention.seqlen import VarlenBatch

    return VarlenBatch.of(varlen.cu_seqlens_q, varlen.cu_seqlens_k, block_m, rows, mask.plain_causal, band)


@dataclass(frozen=True)
class HopperForward:
    """The Gluon sm_90 forward: `tiles` (64 query rows per consumer warpgroup: tiles.sm90_forward_consumers; key
    tile and ring depth vary), `persistent` (one CTA per SM
    looping over query tiles, else one CTA per tile), `q_buffers` per consumer warpgroup, `cross_item` (overlap
    consecutive work items), `bias_tma` (the producer loads the attn_bias tiles by TMA; else the consumers load
    them), `fallback` (the planner's plan for a failed Gluon build; None: the failure raises)."""

    tiles: AttentionTiles
    persistent: bool
    q_buffers: int
    cross_item: bool
    bias_tma: bool = False
    fallback: object = None
    band: int = 1
    backend = "hopper"
    kernel = FORWARD_KERNEL
    differentiable = False

    def run(self, q, k, v, features, softmax_scale, out=None, lse=None):
        """(out, lse) on checked 4-D views (varlen: (1, H, total, D); lse (1, H, total)). A call of a signature
        that ran before repeats its PreparedLaunch (`prepared_forward`)."""
        from flashmoe_science.attention.hopper.fwd_sm90 import attention_forward_sm90

        if lse is None:
            out, lse = new_outputs(q, features, out)
        key = self.prepared_key(q, k, v, out, lse, features, softmax_scale)
        prepared = PREPARED_FORWARD.get(key) if key is not None else None
        if prepared is not None and prepared is not SEEN_ONCE:
            return self.launch(prepared, q, k, v, features, out, lse)
        batch = varlen_batch(features.varlen, q.shape[2], features.mask, self.tiles.block_m, self.band)
        num_ctas = device_traits(q.device).sm_count if self.persistent else None
        mods = features.mods
        mask_mod, score_mod = (mods.mask, mods.score) if mods is not None else (None, None)
        # the block mask at the kernel's own tiles (built on the device, remembered while the mod's tensors live)
        blocks = call_block_mask(q, k, features, self.tiles.block_m, self.tiles.block_n)
        if run_gluon("attention forward", lambda: attention_forward_sm90(
                q, k, v, out, lse, features.causal, softmax_scale, self.tiles, num_ctas, self.q_buffers,
                self.cross_item, mask=features.mask, alibi_slopes=features.alibi_slopes, varlen=batch,
                attn_bias=features.attn_bias, bias_tma=self.bias_tma, mask_mod=mask_mod, blocks=blocks,
                score_mod=score_mod), self.fallback is None, mods.functions if mods is not None else None):
            ran("forward", self.backend, self.kernel)
            if prepared is SEEN_ONCE:
                self.prepare(q, k, v, out, lse, features, softmax_scale)
            elif key is not None:
                remember(PREPARED_FORWARD, key, SEEN_ONCE)
            return out, lse
        # it did not build on this triton (warned once, remembered): the plan the walk chose for that case
        return self.fallback.run(q, k, v, features, softmax_scale, out, lse)

    def launch(self, prepared, q, k, v, features=None, out=None, lse=None):
        """(out, lse) of a call through its signature's PreparedLaunch (`prepare`'s) on checked 4-D views; a packed
        call's (`features.varlen`) with its cumulative lengths and work list."""
        if lse is None:
            out, lse = new_outputs(q, features, out)
        varlen = None if features is None else features.varlen
        batch = (varlen_batch(varlen, q.shape[2], features.mask, self.tiles.block_m, self.band)
                 if varlen is not None else None)
        ran("forward", self.backend, self.kernel)
        prepared(q, k, v, out, lse, *(() if batch is None else batch.tensors()))
        return out, lse

    def prepared_key(self, q, k, v, out, lse, features, softmax_scale: float) -> tuple | None:
        """What a PreparedLaunch of this plan freezes from a call (prepared_cache.tensor_signature of every tensor,
        the mask, the scale), or None for calls it cannot repeat: ALiBi slopes, windows and softcaps are per-call
        arguments it would freeze."""
        if not features.plain_scores or autotune_enabled():
            return None
        varlen = features.varlen
        tensors = (q, k, v, out, lse) if varlen is None else (q, k, v, out, lse, varlen.cu_seqlens_q,
                                                             varlen.cu_seqlens_k)
        return (self, *map(tensor_signature, tensors), features.causal, softmax_scale)

    def prepare(self, q, k, v, out, lse, features, softmax_scale: float):
        """This launch as a PreparedLaunch for the next call of its signature (PREPARED_FORWARD), called as
        `prepared(q, k, v, out, lse)` (varlen: then cu_seqlens_q, cu_seqlens_k and the work list), after a launch
        of the same signature compiled the kernel; None where the call cannot be repeated (`prepared_key`) or the
        Gluon build is unavailable (the call ran the Triton kernel)."""
        key = self.prepared_key(q, k, v, out, lse, features, softmax_scale)
        if key is None or unavailable_reason() is not None:
            return None
        prepared = PREPARED_FORWARD.get(key)
        if prepared is None or prepared is SEEN_ONCE:
            from flashmoe_science.attention.hopper.fwd_sm90 import prepare_forward

            num_ctas = device_traits(q.device).sm_count if self.persistent else None
            prepared = prepare_forward(q, k, v, out, lse, features.causal, softmax_scale, self.tiles, num_ctas,
                                       self.q_buffers, self.cross_item,
                                       varlen=varlen_batch(features.varlen, q.shape[2], features.mask,
                                                           self.tiles.block_m, self.band))
            remember(PREPARED_FORWARD, key, prepared)
        return prepared

    def describe(self, problem, requested: str, with_features: str, declined: str) -> str:
        tiles = self.tiles
        shape = f"tiles {tiles.block_m}x{tiles.block_n}, {tiles.num_warps} warps, {tiles.num_stages} stages"
        if problem.features.attn_bias is not None:
            shape += (", bias tiles loaded by TMA beside K" if self.bias_tma
                      else ", bias read by the consumers' masked loads (it broadcasts over queries or keys, or its "
                           "strides or the shared memory do not suit TMA)")
        ctas = (f"persistent, one CTA per SM, {self.q_buffers} Q buffer(s) per consumer"
                + (", consecutive query tiles overlapped" if self.cross_item else "") if self.persistent
                else "one CTA per query tile")
        mods = problem.features.mods
        if mods is not None and mods.mask is not None:
            shape += ", mask_mod's full key tiles unmasked and its partial ones masked (its block mask at these tiles)"
        if mods is not None and mods.score is not None:
            shape += ", score_mod on every visited score"
        if self.band > 1:
            ctas += (f"; causal packed tiles dealt in bands of {self.band} side by side (its K/V outgrows L2 and its "
                     "sequences are long: tiles.sm90_varlen_band)")
        band = _band_schedule(problem, tiles, device_traits(problem.q.device).sm_count)
        if band is not None:
            ctas += (f"; a band of {band.item_keys} keys per query tile, planned as a dense call of that length: "
                     f"SMs busy {band.static:.2f} in static rounds vs {band.per_tile:.2f} one CTA per tile "
                     "(estimated)")
        consumers = tiles.block_m // 64
        turns = (", issuing their products in turn (head dim <= 64)"
                 if sm90_forward_pingpong(problem.q.shape[-1], fp8=False) else "")
        if sm90_forward_skip_rescale(problem.q.shape[-1], fp8=False):
            turns += ", O's rescale skipped by warps whose row maxima did not move (head dim > 128)"
        return (f"{requested} the Gluon sm_90 kernel{with_features} (TMA producer warp, {consumers} consumer "
                f"warpgroups of 64 rows{SM90_CONSUMER_REASONS[consumers]}{turns}, async wgmma, softmax overlapped "
                f"with P·V; {ctas}); {shape}")


# auto takes the Gluon forward for a mask_mod whose visited tiles are at most this share partial: against the Triton
# forward in the mask-mods suite (H100, D=128) it led where most tiles are full and trailed from 61% partial tiles
# (docs/perf-notes.md, "User masks in the sm_90 forward")
SM90_MOD_PARTIAL_SHARE = 0.5
_MOD_SHARES: dict = {}


def mod_forward_refusal(problem) -> str | None:
    """Why auto leaves a call with mods to the Triton forward, or None: at D=128 (the head dim measured) the Gluon
    forward takes a mask_mod whose visited tiles are at most SM90_MOD_PARTIAL_SHARE partial at its own tiles, and no
    score_mod (it measured slower than the Triton score_mod forward: docs/perf-notes.md, "User masks in the sm_90
    forward"). The share is read on the host once per mod function, mask, packed or not, heads, lengths and tiles
    (`BlockMask.partial_share`: one synchronisation), never while a CUDA graph is captured."""
    if problem.features.mods.score is not None:
        return ("its score_mod forward runs only when asked for (backend='hopper'): it measured 0.68-0.96x the "
                "Triton score_mod forward (H100, D=128)")
    if padded_head_dim(problem.head_dim) != 128:
        return "its mask_mod forward runs only when asked for (backend='hopper') at this head dim: measured at D=128"
    if problem.q4 is None:
        return ("auto reads a mask_mod's partial tiles on the 4-D views to choose this forward, and the leading dims "
                "do not merge (backend='hopper' takes it)")
    tiles = forward_plan(problem).tiles
    features = problem.features
    _, seqlen_q, seqlen_k = launch_sizes(problem.q4, problem.k4, features.varlen)
    key = (features.mods.mask.fn, features.mask, features.varlen is not None, problem.q4.shape[1], seqlen_q,
           seqlen_k, tiles.block_m, tiles.block_n)
    share = _MOD_SHARES.get(key)
    if share is None:
        if capturing(problem.q.device):
            return ("auto reads a mask_mod's partial tiles on the host to choose this forward: not while a CUDA "
                    "graph is captured (backend='hopper' takes it)")
        share = call_block_mask(problem.q4, problem.k4, features, tiles.block_m, tiles.block_n).partial_share()
        if len(_MOD_SHARES) >= 256:
            _MOD_SHARES.clear()
        _MOD_SHARES[key] = share
    if share > SM90_MOD_PARTIAL_SHARE:
        return (f"{share:.0%} of the mask_mod's visited tiles are partial: auto takes this forward up to "
                f"{SM90_MOD_PARTIAL_SHARE:.0%}, where it leads the Triton forward (whose partial tiles cost less)")
    return None


def forward_plan(problem) -> HopperForward:
    """Tiles and schedule of the Gluon forward for a call it takes (the rules are hopper/tiles.py's; docs/perf-notes.md
    has the measurements)."""
    q, features = problem.q, problem.features
    mask = features.mask
    # a right bound (causal or a window's) plans as causal: query tiles see unequal key ranges, and a consumer may
    # skip the CTA's last key tile (sm90_cross_item_safe)
    right_bounded = mask.bounded_right
    traits = device_traits(q.device)
    seqlen_q = problem.seqlen_q
    bias = features.attn_bias
    tiles = sm90_forward_tiles(q.shape[-1], right_bounded, sm90_plan_length(seqlen_q, mask), bias is not None)
    if features.varlen is not None and tiles.block_n == 128 and q.shape[-1] > 64:
        # a packed batch with a right bound: the two-stage ring with two Q buffers measured faster than the causal
        # plan's three stages at D=128 (H200); at D=64 the causal plan's three stages lead (H100; docs/perf-notes.md,
        # "Packed causal forward")
        tiles = sm90_forward_tiles(q.shape[-1], False, seqlen_q, bias is not None)
    bias_tma, bias_bytes = False, 0
    if bias is not None and bias_tma_view(bias, q.shape[-2], problem.k.shape[-2]) is not None:
        bias_tiles = sm90_bias_tiles(tiles, q.shape[-1], bias.element_size(), traits)
        if bias_tiles is not None:  # its ring fits: the producer loads it
            tiles, bias_tma, bias_bytes = bias_tiles, True, bias.element_size()
    batch_heads = math.prod(q.shape[:-2])
    # packed batches run persistent always (the kernel numbers the real tiles itself); a band by its estimated
    # balance; other calls by sm90_persistent, where unequal items (what can make one CTA per tile win) come from
    # a right bound without a left one
    band = _band_schedule(problem, tiles, traits.sm_count)
    if features.varlen is not None:
        persistent = True
    elif band is not None:
        persistent = band.persistent
    else:
        num_work = batch_heads * -(-seqlen_q // tiles.block_m)  # query tiles of all heads
        persistent = sm90_persistent(right_bounded and not mask.bounded_left, seqlen_q, num_work, traits.sm_count)
    q_buffers = sm90_q_buffers(tiles, q.shape[-1], persistent, traits, bias_bytes)
    cross_item = sm90_cross_item(tiles, q.shape[-1], right_bounded, persistent, q_buffers)
    band = 1
    if features.varlen is not None and mask.plain_causal:
        k = problem.k
        band = sm90_varlen_band(k.shape[-2] * k.shape[-3] * k.shape[-1] * k.element_size() * 2, q.shape[-2],
                                features.varlen.num_seqs, q.shape[-3] // k.shape[-3])
    return HopperForward(tiles, persistent, q_buffers, cross_item, bias_tma=bias_tma, band=band)


def _band_schedule(problem, tiles: AttentionTiles, sm_count: int):
    """tiles.sm90_band_schedule of a dense call; None for a packed batch or a mask that is no band."""
    mask = problem.features.mask
    if not (mask.bounded_left and mask.bounded_right) or problem.features.varlen is not None:
        return None
    q = problem.q
    return sm90_band_schedule(tiles, mask, problem.seqlen_q, problem.k.shape[-2], math.prod(q.shape[:-2]),
                              sm_count)


# -------------------------------------------------------------------------------------------------- backward
def launch_backward(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale: float, dbias=None,
                    dbias_atomic: bool = False, deterministic: bool = False) -> None:
    """attention_backward_sm90 (its launches bound by Triton; a repeated signature's run through
    `HopperBackward.prepare` instead). dbias: the bias's gradient buffer (`bias_grad_buffer`)."""
    from flashmoe_science.attention.hopper.bwd_sm90 import attention_backward_sm90

    attention_backward_sm90(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale, dbias=dbias,
                            dbias_atomic=dbias_atomic, deterministic=deterministic)


@dataclass(frozen=True)
class HopperBackward:
    """The Gluon sm_90 backward: one pass for all three gradients (D <= 128; dQ summed by TMA reduce-adds, whose
    last bits may vary, or with `deterministic` added in key-block order, bit-identical run to run), or the dK/dV
    and dQ kernels (D 129..256, deterministic). It needs dQ and dK/dV both and a TMA-compatible grad_out (known
    when the backward runs: `launch_rule`); otherwise, or where it does not build on this triton, `fallback` runs
    (the next backward half of the planner's walk that takes the call). Without one (backend="hopper") it runs
    anyway (`run`) or raises."""

    deterministic: bool = False
    fallback: object = None
    mask_mod: bool = False  # the call's mask_mod, walked through its block mask (the title says so)
    score_mod: bool = False  # the call's score_mod and its derivative, on every visited score
    backend = "hopper"
    # what only the backward's launch can see; describe_dispatch names it with the fallback
    launch_rule = "where only dQ or only dK/dV is wanted or TMA cannot read grad_out"
    kernel = BACKWARD_KERNEL

    @property
    def title(self) -> str:
        if self.deterministic:
            return ("the Gluon sm_90 kernels, deterministic (up to D=128 the one pass adds dQ in key-block order: "
                    "each CTA waits for the blocks before it)")
        score = ", score_mod and its derivative on every visited score" if self.score_mod else ""
        if self.mask_mod:
            return ("the Gluon sm_90 kernels, the one pass walking the mask_mod's block mask by key block (64-row "
                    "query tiles: full ones unmasked, partial ones masked with the mod, empty ones never loaded)"
                    + score)
        if self.score_mod:
            return "the Gluon sm_90 kernels, the one pass on 64-row query tiles" + score
        return "the Gluon sm_90 kernels"

    def run(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale: float, deterministic: bool,
            need_dbias: bool):
        """(dq, dk, dv, dbias). Without a `fallback` (backend="hopper") nothing else runs: a gradient not asked for
        is computed and dropped, a grad_out TMA cannot read is copied, and a failed build raises GluonUnavailable."""
        strict = self.fallback is None
        want_dq, want_dkdv = dq is not None, dk is not None
        if strict:
            dq = torch.empty_like(q) if dq is None else dq
            dk, dv = (torch.empty_like(k), torch.empty_like(v)) if dk is None else (dk, dv)
            grad_out = grad_out if tma_compatible(grad_out) else grad_out.contiguous()
            if not tma_compatible(grad_out):
                raise ValueError(f"backend='hopper': the Gluon sm_90 backward reads grad_out by TMA, which cannot "
                                 f"read it at head dim {grad_out.shape[-1]} ({TMA_RULE}); backend='auto' runs the "
                                 "Triton backward there")
        bias = features.attn_bias
        dbias = dbias_atomic = None
        if need_dbias:  # deterministic: no atomics (a full buffer, summed over the broadcast dims after)
            dbias, dbias_atomic = triton_backend.bias_grad_buffer(bias, (*q.shape[:3], k.shape[2]), deterministic)
        if (dq is not None and dk is not None and tma_compatible(grad_out)
                and run_gluon("attention backward", lambda: launch_backward(
                    q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale, dbias, dbias_atomic,
                    deterministic), strict, features.mods.functions if features.mods is not None else None)):
            ran("backward", self.backend, self.kernel)
            dbias = None if dbias is None else triton_backend.bias_grad_of_buffer(dbias, bias)
            if not want_dq:  # computed for the kernel's sake only (backend="hopper")
                dq = None
            if not want_dkdv:
                dk = dv = None
            return dq, dk, dv, dbias
        return self.fallback.run(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale,
                                 deterministic, need_dbias)

    def prepare(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale: float):
        """The one-pass kernel's launch sequence (bwd_sm90.PreparedBackward: the preprocess, the main kernel, the dQ
        conversion) for the next backward of this call's signature (autograd.BackwardPlan keys it), called as
        `prepared(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features)` after `run` launched the same
        signature (the kernels are compiled). None where `run` did not take the one pass here (a grad_out TMA cannot
        read, the Gluon kernels off) or its launches take per-call arguments a prepared launch would freeze
        (windows, softcaps, ALiBi slopes, a bias; the D=256 pair, fewer and larger problems, is not prepared)."""
        from flashmoe_science.attention.hopper.bwd_sm90 import PreparedBackward, is_deterministic, varlen_tensors

        if (is_deterministic(q.shape[-1]) or not features.plain_scores or autotune_enabled()
                or unavailable_reason() is not None or not tma_compatible(grad_out)):
            return None
        prepared = PreparedBackward(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale,
                                    deterministic=self.deterministic)
        if features.varlen is None:
            def launch(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features):
                prepared(q, k, v, out, lse, grad_out, delta, dq, dk, dv)
        else:
            def launch(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features):
                prepared(q, k, v, out, lse, grad_out, delta, dq, dk, dv, *varlen_tensors(features, k.shape[2]))
        return launch


def backward_refusal(head_dim: int, seqlen_q: int, softmax_scale: float, measured: bool = True) -> str | None:
    """Why the Gluon backward does not take a call its inputs suit (TMA-compatible bf16/fp16 on Hopper), or None:
    its head dims, a positive scale (its masks are -inf scores), and, with `measured` (backend="auto"), where it
    measured slower than the Triton backward (`sm90_backward_wins`; seqlen_q: the longest sequence's queries).
    Determinism does not decline it: the one pass orders its dQ reduce-adds (`HopperBackward.deterministic`), the
    D=256 pair adds nothing; the rule compares with the default Triton backward (the deterministic Triton two
    passes only cost more)."""
    from flashmoe_science.attention.hopper.bwd_sm90 import SUPPORTED_BLOCK_D

    if padded_head_dim(head_dim) not in SUPPORTED_BLOCK_D:
        return f"it takes head dims padding to {', '.join(map(str, SUPPORTED_BLOCK_D))}"
    if softmax_scale <= 0:
        return "its masks need a positive softmax_scale"
    if measured and not sm90_backward_wins(head_dim, seqlen_q):
        return "the Triton backward measured faster at this head dim and length"
    return None


class _HopperAttentionBackward:
    """The backward half of the Hopper family. It also takes the backward of a Triton forward (a feature the Gluon
    forward does not take, or its build failed) where the inputs suit it."""

    name = "hopper"
    title = "the sm_90 backward"

    def decline(self, question) -> str | None:
        problem, forward = question.problem, question.forward
        q = problem.q
        gluon_off = gluon_refusal()
        if gluon_off is not None:
            return gluon_off
        if forward.backend != "hopper":  # an sm_90 forward vouches for these
            if not _on_hopper(q):
                return "it needs a Hopper (sm_90) GPU"
            if q.dtype not in KERNEL_DTYPES:
                return "it runs bf16/fp16 only"
            if not tma_compatible(problem.q, problem.k, problem.v):
                return TMA_RULE
            try:
                import flashmoe_science.attention.hopper.bwd_sm90  # noqa: F401
            except ImportError as error:
                return f"its Gluon module does not import ({error})"
        absent = missing(problem.feature_names(), BACKWARD_FEATURES)
        if absent:
            return f"it does not take {', '.join(absent)} yet"
        mods = problem.features.mods
        if mods is not None:
            from flashmoe_science.attention.hopper.bwd_sm90 import mod_refusal

            refusal = (mod_refusal(problem.features, problem.head_dim, problem.deterministic_now())
                       or function_refusal(mods.functions))
            if refusal is not None:
                return refusal
            if problem.backend != self.name and padded_head_dim(problem.head_dim) != 128:
                # measured at D=128 only (H100): ahead of the Triton backward on every mask of the mask-mods suite,
                # all-partial ones included, and with a softcap or ALiBi-table score_mod
                # (docs/perf-notes.md, "mask_mod and score_mod in the sm_90 backward")
                return ("its mask_mod and score_mod backward runs only when asked for (backend='hopper') at this "
                        "head dim: measured at D=128")
        if problem.features.attn_bias is not None:
            from flashmoe_science.attention.hopper.bwd_sm90 import bias_refusal

            refusal = (bias_refusal(problem.features, problem.q4, problem.k4) if problem.q4 is not None
                       else "it takes attn_bias where the leading dims merge into one batch dim")
            if refusal is not None:
                return refusal
        # backend="hopper" runs it wherever it can (no other backward may): the rules of speed are "auto"'s
        measured = problem.backend == "auto"
        mask = problem.features.mask
        if (measured and problem.deterministic_now() and mask.causal and not mask.bounded_left
                and padded_head_dim(problem.head_dim) <= 128):
            # Every key block's dQ adds wait for the blocks before it, and under a plain causal mask block 0 visits
            # every query tile: the whole grid trails one CTA's walk (H100: up to 1.90x the default backward, more
            # than the Triton two passes cost; docs/perf-notes.md, "Deterministic mode in the one pass").
            return ("deterministic with a causal mask unbounded on the left: the one pass's ordered dQ adds measured "
                    "1.5-1.9x the default backward there, the Triton two passes 1.0-1.25x")
        return backward_refusal(problem.head_dim, problem.seqlen_q, problem.softmax_scale, measured)

    def plan(self, question) -> HopperBackward:
        problem = question.problem
        mods = problem.features.mods
        return HopperBackward(problem.deterministic_now(), mask_mod=mods is not None and mods.mask is not None,
                              score_mod=mods is not None and mods.score is not None)


class HopperAttention:
    """The Gluon sm_90 kernels: Hopper GPUs, bf16/fp16, TMA-compatible strides, the features of FORWARD_FEATURES."""

    name = "hopper"
    title = "the sm_90 kernel"
    runs_kernels = True
    # the README's row of this family: what it takes, its forward, its backward (plan.policy_table renders it)
    policy = ("CUDA sm_90, bf16/fp16, TMA-compatible strides, head dim a multiple of 8 in [16, 256]",
              "Gluon sm_90 kernel (warp-specialised, persistent)",
              "Gluon sm_90: one pass to D = 128 (at D = 64 from 2048 query rows), a dK/dV and a dQ kernel above; "
              "`deterministic=True` orders the one pass's dQ adds (a plain causal mask: Triton's two passes); else "
              "Triton (an `attn_bias` not read by TMA or beside a softcap)")
    backward = _HopperAttentionBackward()

    def decline(self, problem) -> str | None:
        q = problem.q
        if not _on_hopper(q):
            return "it needs a Hopper (sm_90) GPU"
        if q.dtype not in KERNEL_DTYPES:
            return "it runs bf16/fp16 only"
        gluon_off = gluon_refusal()
        if gluon_off is not None:
            return gluon_off
        absent = missing(problem.feature_names(), FORWARD_FEATURES)
        if absent:
            return f"it does not take {', '.join(absent)} yet"
        features = problem.features
        refused = function_refusal(features.mods.functions) if features.mods is not None else None
        if refused is not None:
            return refused
        if not tma_compatible(q, problem.k, problem.v):
            return TMA_RULE
        if features.mods is not None and problem.backend != self.name:
            return mod_forward_refusal(problem)
        return None

    def plan(self, problem) -> HopperForward:
        return forward_plan(problem)


HOPPER = HopperAttention()


# ------------------------------------------------------------------------------------------------------- FP8
@dataclass(frozen=True)
class HopperFp8Forward:
    """The Gluon sm_90 forward on e4m3 operands (fwd_sm90.attention_forward_sm90_fp8): the bf16 kernel's producer
    warp and two consumer warpgroups, e4m3 wgmma with P in registers, so one consumer's softmax overlaps the other's
    products. `tiles` (hopper/tiles.sm90_fp8_forward_tiles), `persistent`, `q_buffers` as in HopperForward;
    `fallback`: the planner's plan for a failed Gluon build (None: backend="hopper", the failure raises)."""

    tiles: AttentionTiles
    persistent: bool
    q_buffers: int
    fallback: object = None
    backend = "hopper"
    kernel = FORWARD_KERNEL

    def run(self, problem):
        from flashmoe_science.attention.fp8 import fp8_outputs, no_keys
        from flashmoe_science.attention.hopper.fwd_sm90 import attention_forward_sm90_fp8

        q, k = problem.q, problem.k
        out, lse = fp8_outputs(q)
        if not (q.numel() and k.shape[2]):
            return no_keys(out, lse)
        num_ctas = device_traits(q.device).sm_count if self.persistent else None
        descales = tuple(d.contiguous() for d in problem.descales)
        if run_gluon("e4m3 attention forward", lambda: attention_forward_sm90_fp8(
                q, k, problem.v, out, lse, *descales, problem.causal, problem.softmax_scale, self.tiles, num_ctas,
                self.q_buffers), self.fallback is None):
            ran("forward", self.backend, self.kernel)
            return out, lse
        return self.fallback.run(problem)  # it did not build on this triton (warned once, remembered)

    def describe(self) -> str:
        tiles = self.tiles
        ctas = (f"persistent, one CTA per SM, {self.q_buffers} Q buffer(s) per consumer" if self.persistent
                else "one CTA per query tile")
        return (f"the Gluon sm_90 kernel on e4m3 operands (TMA producer warp, two consumer warpgroups, e4m3 wgmma "
                f"with P in registers, softmax overlapped with P·V; {ctas}); tiles {tiles.block_m}x{tiles.block_n}, "
                f"{tiles.num_warps} warps, {tiles.num_stages} stages")


def fp8_forward_plan(problem) -> HopperFp8Forward:
    """The Gluon e4m3 forward's tiles, with the bf16 plan's persistence rule (tiles.sm90_persistent)."""
    q = problem.q
    traits = device_traits(q.device)
    tiles = sm90_fp8_forward_tiles(q.shape[-1])
    seqlen_q = q.shape[-2]
    num_work = math.prod(q.shape[:-2]) * -(-seqlen_q // tiles.block_m)
    persistent = sm90_persistent(problem.causal, seqlen_q, num_work, traits.sm_count)
    return HopperFp8Forward(tiles, persistent, sm90_fp8_q_buffers(tiles, q.shape[-1], persistent, traits))


class HopperFp8:
    """The Gluon e4m3 kernel: Hopper GPUs, head dims 64, 128 and 256, Gluon building on this triton, q, k and Vᵀ (the
    quantiser's K-major V) readable by TMA."""

    name = "hopper"
    title = "the Gluon sm_90 e4m3 kernel"

    def decline(self, problem) -> str | None:
        from flashmoe_science.attention.fp8 import e4m3_kernel_refusal

        q, k, v = problem.q, problem.k, problem.v
        if not _on_hopper(q):
            return "it needs a Hopper (sm_90) GPU"
        refusal = e4m3_kernel_refusal(problem) or gluon_refusal()
        if refusal is not None:
            return refusal
        if not tma_compatible(q, k, v.transpose(-1, -2)):
            return f"it reads q, k and a K-major v (quantize_fp8's layout) by TMA: {TMA_RULE}"
        return None

    def plan(self, problem) -> HopperFp8Forward:
        return fp8_forward_plan(problem)


HOPPER_FP8 = HopperFp8()
