"""Attention benchmark: ours against every SDPA backend and compiled FlexAttention, side by side in one process.

Each measurement times one forward (or one backward) of one backend on one shape and becomes a record:
    {"op": "attention", "pass", "B", "H", "Hkv", "Lq", "Lk", "D", "causal", "dtype", "backend",
     "ms", "tflops", "peak_mem_mib"}            (+ "kernel" for our backends: what `describe_dispatch` reports)

How things are measured, and why:
- GPU: median of `triton.testing.do_bench` (it flushes L2 between calls). CPU: median of `time.perf_counter`.
- Forward is timed under `torch.no_grad()` (inference: no autograd bookkeeping in any backend).
  Backward is timed alone: one forward with grads on q, k, v, then `out.backward(dout, retain_graph=True)` repeated.
- SDPA backends are forced with `sdpa_kernel`, entered once around a whole measurement, not inside the timed call.
- FlexAttention is `torch.compile(flex_attention)`; its causal block mask is built once per shape, outside timing.
- `flashmoe` is `flash_attention_science(..., backend="auto")`, `flashmoe-triton` the same with backend="triton".
  Both are always timed: when they dispatch to the same kernel (their "kernel" fields agree), the difference
  between the two rows is the run's measurement noise.
- Peers, each measured only where it imports (else skipped with the reason): `fa4` (FlashAttention-4,
  `flash_attn.cute`) and `fa3` (vLLM's FlashAttention-3 build, `vllm.vllm_flash_attn`, forward only: B sequences of
  equal length through its varlen entry, on token-major copies of our tensors made outside timing). Importing vLLM
  applies its `vllm.env_override` to the whole process (TORCHINDUCTOR_COMPILE_THREADS=1, patches to inductor).
- A backend that raises on a shape (unsupported head dim, out of memory, not differentiable yet) gets no record
  there; the table shows "n/a" and the run goes on. sdpa-math is skipped up front where its materialised scores
  would not fit comfortably.
- TFLOP/s as FlashAttention counts them: forward 4·B·H·Lq·Lk·D, halved when causal; backward 2.5 × forward.
- All shapes are MHA (Hkv = H) with Lq = Lk unless given otherwise, so SDPA's top-left causal mask and our
  bottom-right one coincide.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import torch
import torch.nn.functional as F

from flashmoe_science.device import current_traits
from flashmoe_science.bench.report import (
    Progress,
    fa3_import_error,
    format_number,
    format_table,
    geomean,
    gpu_median_ms,
    median_over_rounds,
    ordered_columns,
    pivot,
    plot_panels,
    ratio,
    records_table,
    round_significant,
    short_error,
    tflops,
)

OURS = "flashmoe"
BACKEND_ORDER = ("flashmoe", "flashmoe-fp8", "flashmoe-triton", "fa4", "fa3", "sdpa-cudnn", "sdpa-flash",
                 "sdpa-efficient", "sdpa-math", "flex")
CPU_BACKENDS = ("flashmoe", "sdpa-math")
GPU_BASELINES = ("fa4", "fa3", "sdpa-cudnn", "sdpa-flash")  # what our ratio columns compare against
CPU_BASELINES = ("sdpa-math",)
PASSES = ("fwd", "bwd")
BWD_FLOPS_PER_FWD = 2.5  # FlashAttention's convention: backward does 2.5x the forward's matmul work

# The FlashAttention-3 paper's grid: a fixed token count and hidden size, so sequence length trades against batch.
FA3_TOKENS = 16384  # B * L
FA3_HIDDEN = 2048  # H * D
FA3_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
FA3_HEAD_DIMS = (64, 128, 256)
BASE_SEQLENS = (2048, 4096, 8192)  # the B=4, H=8, D=64 shapes the README's headline numbers use

# sdpa-math materialises fp32 scores (and their softmax and gradient): skip shapes where that would pass ~20 GiB.
MATH_MEMORY_LIMIT_BYTES = 20 * 2**30

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# --------------------------------------------------------------------------------------------------------------------
# Shapes and FLOPs
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionShape:
    B: int
    H: int
    Lq: int
    Lk: int
    D: int
    causal: bool
    Hkv: int = field(default=0)  # 0 = same as H (MHA)

    def __post_init__(self):
        if self.Hkv == 0:
            object.__setattr__(self, "Hkv", self.H)

    @property
    def on_fa3_grid(self) -> bool:
        return self.Lq == self.Lk and self.B * self.Lq == FA3_TOKENS and self.H * self.D == FA3_HIDDEN

    def label(self) -> str:
        length = f"L={self.Lq}" if self.Lq == self.Lk else f"Lq={self.Lq} Lk={self.Lk}"
        return f"B={self.B} H={self.H} {length} D={self.D}{' causal' if self.causal else ''}"


def attention_flops(shape: AttentionShape, pass_: str) -> float:
    """FLOPs as FlashAttention counts them: two matmuls of 2·D per visible (query, key) pair, per head.

    Causal with Lq == Lk counts half the pairs (the FlashAttention convention, L²/2); with Lq != Lk the visible
    pairs of the bottom-right mask are counted exactly (query i sees min(Lk, max(0, i + Lk - Lq + 1)) keys).
    """
    lq, lk = shape.Lq, shape.Lk
    if not shape.causal:
        pairs = lq * lk
    elif lq == lk:
        pairs = lq * lk / 2
    else:
        pairs = sum(min(lk, max(0, i + lk - lq + 1)) for i in range(lq))
    forward = 4.0 * shape.B * shape.H * pairs * shape.D
    return forward if pass_ == "fwd" else BWD_FLOPS_PER_FWD * forward


def _both_causal(B: int, H: int, Lq: int, Lk: int, D: int) -> list[AttentionShape]:
    return [AttentionShape(B, H, Lq, Lk, D, causal) for causal in (False, True)]


def fa3_grid_shapes(
    seqlens: Sequence[int] = FA3_SEQLENS, head_dims: Sequence[int] = FA3_HEAD_DIMS
) -> list[AttentionShape]:
    return [
        shape
        for D in head_dims
        for L in seqlens
        for shape in _both_causal(FA3_TOKENS // L, FA3_HIDDEN // D, L, L, D)
    ]


def base_shapes(seqlens: Sequence[int] = BASE_SEQLENS) -> list[AttentionShape]:
    return [shape for L in seqlens for shape in _both_causal(4, 8, L, L, 64)]


def gpu_shapes(quick: bool) -> list[AttentionShape]:
    if quick:  # a subset that runs in well under 2 minutes on an H200
        return fa3_grid_shapes(seqlens=(1024, 4096), head_dims=(64, 128)) + base_shapes(seqlens=(2048,))
    return fa3_grid_shapes() + base_shapes()


def cpu_shapes() -> list[AttentionShape]:
    return [shape for L in (128, 256) for shape in _both_causal(1, 2, L, L, 64)]


def parse_shape(text: str) -> list[AttentionShape]:
    """"BxHxLxD" or "BxHxLqxLkxD" (e.g. "4x8x2048x64") -> that shape, non-causal and causal."""
    try:
        sizes = [int(part) for part in text.lower().split("x")]
    except ValueError:
        sizes = []
    if len(sizes) == 4:
        B, H, L, D = sizes
        Lq = Lk = L
    elif len(sizes) == 5:
        B, H, Lq, Lk, D = sizes
    else:
        raise ValueError(f"shape {text!r}: expected BxHxLxD or BxHxLqxLkxD, e.g. 4x8x2048x64")
    if min(sizes) <= 0:
        raise ValueError(f"shape {text!r}: sizes must be positive")
    return _both_causal(B, H, Lq, Lk, D)


# --------------------------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------------------------
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Backend:
    """One contender. `prepare(shape, device)` does per-shape setup outside timing and returns `attend(q, k, v)`;
    `context()` is entered around a whole measurement; `skip_reason(shape)` says why not to try a shape (or None);
    `no_backward`, for a forward-only backend, says why its backward is not measured."""

    name: str
    prepare: Callable[[AttentionShape, torch.device], Attend]
    context: Callable[[], ContextManager] = contextlib.nullcontext
    skip_reason: Callable[[AttentionShape], str | None] = lambda shape: None
    no_backward: str | None = None


def _ours(kernel_backend: str) -> Callable[[AttentionShape, torch.device], Attend]:
    def prepare(shape: AttentionShape, device: torch.device) -> Attend:
        from flashmoe_science.attention.api import flash_attention_science

        return lambda q, k, v: flash_attention_science(q, k, v, causal=shape.causal, backend=kernel_backend)

    return prepare


def _once_per_inputs(convert: Callable):
    """`convert(q, k, v)`, made on the first call with these tensors and reused while the same ones come back (the
    timer calls `attend` with the same q, k, v): a conversion kept outside the timed calls."""
    converted: dict[tuple, object] = {}

    def lookup(q, k, v):
        key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in (q, k, v))
        if key not in converted:
            converted.clear()
            converted[key] = convert(q, k, v)
        return converted[key]

    return lookup


def _prepare_fp8(shape: AttentionShape, device: torch.device) -> Attend:
    """Our e4m3 forward (Hadamard-rotated Q and K): the bf16 inputs are quantised once, on the first call, outside
    the timed calls that follow."""
    from flashmoe_science.attention.api import flash_attention_science
    from flashmoe_science.attention.fp8 import quantize_fp8

    quantised = _once_per_inputs(lambda q, k, v: quantize_fp8(q, k, v, hadamard=True))

    def attend(q, k, v):
        inputs = quantised(q, k, v)
        return flash_attention_science(inputs.q, inputs.k, inputs.v, causal=shape.causal,
                                       q_descale=inputs.q_descale, k_descale=inputs.k_descale,
                                       v_descale=inputs.v_descale)

    return attend


def _fp8_skip_reason(shape: AttentionShape) -> str | None:
    return None if shape.D in (64, 128, 256) else f"the e4m3 kernel takes D 64/128/256, not {shape.D}"


def _prepare_sdpa(shape: AttentionShape, device: torch.device) -> Attend:
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)


PEER_HEAD_DIMS = range(8, 257)  # FA4's sm_90 kernels and vLLM's FA3 build: head dims 8..256, multiples of 8
FA4_MAJORS = (9, 10)  # the compute-capability majors FA4's forward and backward are built for (Hopper, Blackwell)
VLLM_FA3_MAJORS = (9,)  # vLLM's FlashAttention-3 build: Hopper only
VLLM_FA3_FORWARD_ONLY = "vLLM's FlashAttention-3 build is forward-only (no backward)"


def _peer_skip_reason(peer: str, majors: tuple[int, ...], head_dim: int) -> str | None:
    """Why an importable peer cannot run here: a CUDA GPU outside `majors`, or a head dim its kernels do not take."""
    traits = current_traits()
    if traits is not None and not traits.in_families(majors):
        return f"{peer} is built for compute capability {' and '.join(f'{m}.x' for m in majors)}, not {traits.arch}"
    if head_dim not in PEER_HEAD_DIMS or head_dim % 8:
        return f"{peer} takes head dims 8..256 in multiples of 8, not {head_dim}"
    return None


def fa4_skip_reason(head_dim: int) -> str | None:
    """Why FlashAttention-4 (`flash_attn.cute`, the CuTe DSL kernels) cannot be measured here, or None. It is a peer,
    never a dependency: without it, on a CUDA GPU other than sm_90/sm_100, or at a head dim its kernels do not take,
    its contenders (the dense `fa4` backend, the varlen suite's `fa4-varlen`) have no record."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as error:  # not installed, or its CUDA libraries do not load (OSError, RuntimeError)
        return f"flash_attn.cute (FlashAttention-4) does not import: {short_error(error)}"
    return _peer_skip_reason("FlashAttention-4", FA4_MAJORS, head_dim)


def fa3_skip_reason(head_dim: int) -> str | None:
    """Why vLLM's FlashAttention-3 cannot be measured here, or None: like `fa4_skip_reason`, a peer only where it
    imports, on sm_90, at head dims 8..256 in multiples of 8. Its contenders: the dense `fa3` backend, the varlen
    suite's `fa3-varlen`, the decode suite's `fa3-paged64` and `fa3-chunk-paged64`."""
    return fa3_import_error() or _peer_skip_reason("vLLM's FlashAttention-3", VLLM_FA3_MAJORS, head_dim)


def fa4_output(result) -> torch.Tensor:
    """The attention output of a `flash_attn.cute` call: its functions return (out, lse)."""
    return result[0] if isinstance(result, tuple) else result


def _prepare_fa4(shape: AttentionShape, device: torch.device) -> Attend:
    """FlashAttention-4's `flash_attn_func` on our (B, H, L, D) tensors, viewed as its (B, L, H, D) layout (no copy:
    the head dim stays contiguous); its output viewed back. Its first call per shape JIT-compiles, outside timing
    like every backend's warm-up."""
    from flash_attn.cute import flash_attn_func

    def attend(q, k, v):
        out = fa4_output(flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=shape.causal))
        return out.transpose(1, 2)

    return attend


