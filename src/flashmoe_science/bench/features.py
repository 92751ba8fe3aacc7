"""Benchmarks of the packed and masked attention: `flashmoe-science bench --suite varlen,window,mods`.

Suites (bf16, D=128, one GPU; on a CPU-only machine every size shrinks by 64 as a smoke test of the harness):

- ``varlen``: batches of 16384 tokens in sequences of the lengths a user meets (`VARLEN_DISTRIBUTIONS`, fixed
  seeds): long-tailed (log-normal, clipped to 64..8192: at seed 0, 49 sequences of 64..1626), a packed pre-training
  batch (one 8192-token document and many of 64..512) and uniform 512..4096; causal and not (``--quick``: the long
  tail only). ``flashmoe-varlen`` (`flash_attention_varlen`) against ``fa4-varlen`` (FlashAttention-4's
  `flash_attn.cute.flash_attn_varlen_func` on the same packed tensors and cumulative lengths, where
  `bench.attention.fa4_skip_reason` finds it importable on an sm_90/sm_100 GPU; else skipped with that reason),
  ``fa3-varlen`` (vLLM's FlashAttention-3 build, `flash_attn_varlen_func(..., fa_version=3)` on the same tensors,
  forward only, where `bench.attention.fa3_skip_reason` finds it importable on an sm_90 GPU),
  ``flashmoe-dense`` (our dense call at equal tokens, 4 x 4096), ``sdpa-nested`` (SDPA on a jagged nested tensor,
  whichever kernel PyTorch picks) and ``sdpa-cudnn-padded`` (cuDNN's SDPA on the batch padded to the longest
  sequence, without a key-padding mask: a lower bound of the padded call's cost, since a mask would take cuDNN off its
  fast path). Then a padded Hugging Face batch (`PADDED_ROWS` uniform lengths right-padded to the longest, causal; in
  ``--quick`` too) through transformers' attention interface end to end: ``flashmoe-hf`` (our registered function,
  which packs the real tokens) against ``sdpa-padded`` (transformers' "sdpa" with its padding mask) and
  ``sdpa-cudnn-padded`` (the same on cuDNN without a mask: exact on the real rows, since causal attention hides right
  padding); left out, with a warning saying why, where transformers is not installed.
- ``window``: a causal sliding window of 4096 keys at L = 32k and 128k: ``flashmoe-window`` against our dense causal
  call (``flashmoe-dense``, auto; ``flashmoe-triton-dense``, the Triton kernel the window runs on until the Gluon
  kernels take windows) and compiled FlexAttention with the equivalent block mask (``flex-window``).
- ``mods``: softcap (30), ALiBi and a (1, H, L, L) bias at B=4, L=4096, causal, against the plain call (auto and
  Triton).
- ``packed``: packed batches of equal lengths (`PACKED_TOKENS` tokens, hidden size `PACKED_HIDDEN`: H = 2048 / D),
  L 512..4096, D 64/128/256, causal and not: ``flashmoe-varlen`` against ``flashmoe-dense`` (the same batch as a
  dense (B, H, L, D) call), ``fa3-varlen`` and ``fa4-varlen``, each also replayed from a CUDA graph (``-graph``,
  forward only: a graph repeats the captured kernels, the packed batch's work list included, as serving engines and
  compiled training steps run them). ``--quick``: L 1024 and 4096.
- ``mask-mods``: masks users write as `mask_mod` functions (document + window, prefix-LM, per-head windows, a
  neighbour list) through ``flashmoe``, compiled FlexAttention with the same block mask (``flex``) and, where
  `fa4_skip_reason` lets it run, FlashAttention-4 with each mask's CuTe DSL twin on that block mask at its own tile
  (``fa4``, forward and backward; `bench/mask_mods_fa4.py`); see `bench/mask_mods.py`; where an architecture family
  plans the mod forward when asked for by name, also that forward (``flashmoe-arch``, and its backward where the
  family plans that); causal and a sliding window written as mods beside their built-in keywords
  (``flashmoe-builtin``). Records: op "attention-mask-mod" with B, H, L, D.

TFLOP/s count only the pairs attended: FlashAttention's convention for dense calls (4·Lq·Lk·D per head, halved when
causal; backward 2.5 x forward), each sequence's own for varlen, and the exact number of (query, key) pairs inside
the window. Records: {"op": "attention-features", "suite", "case", "pass", "backend", "ms", "tflops", "note"}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from flashmoe_science.bench.attention import (VLLM_FA3_FORWARD_ONLY, _measure_backward, _measure_forward,
                                              equal_cu_seqlens, fa3_skip_reason, fa3_varlen, fa4_output,
                                              fa4_skip_reason)
from flashmoe_science.bench.report import (format_number, graph_replay, median_over_rounds, plot_panels,
                                           records_table, round_significant, tflops)

SUITES = ("varlen", "window", "mods", "packed", "mask-mods")
SUITE_OPS = {"mask-mods": "attention-mask-mod"}  # the record's op; "attention-features" otherwise
PASSES = ("fwd", "bwd")
HEADS, HEAD_DIM = 16, 128
VARLEN_TOKENS, VARLEN_MIN, VARLEN_MAX = 16384, 64, 8192
WINDOW = 4096
WINDOW_LENGTHS = (32768, 131072)
CPU_SHRINK = 64
PACKED_TOKENS, PACKED_HIDDEN = 16384, 2048
PACKED_LENGTHS, PACKED_HEAD_DIMS = (512, 1024, 2048, 4096), (64, 128, 256)
GRAPH_SUFFIX = "-graph"


@dataclass
class Contender:
    """One backend of a case: its inputs (q, k, v), the call, the forward FLOPs it is credited with, a note; a
    forward-only one (a peer without a backward) is timed forward only."""

    make_inputs: Callable[[], tuple[torch.Tensor, ...]]
    attend: Callable
    flops_fwd: float
    note: str = ""
    forward_only: bool = False
    graphed: bool = False  # timed as a CUDA-graph replay (forward only)

    @property
    def passes(self) -> tuple[str, ...]:
        return PASSES[:1] if self.forward_only or self.graphed else PASSES


@dataclass
class Case:
    """A suite's case: its contenders, and what it leaves out (a contender, or the whole case) with the reason: a peer
    or a library not installed here."""

    suite: str
    name: str
    contenders: dict[str, Contender] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    fields: dict = field(default_factory=dict)  # shape fields its records carry


def _randn(*shape, device, dtype):
    return torch.randn(shape, device=device, dtype=dtype)


def dense_flops(batch, heads, lq, lk, dim, causal) -> float:
    return 4.0 * batch * heads * lq * lk * dim / (2 if causal else 1)


def long_tailed_lengths(total: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Sequence lengths summing to `total`, log-normal (median ~ 4·low) clipped to [low, high]; the last one
    takes the remainder (at least `low` when it can)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        draw = int(min(high, max(low, math.exp(math.log(4 * low) + 1.2 * torch.randn(1, generator=gen).item()))))
        lengths.append(min(draw, total - sum(lengths)))
    return lengths


def uniform_lengths(total: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Sequence lengths summing to `total`, uniform in [low, high]; the last one takes the remainder."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(low, high + 1, (1,), generator=gen)), total - sum(lengths)))
    return lengths


def packed_document_lengths(total: int, longest: int, low: int, high: int, seed: int = 0) -> list[int]:
    """A packed pre-training batch: one `longest`-token document, then documents uniform in [low, high]."""
    return [longest, *uniform_lengths(total - longest, low, high, seed)]


# name -> lengths(shrink): the varlen suite's batches (each VARLEN_TOKENS tokens on a GPU)
VARLEN_DISTRIBUTIONS = {
    "long tail": lambda s: long_tailed_lengths(VARLEN_TOKENS // s, max(1, VARLEN_MIN // s), VARLEN_MAX // s),
    "packed documents": lambda s: packed_document_lengths(VARLEN_TOKENS // s, 8192 // s, max(1, 64 // s), 512 // s),
    "uniform": lambda s: uniform_lengths(VARLEN_TOKENS // s, max(1, 512 // s), 4096 // s),
}


def _varlen_case(distribution: str, causal: bool, device, dtype, shrink: int) -> Case:
    from flashmoe_science import flash_attention_science, flash_attention_varlen

    lengths = VARLEN_DISTRIBUTIONS[distribution](shrink)
    total, longest, heads = sum(lengths), max(lengths), HEADS
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    real = sum(dense_flops(1, heads, n, n, HEAD_DIM, causal) for n in lengths)
    packed = lambda: tuple(_randn(total, heads, HEAD_DIM, device=device, dtype=dtype) for _ in range(3))  # noqa: E731
    dense_len = 4096 // shrink
    dense_batch = total // dense_len
    case = Case("varlen", f"{distribution}: {len(lengths)} seqs {min(lengths)}..{longest}, {total} tokens"
                + (", causal" if causal else ""))
    case.contenders["flashmoe-varlen"] = Contender(
        packed, lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal), real)
    fa4_missing = fa4_skip_reason(HEAD_DIM)
    if fa4_missing is None:
        case.contenders["fa4-varlen"] = Contender(packed, _fa4_varlen(cu, longest, causal), real)
    else:
        case.skipped["fa4-varlen"] = fa4_missing
    fa3_missing = fa3_skip_reason(HEAD_DIM)
    if fa3_missing is None:
        case.contenders["fa3-varlen"] = Contender(packed, fa3_varlen(cu, cu, longest, longest, causal), real,
                                                  forward_only=True)
        case.skipped["fa3-varlen backward"] = VLLM_FA3_FORWARD_ONLY
    else:
        case.skipped["fa3-varlen"] = fa3_missing
    case.contenders["flashmoe-dense"] = Contender(
        lambda: tuple(_randn(dense_batch, heads, dense_len, HEAD_DIM, device=device, dtype=dtype) for _ in range(3)),
        lambda q, k, v: flash_attention_science(q, k, v, causal=causal),
        dense_flops(dense_batch, heads, dense_len, dense_len, HEAD_DIM, causal), f"{dense_batch} x {dense_len}")
    if device.type == "cuda":
        offsets = cu.long()

        def nested(q, k, v):
            q, k, v = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).values()

        case.contenders["sdpa-nested"] = Contender(packed, nested, real, "jagged nested tensors")

        def padded(q, k, v):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        if len(lengths) * longest > 8 * total:  # padding would cost more than 8x the tokens: not a user's choice
            return case
        case.contenders["sdpa-cudnn-padded"] = Contender(
            lambda: tuple(_randn(len(lengths), heads, longest, HEAD_DIM, device=device, dtype=dtype)
                          for _ in range(3)),
            padded, real, f"padded to {len(lengths)} x {longest}, no padding mask")
    return case


def _fa4_varlen(cu: torch.Tensor, longest: int, causal: bool) -> Callable:
    """FlashAttention-4's varlen call on our packed (total, H, D) tensors and int32 cumulative lengths (its layout
    too, so no copy); it returns (out, lse) and differentiates through its own backward."""
    from flash_attn.cute import flash_attn_varlen_func

    def attend(q, k, v):
        return fa4_output(flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                                 max_seqlen_k=longest, causal=causal))

    return attend


PADDED_ROWS = 12


def padded_batch_lengths(rows: int, low: int, high: int, seed: int = 0) -> list[int]:
    """`rows` sequence lengths uniform in [low, high] (the uniform distribution's first draws, none cut short)."""
    return uniform_lengths(rows * high, low, high, seed)[:rows]


def _padded_hf_case(device, dtype, shrink: int) -> Case:
    """A Hugging Face batch: PADDED_ROWS sequences right-padded to the longest with the tokenizer's 0/1 mask,
    causal, through transformers' attention interface as a decoder layer calls it: the registered function with
    (module, query, key, value, attention_mask), query/key/value the ``(B, H, L, D)`` transposes of the projections'
    ``(B, L, H, D)`` outputs, the mask each implementation's own builder makes from the 2-D mask
    (``create_causal_mask``: ours gets the 2-D mask and packs the real tokens, "sdpa" a (B, 1, L, L) boolean mask).
    The mask is built once per batch (a model builds it once for all its layers), so the timed call is one layer's
    attention. ``sdpa-cudnn-padded`` is transformers' "sdpa" without a mask on cuDNN: with right padding, causal
    attention alone keeps every real query off the padding keys, so its real rows are exact."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface, LlamaConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import LlamaAttention

    from flashmoe_science.integrations import hf

    hf.register()
    lengths = padded_batch_lengths(PADDED_ROWS, max(1, 512 // shrink), 4096 // shrink)
    rows, longest, heads = len(lengths), max(lengths), HEADS
    padding = torch.arange(longest, device=device) < torch.tensor(lengths, device=device)[:, None]
    config = LlamaConfig(hidden_size=heads * HEAD_DIM, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=HEAD_DIM, num_hidden_layers=1)
    with torch.device("meta"):  # the attention functions read the module's attributes only
        module = LlamaAttention(config, layer_idx=0)
    functions = AttentionInterface()

    def layer_call(implementation: str, padding_mask=padding, backend=None):
        """One layer's attention call; the mask is built here, once, by the implementation's own mask builder."""
        config._attn_implementation = implementation
        embeds = torch.empty(rows, longest, 0, device=device, dtype=dtype)  # its shape, dtype and device only
        # the cache passed by position: transformers names it `past_key_values` up to 5.17, `cache` after
        mask = None if padding_mask is None else create_causal_mask(config, embeds, padding_mask.long(), None)
        attention = functions[implementation]

        def attend(q, k, v):
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                return attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                 scaling=module.scaling)[0]

        return attend

    make = lambda: tuple(_randn(rows, longest, heads, HEAD_DIM, device=device, dtype=dtype)  # noqa: E731
                         for _ in range(3))
    real = sum(dense_flops(1, heads, n, n, HEAD_DIM, True) for n in lengths)
    case = Case("varlen", f"HF padded: {rows} seqs {min(lengths)}..{longest} ({rows} x {longest}), {sum(lengths)} "
                          "tokens, causal")
    case.contenders["flashmoe-hf"] = Contender(make, layer_call(hf.ATTN_IMPLEMENTATION), real,
                                               "transformers' attention interface, 2-D padding mask")
    case.contenders["sdpa-padded"] = Contender(make, layer_call("sdpa"), real,
                                               "transformers' sdpa, (B, 1, L, L) padding mask")
    if device.type == "cuda":
        case.contenders["sdpa-cudnn-padded"] = Contender(
            make, layer_call("sdpa", padding_mask=None, backend=SDPBackend.CUDNN_ATTENTION), real,
            "HF batch: transformers' sdpa on cuDNN, no mask (causal alone hides the right padding)")
    return case


def window_pairs(length: int, window: int) -> int:
    """(query, key) pairs of a causal window of `window` keys (the query's own included) over `length` tokens."""
    full = max(0, length - window) * window
    return full + min(length, window) * (min(length, window) + 1) // 2


def _window_case(length: int, device, dtype, shrink: int) -> Case:
    from flashmoe_science import flash_attention_science

    length, window = length // shrink, WINDOW // shrink
    heads = HEADS if length <= 32768 else 4
    make = lambda: tuple(_randn(1, heads, length, HEAD_DIM, device=device, dtype=dtype) for _ in range(3))  # noqa: E731
    inside = 4.0 * heads * HEAD_DIM * window_pairs(length, window)
    dense = dense_flops(1, heads, length, length, HEAD_DIM, True)
    case = Case("window", f"L={length} H={heads} window {window}")
    case.contenders["flashmoe-window"] = Contender(
        make, lambda q, k, v: flash_attention_science(q, k, v, causal=True, window=(window - 1, 0)), inside)
    case.contenders["flashmoe-dense"] = Contender(
        make, lambda q, k, v: flash_attention_science(q, k, v, causal=True), dense, "causal, no window")
    case.contenders["flashmoe-triton-dense"] = Contender(
        make, lambda q, k, v: flash_attention_science(q, k, v, causal=True, backend="triton"), dense,
        "causal, no window")
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        from flashmoe_science.bench.attention import _compiled_flex

        def sliding(batch, head, q_index, kv_index):
            return (q_index >= kv_index) & (q_index - kv_index < window)

        # _compile: the eager path materialises the whole (L, L) mask first (128 GiB at L=128k)
        block_mask = create_block_mask(sliding, B=None, H=None, Q_LEN=length, KV_LEN=length, device=device,
                                       _compile=True)
        flex = _compiled_flex()
        case.contenders["flex-window"] = Contender(make, lambda q, k, v: flex(q, k, v, block_mask=block_mask), inside)
    return case


def _mods_case(device, dtype, shrink: int) -> Case:
    from flashmoe_science import flash_attention_science

    batch, length = 4, 4096 // shrink
    make = lambda: tuple(_randn(batch, HEADS, length, HEAD_DIM, device=device, dtype=dtype) for _ in range(3))  # noqa: E731
    flops = dense_flops(batch, HEADS, length, length, HEAD_DIM, True)
    slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, device=device) / HEADS).float()
    bias = _randn(1, HEADS, length, length, device=device, dtype=dtype)
    case = Case("mods", f"B={batch} H={HEADS} L={length}, causal")
    for name, kwargs in (("flashmoe", {}), ("flashmoe-triton", dict(backend="triton")),
                         ("flashmoe-softcap", dict(softcap=30.0)), ("flashmoe-alibi", dict(alibi_slopes=slopes)),
                         ("flashmoe-bias", dict(attn_bias=bias))):
        case.contenders[name] = Contender(
            make, lambda q, k, v, kwargs=kwargs: flash_attention_science(q, k, v, causal=True, **kwargs), flops)
    return case