def equal_cu_seqlens(batch: int, length: int, device) -> torch.Tensor:
    """int32 cumulative lengths of `batch` sequences of `length` tokens: [0, L, 2L, ..., B·L]."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


def fa3_varlen(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
               causal: bool) -> Attend:
    """vLLM's FlashAttention-3 varlen forward (`flash_attn_varlen_func(..., fa_version=3)`) on packed token-major
    (total, H, D) q and (total, Hkv, D) k, v with int32 cumulative lengths; returns its (total, H, D) output. Causal
    is bottom-right aligned per sequence, as ours; the scale is ours, D^-0.5."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def attend(q, k, v):
        return flash_attn_varlen_func(q, k, v, max_seqlen_q=max_seqlen_q, cu_seqlens_q=cu_seqlens_q,
                                      max_seqlen_k=max_seqlen_k, cu_seqlens_k=cu_seqlens_k, causal=causal,
                                      softmax_scale=q.shape[-1] ** -0.5, fa_version=3)

    return attend


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> a (B·L, H, D) copy: the token-major packing varlen kernels take (B and L do not merge in a
    view of our layout)."""
    batch, heads, length, dim = t.shape
    return t.transpose(1, 2).reshape(batch * length, heads, dim)


def _prepare_fa3(shape: AttentionShape, device: torch.device) -> Attend:
    """vLLM's FlashAttention-3 on our (B, H, L, D) tensors as B sequences of equal length through its varlen entry
    (its only one): the token-major copies are made once, on the first call, outside the timed calls that follow; its
    output is viewed back as (B, H, Lq, D) (no copy)."""
    varlen = fa3_varlen(equal_cu_seqlens(shape.B, shape.Lq, device), equal_cu_seqlens(shape.B, shape.Lk, device),
                        shape.Lq, shape.Lk, shape.causal)
    packed = _once_per_inputs(lambda q, k, v: tuple(_token_major(t) for t in (q, k, v)))

    def attend(q, k, v):
        out = varlen(*packed(q, k, v))
        return out.view(shape.B, shape.Lq, shape.H, shape.D).transpose(1, 2)

    return attend


def _sdpa_context(kernel: str) -> Callable[[], ContextManager]:
    def context() -> ContextManager:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, kernel))

    return context


def _math_skip_reason(shape: AttentionShape) -> str | None:
    # fp32 scores, probabilities and (for backward) their gradient, each B·H·Lq·Lk
    needed = shape.B * shape.H * shape.Lq * shape.Lk * 4 * 3
    if needed > MATH_MEMORY_LIMIT_BYTES:
        return f"needs ~{needed / 2**30:.0f} GiB for materialised scores"
    return None


_compiled_flex_attention = None


def _compiled_flex() -> Callable:
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        # every shape (and causal/non-causal, forward/backward) is a separate static-shape compilation; the default
        # limit of 8 would silently fall back to eager flex_attention partway through the grid
        limit_name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo_config, limit_name, max(getattr(dynamo_config, limit_name), 1024))
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4096))
                break
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


def _prepare_flex(shape: AttentionShape, device: torch.device) -> Attend:
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _compiled_flex()
    block_mask = None
    if shape.causal:
        offset = shape.Lk - shape.Lq  # bottom-right aligned, like ours; 0 for the square shapes benchmarked

        def causal_mask(batch, head, q_index, kv_index):
            return q_index + offset >= kv_index

        block_mask = create_block_mask(causal_mask, B=None, H=None, Q_LEN=shape.Lq, KV_LEN=shape.Lk, device=device)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


BACKENDS: dict[str, Backend] = {
    "flashmoe": Backend("flashmoe", _ours("auto")),
    "flashmoe-triton": Backend("flashmoe-triton", _ours("triton")),
    "flashmoe-fp8": Backend("flashmoe-fp8", _prepare_fp8, skip_reason=_fp8_skip_reason),
    "fa4": Backend("fa4", _prepare_fa4, skip_reason=lambda shape: fa4_skip_reason(shape.D)),
    "fa3": Backend("fa3", _prepare_fa3, skip_reason=lambda shape: fa3_skip_reason(shape.D),
                   no_backward=VLLM_FA3_FORWARD_ONLY),
    "sdpa-cudnn": Backend("sdpa-cudnn", _prepare_sdpa, _sdpa_context("CUDNN_ATTENTION")),
    "sdpa-flash": Backend("sdpa-flash", _prepare_sdpa, _sdpa_context("FLASH_ATTENTION")),
    "sdpa-efficient": Backend("sdpa-efficient", _prepare_sdpa, _sdpa_context("EFFICIENT_ATTENTION")),
    "sdpa-math": Backend("sdpa-math", _prepare_sdpa, _sdpa_context("MATH"), _math_skip_reason),
    "flex": Backend("flex", _prepare_flex),
}
FP8_BACKENDS = ("flashmoe-fp8",)  # forward only; their inputs are the bf16 run's, quantised once outside timing
FP8_RUN_BACKENDS = ("flashmoe-fp8", "flashmoe", "sdpa-cudnn")  # `bench --dtype fp8`: FP8 beside our bf16 and cuDNN
OUR_KERNEL_BACKENDS = {"flashmoe": "auto", "flashmoe-triton": "triton"}  # bench name -> `backend=` argument


def describe_our_kernel(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    """The kernel `describe_dispatch` says our backend `name` runs for these inputs (None if it cannot say)."""
    if name not in OUR_KERNEL_BACKENDS:
        return None
    try:
        from flashmoe_science.attention.api import describe_dispatch

        return describe_dispatch(q, k, v, causal=causal, backend=OUR_KERNEL_BACKENDS[name]).kernel
    except Exception:
        return None


# --------------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------------
Timer = Callable[..., float]  # timer(fn, grad_to_none=None) -> median milliseconds


def cuda_median_ms(fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> float:
    """``report.gpu_median_ms`` with its short window (do_bench's 25 ms warm-up, 100 ms timed)."""
    return gpu_median_ms(fn, grad_to_none)


def cpu_median_ms(
    fn: Callable[[], object],
    grad_to_none: list[torch.Tensor] | None = None,
    min_reps: int = 5,
    max_reps: int = 50,
    budget_s: float = 0.2,
) -> float:
    """Median wall time of `fn`, repeated until `budget_s` seconds or `max_reps` calls (at least `min_reps`)."""
    times = []
    started = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - started < budget_s):
        for tensor in grad_to_none or ():
            tensor.grad = None
        before = time.perf_counter()
        fn()
        times.append(time.perf_counter() - before)
    return 1e3 * statistics.median(times)


def peak_memory_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Extra peak memory of one call of `fn` on a CUDA device, in MiB (None on CPU: torch does not track it)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    allocated_before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    extra = torch.cuda.max_memory_allocated(device) - allocated_before
    del result
    return extra / 2**20


def _measure_forward(attend: Attend, q, k, v, timer: Timer, device) -> tuple[float, float | None]:
    call = lambda: attend(q, k, v)  # noqa: E731
    with torch.no_grad():
        call()  # compile / autotune, and surface "unsupported" before anything is timed
        memory = peak_memory_mib(call, device)
        return timer(call), memory


def _measure_backward(attend: Attend, q, k, v, dout, timer: Timer, device) -> tuple[float, float | None]:
    q, k, v = (tensor.detach().requires_grad_(True) for tensor in (q, k, v))
    out = attend(q, k, v)
    inputs = [q, k, v]

    def backward():
        out.backward(dout, retain_graph=True)

    def clear_grads():
        for tensor in inputs:
            tensor.grad = None

    backward()  # compile, and fail here if this backend has no backward
    clear_grads()
    memory = peak_memory_mib(backward, device)
    clear_grads()
    return timer(backward, grad_to_none=inputs), memory


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class SkipLog:
    """Why backends produced no record: {(backend, pass): [count, first reason]}, for a summary after the table."""

    entries: dict[tuple[str, str], list] = field(default_factory=dict)

    def note(self, backend: str, pass_: str, reason: str) -> None:
        entry = self.entries.setdefault((backend, pass_), [0, reason])
        entry[0] += 1

    def summary(self) -> str:
        if not self.entries:
            return ""
        lines = ["n/a entries (backend, pass: how many shapes, first reason):"]
        for (backend, pass_), (count, reason) in self.entries.items():
            lines.append(f"  {backend} {pass_}: {count} shape(s), {reason}")
        return "\n".join(lines)