def _packed_case(head_dim: int, length: int, causal: bool, device, dtype, shrink: int) -> Case:
    """PACKED_TOKENS tokens in sequences of `length`, through our packed and dense calls and the peers' packed ones;
    on a GPU each also as a graph replay."""
    from flashmoe_science import flash_attention_science, flash_attention_varlen

    heads, length = PACKED_HIDDEN // head_dim, max(1, length // shrink)
    batch = max(1, PACKED_TOKENS // shrink // length)
    cu = equal_cu_seqlens(batch, length, device)
    flops = dense_flops(batch, heads, length, length, head_dim, causal)
    packed = lambda: tuple(_randn(batch * length, heads, head_dim, device=device, dtype=dtype)  # noqa: E731
                           for _ in range(3))
    case = Case("packed", f"D={head_dim} {batch} x {length}" + (", causal" if causal else ""))
    contenders = {
        "flashmoe-varlen": Contender(packed, lambda q, k, v: flash_attention_varlen(
            q, k, v, cu, cu, length, length, causal=causal), flops),
        "flashmoe-dense": Contender(
            lambda: tuple(_randn(batch, heads, length, head_dim, device=device, dtype=dtype) for _ in range(3)),
            lambda q, k, v: flash_attention_science(q, k, v, causal=causal), flops),
    }
    fa3_missing, fa4_missing = fa3_skip_reason(head_dim), fa4_skip_reason(head_dim)
    if fa3_missing is None:
        contenders["fa3-varlen"] = Contender(packed, fa3_varlen(cu, cu, length, length, causal), flops,
                                             forward_only=True)
    else:
        case.skipped["fa3-varlen"] = fa3_missing
    if fa4_missing is None:
        contenders["fa4-varlen"] = Contender(packed, _fa4_varlen(cu, length, causal), flops)
    else:
        case.skipped["fa4-varlen"] = fa4_missing
    for name, contender in contenders.items():
        case.contenders[name] = contender
        if device.type == "cuda":
            case.contenders[name + GRAPH_SUFFIX] = dataclasses.replace(contender, graphed=True,
                                                                       note="CUDA-graph replay")
    return case


def _mask_mod_cases(device, dtype, shrink: int) -> list[Case]:
    from flashmoe_science import flash_attention_science
    from flashmoe_science.bench import mask_mods as mm

    length = mm.LENGTH // shrink
    make = lambda: tuple(_randn(mm.BATCH, mm.HEADS, length, mm.HEAD_DIM, device=device, dtype=dtype)  # noqa: E731
                         for _ in range(3))
    fa4_missing = fa4_skip_reason(mm.HEAD_DIM)
    if fa4_missing is None and device.type != "cuda":
        fa4_missing = "FlashAttention-4 runs on a GPU only"
    if fa4_missing is None:  # imports cutlass and flash_attn: only where FA4 runs
        from flashmoe_science.bench import mask_mods_fa4
    cases = []
    for name, ours, flex_mask, pairs in mm.mask_cases(length, device):
        case = Case("mask-mods", name, fields=dict(B=mm.BATCH, H=mm.HEADS, L=length, D=mm.HEAD_DIM))
        flops = 4.0 * mm.HEAD_DIM * pairs
        case.contenders["flashmoe"] = Contender(
            make, lambda q, k, v, ours=ours: flash_attention_science(q, k, v, mask_mod=ours), flops)
        _architecture_forward(case, make, ours, flops)
        if name in mm.BUILTIN_KEYWORDS:
            case.contenders["flashmoe-builtin"] = Contender(
                make, lambda q, k, v, kw=mm.BUILTIN_KEYWORDS[name]: flash_attention_science(q, k, v, **kw), flops,
                note="the built-in keyword")
        if device.type == "cuda":
            from torch.nn.attention.flex_attention import create_block_mask

            from flashmoe_science.bench.attention import _compiled_flex

            block_mask = create_block_mask(flex_mask, B=mm.BATCH, H=mm.HEADS, Q_LEN=length, KV_LEN=length,
                                           device=device, _compile=True)
            flex = _compiled_flex()
            case.contenders["flex"] = Contender(
                make, lambda q, k, v, block_mask=block_mask: flex(q, k, v, block_mask=block_mask), flops)
        else:
            case.skipped["flex"] = "compiled FlexAttention is timed on a GPU only"
        if fa4_missing is not None:
            case.skipped["fa4"] = fa4_missing
        elif name not in mask_mods_fa4.TWINS:
            case.skipped["fa4"] = f"no CuTe DSL twin of {name!r} in bench/mask_mods_fa4.py"
        else:
            attend, note = mask_mods_fa4.fa4_attend(name, ours, flex_mask, length, device)
            case.contenders["fa4"] = Contender(make, attend, flops, note=note)
        cases.append(case)
    return cases


def _architecture_forward(case: Case, make, mask_mod, flops: float) -> None:
    """`flashmoe-arch`: the mod forward of the first architecture family (`architectures.families`) that plans it
    here when asked for by name, beside auto's choice (`flashmoe`); its backward too where the family plans that
    (else forward only). Skipped with each family's refusal where none does."""
    from flashmoe_science import architectures, flash_attention_science
    from flashmoe_science.attention.plan import plan_attention
    from flashmoe_science.attention.problem import dense_problem

    q = make()[0]
    refusals = []
    for family in architectures.families("attention"):
        try:
            plan = plan_attention(dense_problem(q, q, q, mask_mod=mask_mod, backend=family.name)[0])
        except (ValueError, TypeError) as refusal:  # how a family asked for by name refuses (NoBackend among them)
            refusals.append(str(refusal))
            continue
        try:
            forward_only = plan.backward_choice.backend != family.name
        except ValueError:  # the family asked for by name refuses this mod's backward
            forward_only = True
        case.contenders["flashmoe-arch"] = Contender(
            make, lambda q, k, v, name=family.name: flash_attention_science(q, k, v, mask_mod=mask_mod, backend=name),
            flops, note=f"backend={family.name!r}" + (", forward only" if forward_only else ""),
            forward_only=forward_only)
        return
    case.skipped["flashmoe-arch"] = "; ".join(refusals) or "no architecture family in this build"


def feature_cases(suites, quick: bool, device, dtype) -> list[Case]:
    shrink = 1 if device.type == "cuda" else CPU_SHRINK
    cases = []
    if "varlen" in suites:
        distributions = list(VARLEN_DISTRIBUTIONS)[:1 if quick else None]
        cases += [_varlen_case(name, causal, device, dtype, shrink) for name in distributions
                  for causal in (False, True)]
        if importlib.util.find_spec("transformers") is not None:
            cases.append(_padded_hf_case(device, dtype, shrink))
        else:  # the packed batches need no transformers: they run, and the padded batch says why it did not
            cases.append(Case("varlen", "HF padded", skipped={
                "the padded Hugging Face batch": 'transformers is not installed (pip install "flashmoe-science[hf]")'}))
    if "window" in suites:
        cases += [_window_case(length, device, dtype, shrink) for length in WINDOW_LENGTHS[:1 if quick else None]]
    if "mods" in suites:
        cases.append(_mods_case(device, dtype, shrink))
    if "packed" in suites:
        lengths = (1024, 4096) if quick else PACKED_LENGTHS
        cases += [_packed_case(head_dim, length, causal, device, dtype, shrink) for head_dim in PACKED_HEAD_DIMS
                  for length in lengths for causal in (False, True)]
    if "mask-mods" in suites:
        cases += _mask_mod_cases(device, dtype, shrink)
    return cases


def run_features_bench(suites, quick: bool, device, dtype, timer, progress=None, on_case_done=None,
                       rounds: int = 1) -> list[dict]:
    """Time every contender of every case, forward and backward; a contender that raises is skipped (warned), and
    so, once per reason, is one a case left out."""
    measured: dict[tuple, list[dict]] = {}
    cases = feature_cases(suites, quick, device, dtype)  # inputs are made per measurement (make_inputs)
    for name, reason in dict.fromkeys((n, r) for case in cases for n, r in case.skipped.items()):
        warnings.warn(f"features bench: {name} not run: {reason}")
    if progress is not None:
        progress.set_total(rounds * sum(len(c.passes) for case in cases for c in case.contenders.values()))
    for _ in range(rounds):
        for case in cases:
            for name, contender in case.contenders.items():
                for pass_ in contender.passes:
                    step = f"{case.suite} {case.name} {pass_} {name}"
                    try:
                        ms = _time(contender, pass_, timer, device)
                    except Exception as error:  # a backend that cannot run this case gets no record
                        warnings.warn(f"features bench: {step} skipped: {type(error).__name__}: {error}")
                        ms = None
                    if ms is not None:
                        flops = contender.flops_fwd * (2.5 if pass_ == "bwd" else 1.0)
                        measured.setdefault((case.suite, case.name, pass_, name), []).append({
                            "op": SUITE_OPS.get(case.suite, "attention-features"), "suite": case.suite,
                            "case": case.name, **case.fields, "pass": pass_,
                            "backend": name, "dtype": str(dtype).removeprefix("torch."), "flops": flops,
                            "ms": round_significant(ms), "tflops": round_significant(tflops(flops, ms)),
                            "note": contender.note,
                        })
                    if progress is not None:
                        progress.update(desc=step)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if on_case_done is not None:
                on_case_done(_median_records(measured))
    return _median_records(measured)


def _time(contender: Contender, pass_: str, timer, device) -> float:
    q, k, v = contender.make_inputs()
    if contender.graphed:
        with torch.no_grad():
            return timer(graph_replay(lambda: contender.attend(q, k, v)))
    if pass_ == "fwd":
        return _measure_forward(contender.attend, q, k, v, timer, device)[0]
    with torch.no_grad():
        dout = torch.randn_like(contender.attend(q, k, v))
    return _measure_backward(contender.attend, q, k, v, dout, timer, device)[0]


def _median_records(measured: dict[tuple, list[dict]]) -> list[dict]:
    def scale_rates(record, ms):
        record["tflops"] = round_significant(tflops(record["flops"], ms))

    return [median_over_rounds(per_round, scale_rates) for per_round in measured.values()]


# The ratios each suite's table shows (numerator, denominator): ours against the peers measured beside it
# (FlashAttention-4's and vLLM's FlashAttention-3's varlen) and the call it replaces.
RATIOS = {
    "varlen": (("flashmoe-varlen", "fa4-varlen"), ("flashmoe-varlen", "fa3-varlen"),
               ("flashmoe-varlen", "flashmoe-dense"),
               ("flashmoe-varlen", "sdpa-nested"), ("flashmoe-varlen", "sdpa-cudnn-padded"),
               ("flashmoe-hf", "sdpa-padded"), ("flashmoe-hf", "sdpa-cudnn-padded")),
    "window": (("flashmoe-window", "flashmoe-dense"), ("flashmoe-window", "flashmoe-triton-dense"),
               ("flashmoe-window", "flex-window")),
    "packed": (("flashmoe-varlen", "fa3-varlen"), ("flashmoe-varlen", "fa4-varlen"),
               ("flashmoe-varlen", "flashmoe-dense"), ("flashmoe-varlen-graph", "fa3-varlen-graph"),
               ("flashmoe-varlen-graph", "flashmoe-dense-graph"), ("flashmoe-varlen-graph", "flashmoe-varlen")),
    "mask-mods": (("flashmoe", "flex"), ("flashmoe-arch", "flex"), ("flashmoe", "fa4"), ("flashmoe-arch", "fa4"),
                  ("flashmoe-arch", "flashmoe"), ("flashmoe", "flashmoe-builtin"),
                  ("flashmoe-arch", "flashmoe-builtin")),
    "mods": (("flashmoe-softcap", "flashmoe"), ("flashmoe-alibi", "flashmoe"), ("flashmoe-bias", "flashmoe"),
             ("flashmoe-softcap", "flashmoe-triton"), ("flashmoe-alibi", "flashmoe-triton")),
}


def measured_ratios(suite: str, records: list[dict]) -> list[tuple[str, str]]:
    """The suite's RATIOS whose two backends both have records (a run without a backend gets no column of n/a)."""
    backends = {r["backend"] for r in records}
    return [(a, b) for a, b in RATIOS[suite] if a in backends and b in backends]


def _ratio_column(numerator: str, denominator: str):
    def compute(values: dict) -> str:
        a, b = values.get(numerator), values.get(denominator)
        return format_number(a / b, 2) if a and b else "n/a"

    return compute


def features_tables(records: list[dict]) -> str:
    """One table per suite: TFLOP/s per backend, then the ratios of RATIOS (x = ours / theirs, TFLOP/s)."""
    parts = []
    for suite in SUITES:
        rows = [r for r in records if r["suite"] == suite]
        if not rows:
            continue
        extra = {f"{a.removeprefix('flashmoe-')}/{b.removeprefix('flashmoe-')}": _ratio_column(a, b)
                 for a, b in measured_ratios(suite, rows)}
        parts.append(f"{suite}: TFLOP/s over the pairs attended\n"
                     + records_table(rows, row_fields=("case", "pass"), extra_columns=extra))
    notes = {(r["backend"], r["note"]) for r in records if r["note"]}
    if notes:
        parts.append("notes: " + "; ".join(f"{b}: {n}" for b, n in sorted(notes)))
    return "\n\n".join(parts)


def plot_features(records: list[dict], path, title: str):
    """One panel per suite and pass: TFLOP/s of each backend over the suite's cases (numbered in run order)."""
    panels: dict[str, dict[str, list]] = {}
    for suite in SUITES:
        cases = list(dict.fromkeys(r["case"] for r in records if r["suite"] == suite))
        for record in (r for r in records if r["suite"] == suite):
            series = panels.setdefault(f"{suite} {record['pass']}", {})
            series.setdefault(record["backend"], []).append((cases.index(record["case"]) + 1, record["tflops"]))
    return plot_panels(path, panels, xlabel="case", ylabel="TFLOP/s", suptitle=title, log2_x=False)