def run_attention_bench(
    shapes: Sequence[AttentionShape],
    backend_names: Sequence[str],
    passes: Sequence[str],
    device: torch.device,
    dtype: torch.dtype,
    timer: Timer,
    progress: Progress,
    skips: SkipLog | None = None,
    backends: dict[str, Backend] = BACKENDS,
    on_shape_done: Callable[[list[dict]], None] | None = None,
    rounds: int = 1,
) -> list[dict]:
    """Measure every (shape, backend, pass); return the records. Failures are noted in `skips`, never raised.
    `on_shape_done(records so far)` runs after each shape (the CLI saves partial results there).

    `rounds` > 1 repeats the whole sweep that many times and records the median of the rounds' times (each round's
    time in `ms_rounds`, their range in `ms_min`/`ms_max` and `spread`): one sweep's rows move by several percent
    between runs (clocks, host jitter), and repeating the sweep, rather than each case in place, spreads a slow stretch
    over every backend instead of charging it to one."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    skips = skips if skips is not None else SkipLog()
    progress.set_total(rounds * len(shapes) * len(backend_names) * len(passes))
    measured: dict[tuple, list[dict]] = {}  # (shape index, backend, pass) -> one record per round, in run order
    for round_ in range(rounds):
        for index, shape in enumerate(shapes):
            q = torch.randn(shape.B, shape.H, shape.Lq, shape.D, device=device, dtype=dtype)
            k = torch.randn(shape.B, shape.Hkv, shape.Lk, shape.D, device=device, dtype=dtype)
            v = torch.randn(shape.B, shape.Hkv, shape.Lk, shape.D, device=device, dtype=dtype)
            dout = torch.randn_like(q)
            for name in backend_names:
                backend = backends[name]
                reason = backend.skip_reason(shape)
                if reason is None:
                    kernel = describe_our_kernel(name, q, k, v, shape.causal)
                    tensors = (q, k, v, dout)
                    for record in _measure_backend(backend, shape, passes, tensors, timer, device, kernel,
                                                   skips if round_ == 0 else SkipLog(), progress):
                        measured.setdefault((index, name, record["pass"]), []).append(record)
                else:
                    if round_ == 0:
                        for pass_ in passes:
                            skips.note(name, pass_, reason)
                    progress.update(len(passes), desc=f"{shape.label()} {name} skipped")
            if on_shape_done is not None:
                on_shape_done(_median_records(measured))
    return _median_records(measured)


def _median_records(measured: dict[tuple, list[dict]]) -> list[dict]:
    """One record per (shape, backend, pass): the first round's, with the median time over the rounds so far."""
    def scale_rates(record, ms):
        record["tflops"] = round_significant(tflops(attention_flops(shape_of(record), record["pass"]), ms))

    return [median_over_rounds(per_round, scale_rates) for per_round in measured.values()]


def _measure_backend(backend, shape, passes, tensors, timer, device, kernel, skips, progress) -> list[dict]:
    q, k, v, dout = tensors
    records = []
    with warnings.catch_warnings():
        # SDPA warns at length about each kernel it cannot use; the table's n/a says it more briefly
        warnings.simplefilter("ignore")
        try:
            attend = backend.prepare(shape, device)
        except Exception as error:  # e.g. FlexAttention missing from this torch
            for pass_ in passes:
                skips.note(backend.name, pass_, short_error(error))
            progress.update(len(passes), desc=f"{shape.label()} {backend.name} unavailable")
            return records
        for pass_ in passes:
            if pass_ == "bwd" and backend.no_backward is not None:
                skips.note(backend.name, pass_, backend.no_backward)
                progress.update(desc=f"{shape.label()} {backend.name} {pass_} not measured")
                continue
            try:
                with backend.context():
                    if pass_ == "fwd":
                        ms, memory = _measure_forward(attend, q, k, v, timer, device)
                    else:
                        ms, memory = _measure_backward(attend, q, k, v, dout, timer, device)
            except Exception as error:  # unsupported shape, out of memory, no backward yet: n/a, keep going
                skips.note(backend.name, pass_, short_error(error))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            else:
                records.append(attention_record(shape, pass_, backend.name, ms, memory, kernel, q.dtype))
            progress.update(desc=f"{shape.label()} {backend.name} {pass_}")
    return records


def attention_record(shape, pass_, backend_name, ms, memory_mib, kernel, dtype) -> dict:
    record = {
        "op": "attention",
        "pass": pass_,
        "B": shape.B,
        "H": shape.H,
        "Hkv": shape.Hkv,
        "Lq": shape.Lq,
        "Lk": shape.Lk,
        "D": shape.D,
        "causal": shape.causal,
        "dtype": ("fp8-e4m3" if backend_name in FP8_BACKENDS
                  else DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))),
        "backend": backend_name,
        "ms": round_significant(ms),
        "tflops": round_significant(tflops(attention_flops(shape, pass_), ms)),
        "peak_mem_mib": None if memory_mib is None else round(memory_mib, 2),
    }
    if kernel is not None:
        record["kernel"] = kernel
    return record


def shape_of(record: dict) -> AttentionShape:
    fields = ("B", "H", "Lq", "Lk", "D", "causal", "Hkv")
    return AttentionShape(*(record[name] for name in fields))


# --------------------------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------------------------
def _baseline_label(baseline: str) -> str:
    return f"ours/{baseline.removeprefix('sdpa-')}"


def attention_table(records: Sequence[dict], baselines: Sequence[str], backend_names: Sequence[str] = ()) -> str:
    """One row per (pass, shape), one TFLOP/s column per backend (each of `backend_names`, and any other that has
    records), then our ratio against each baseline."""
    ratio_columns = {
        _baseline_label(baseline): (
            lambda values, baseline=baseline: format_number(ratio(values.get(OURS), values.get(baseline)), 2)
        )
        for baseline in baselines
    }
    table = records_table(
        sorted(records, key=lambda r: PASSES.index(r["pass"])),  # all forward rows, then all backward rows
        row_fields=("pass", "B", "H", "Lq", "Lk", "D", "causal"),
        columns=ordered_columns([*backend_names, *(r["backend"] for r in records)], BACKEND_ORDER),
        extra_columns=ratio_columns,
    )
    return "TFLOP/s (n/a: backend unsupported or skipped for that shape)\n" + table


def summary_records(records: Sequence[dict]) -> tuple[list[dict], str]:
    """The records the summary and the plot are drawn from: the FA3 grid when the run covered it, else all."""
    on_grid = [r for r in records if shape_of(r).on_fa3_grid]
    if on_grid:
        return on_grid, f"the FlashAttention-3 grid (B·L={FA3_TOKENS}, H·D={FA3_HIDDEN})"
    return list(records), "all shapes"


def geomean_ratios(records: Sequence[dict], baselines: Sequence[str]) -> dict[tuple[int, bool, str], dict]:
    """{(D, causal, pass): {"shapes": n, baseline: geometric mean over shapes of ours/baseline TFLOP/s}}."""
    by_shape = pivot(records, row_key=lambda r: (r["D"], r["causal"], r["pass"], shape_of(r)))
    groups: dict[tuple[int, bool, str], dict[str, list]] = {}
    for (D, causal, pass_, _shape), tflops_by_backend in by_shape.items():
        group = groups.setdefault((D, causal, pass_), {baseline: [] for baseline in baselines})
        for baseline in baselines:
            group[baseline].append(ratio(tflops_by_backend.get(OURS), tflops_by_backend.get(baseline)))
    return {
        key: {
            "shapes": len(next(iter(per_baseline.values()), [])),
            **{baseline: geomean(values) for baseline, values in per_baseline.items()},
        }
        for key, per_baseline in sorted(groups.items(), key=lambda item: (item[0][2] != "fwd", item[0][:2]))
    }


def geomean_table(records: Sequence[dict], baselines: Sequence[str]) -> str:
    chosen, description = summary_records(records)
    summary = geomean_ratios(chosen, baselines)
    headers = ["pass", "D", "causal", "shapes", *map(_baseline_label, baselines)]
    rows = [
        [pass_, str(D), "yes" if causal else "no", str(entry["shapes"])]
        + [format_number(entry[baseline], 2) for baseline in baselines]
        for (D, causal, pass_), entry in summary.items()
    ]
    return f"Geometric mean of our TFLOP/s ratios over {description}\n" + format_table(headers, rows)


def plot_attention(records: Sequence[dict], path, title: str):
    """TFLOP/s vs sequence length: one subplot per (pass, D, causal), one line per backend."""
    chosen, description = summary_records(records)
    panels: dict[str, dict[str, list]] = {}
    ordered = sorted(chosen, key=lambda r: (r["pass"] != "fwd", r["causal"], r["D"]))
    for record in ordered:
        panel = f"{record['pass']} D={record['D']} {'causal' if record['causal'] else 'non-causal'}"
        panels.setdefault(panel, {}).setdefault(record["backend"], []).append((record["Lq"], record["tflops"]))
    for panel, series in panels.items():
        panels[panel] = {name: series[name] for name in ordered_columns(series, BACKEND_ORDER)}
    return plot_panels(path, panels, xlabel="sequence length", ylabel="TFLOP/s", suptitle=f"{title} ({description})")
