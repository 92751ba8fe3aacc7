"""Compile a model's attention kernels before its job starts: ``flashmoe-science warmup`` and `warmup`.

Triton compiles a kernel variant the first time a process launches it (seconds per variant for the sm_90 kernels)
and keeps the binary in its disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``); a later process that
launches the same variant loads it from there. A variant is fixed by what the kernels specialise on: head dim,
dtype, mask (causal, window, soft-cap), dense or packed layout, forward or backward, and the tile plan, which
follows the lengths. So the variants a job needs are those of its attention calls: `WarmupCase` is one such call
(the shapes the job will use), `cases_for_config` lists a transformers config's (every layer type: full and
sliding-window layers; the full batch's dense calls, the padded or packed batch's varlen calls, generation's
one-token calls), and `warmup` runs each case once, forward and backward, in parallel processes (compilation is
host work: the processes share the GPU and fill one cache).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass

import torch

from flashmoe_science.errors import CommandError

LAYOUTS = ("dense", "varlen", "decode")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WarmupCase:
    """One attention call of a job, as the kernels see it: ``batch`` sequences of ``seq_len`` tokens (decode: that
    many cached keys and one new query per sequence), ``heads`` query and ``kv_heads`` key/value heads of
    ``head_dim``, the mask (``causal``, ``window`` (left, right), ``softcap``), the ``layout`` ("dense": the full
    batch, `flash_attention_science`; "varlen": a padded or packed batch, `flash_attention_varlen`; "decode": one
    new token against a cache of seq_len and seq_len + 1 keys, both layouts), and whether the backward runs."""

    head_dim: int
    heads: int
    kv_heads: int
    seq_len: int
    batch: int = 1
    dtype: str = "bf16"
    causal: bool = True
    window: tuple[int, int] | None = None
    softcap: float | None = None
    layout: str = "dense"
    backward: bool = True

    def __post_init__(self):
        for name in ("head_dim", "heads", "kv_heads", "seq_len", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    def describe(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window is not None:
            mask += f" window {self.window}"
        if self.softcap is not None:
            mask += f" softcap {self.softcap}"
        passes = "fwd+bwd" if self.backward and self.layout != "decode" else "fwd"
        return (f"{self.layout} {self.batch}x{self.seq_len} D={self.head_dim} {self.heads}/{self.kv_heads} heads "
                f"{self.dtype} {mask} {passes}")


def cases_for_config(config, *, seq_lens, batch: int = 1, dtype: str | None = None, layouts=("dense", "varlen"),
                     backward: bool = True) -> list[WarmupCase]:
    """The `WarmupCase` of every attention call a transformers decoder config makes at these lengths: one per layer
    type (full attention; sliding-window layers with the config's window), ``layouts`` and length. ``dtype``
    defaults to the config's (bf16 where it names none)."""
    from flashmoe_science.integrations.hf import attention_masks, check_config, head_dim_of

    check_config(config)
    if dtype is None:
        dtype = str(getattr(config, "dtype", None) or "bfloat16").removeprefix("torch.")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    base = dict(head_dim=head_dim_of(config), heads=heads, kv_heads=kv_heads, batch=batch, dtype=dtype,
                backward=backward)
    cases = []
    for mask in attention_masks(config):
        for layout in layouts:
            for seq_len in seq_lens:
                cases.append(WarmupCase(seq_len=seq_len, layout=layout, **base, **mask))
    return list(dict.fromkeys(cases))


def packed_lengths(seq_len: int, shortest: int = 128) -> list[int]:
    """The longest-sequence lengths that stand for packed batches of rows of ``seq_len`` tokens (documents of any
    length up to seq_len): ``seq_len`` and its halvings down to ``shortest``. The kernel variants of a packed call
    follow its longest sequence only through the plan's length rules, which switch at powers of two (the sm_90
    short-row tiles, persistent CTAs and backward choice: hopper/tiles.py), so one length in each power-of-two
    interval reaches every variant."""
    for name, value in (("seq_len", seq_len), ("shortest", shortest)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    lengths = [seq_len]
    while lengths[-1] // 2 >= shortest:
        lengths.append(lengths[-1] // 2)
    return lengths


def _inputs(case: WarmupCase, length_q: int, length_k: int, grad: bool):
    dtype, device = DTYPES[case.dtype], torch.device("cuda")

    def randn(heads, length):
        return torch.randn(case.batch, heads, length, case.head_dim, dtype=dtype, device=device, requires_grad=grad)

    return randn(case.heads, length_q), randn(case.kv_heads, length_k), randn(case.kv_heads, length_k)


def _packed(t: torch.Tensor) -> torch.Tensor:
    return t.detach().transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).requires_grad_(t.requires_grad)


def _cu_seqlens(batch: int, length: int) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device="cuda")


def _call(case: WarmupCase, length_q: int, length_k: int, varlen: bool, backward: bool) -> None:
    from flashmoe_science.attention.api import flash_attention_science
    from flashmoe_science.attention.varlen import flash_attention_varlen

    options = dict(causal=case.causal, window=case.window, softcap=case.softcap)
    q, k, v = _inputs(case, length_q, length_k, backward)
    if varlen:
        q, k, v = _packed(q), _packed(k), _packed(v)
        out = flash_attention_varlen(q, k, v, _cu_seqlens(case.batch, length_q), _cu_seqlens(case.batch, length_k),
                                     length_q, length_k, check_values=False, **options)
    else:
        out = flash_attention_science(q, k, v, **options)
    if backward:
        out.backward(torch.randn_like(out))


def run_case(case: WarmupCase) -> float:
    """Runs `case` once on the current CUDA device (compiling what it launches); returns the seconds it took."""
    start = time.perf_counter()
    if case.layout == "decode":
        with torch.no_grad():
            for length_k in (case.seq_len, case.seq_len + 1):  # both classes of a length's divisibility by 16
                for varlen in (False, True):
                    _call(case, 1, length_k, varlen, backward=False)
    else:
        _call(case, case.seq_len, case.seq_len, case.layout == "varlen", case.backward)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _run_case_dict(fields: dict) -> float:
    return run_case(WarmupCase(**fields))


def warmup(cases, processes: int | None = None, progress=None) -> list[tuple[WarmupCase, float]]:
    """Runs every case (a `WarmupCase` or a list of them) so that its kernels land in Triton's disk cache, in up to
    ``processes`` parallel processes (default: one per case, at most the CPU count; 1 runs them in this process).
    ``progress(case, seconds)`` is called as each finishes. Returns ``(case, seconds)`` pairs in the given order."""
    cases = [cases] if isinstance(cases, WarmupCase) else list(cases)
    if not all(isinstance(case, WarmupCase) for case in cases):
        raise TypeError("cases must be WarmupCase objects (see cases_for_config)")
    if not torch.cuda.is_available():
        raise ValueError("warmup compiles the GPU kernels: it needs a CUDA device")
    if processes is None:
        processes = min(len(cases), os.cpu_count() or 1)
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    seconds = {}
    if processes == 1:
        for case in cases:
            seconds[case] = run_case(case)
            if progress is not None:
                progress(case, seconds[case])
    else:  # spawned: a forked child would inherit this process's CUDA context, which CUDA forbids
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
            futures = {pool.submit(_run_case_dict, asdict(case)): case for case in cases}
            for future in concurrent.futures.as_completed(futures):
                case = futures[future]
                seconds[case] = future.result()
                if progress is not None:
                    progress(case, seconds[case])
    return [(case, seconds[case]) for case in cases]


def _config_cases(args) -> list[WarmupCase]:
    layouts = tuple(args.layouts.split(","))
    if args.hf_config is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.hf_config, local_files_only=True)
        return cases_for_config(config, seq_lens=args.seq_len, batch=args.batch, dtype=args.dtype, layouts=layouts,
                                backward=not args.no_backward)
    if args.head_dim is None or args.heads is None:
        raise CommandError("warmup needs --hf-config, or --head-dim and --heads")
    window = None if args.window is None else (args.window, 0)
    return [WarmupCase(head_dim=args.head_dim, heads=args.heads, kv_heads=args.kv_heads or args.heads, seq_len=length,
                       batch=args.batch, dtype=args.dtype or "bf16", causal=not args.bidirectional, window=window,
                       softcap=args.softcap, layout=layout, backward=not args.no_backward)
            for layout in layouts for length in args.seq_len]


def run_command(args) -> int:
    """``flashmoe-science warmup``: the cases of the arguments, compiled; one line per case."""
    if not torch.cuda.is_available():
        raise CommandError("warmup compiles the GPU kernels: no CUDA device here")
    try:
        cases = _config_cases(args)
    except ValueError as error:
        raise CommandError(str(error)) from None
    start = time.perf_counter()
    warmup(cases, processes=args.processes, progress=lambda case, s: print(f"{s:7.1f} s  {case.describe()}",
                                                                           flush=True))
    print(f"{len(cases)} case(s) compiled into {os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache')} in "
          f"{time.perf_counter() - start:.1f} s")
    return 0


def add_warmup_parser(commands) -> None:
    """The ``warmup`` subcommand on the CLI's subparsers."""
    parser = commands.add_parser(
        "warmup", help="compile the attention kernels a model will use into Triton's cache before a job starts",
        description="Compile every attention kernel variant a model's job will launch (forward and backward, each "
        "layer type, the full batch's dense calls and the padded/packed batch's varlen calls) in parallel processes, "
        "into Triton's disk cache (TRITON_CACHE_DIR): the job's first step then loads them instead of compiling.")
    parser.add_argument("--hf-config", help="a local transformers config (a folder with config.json, or the file)")
    parser.add_argument("--head-dim", type=int, help="without --hf-config: the head dim")
    parser.add_argument("--heads", type=int, help="without --hf-config: query heads")
    parser.add_argument("--kv-heads", type=int, help="without --hf-config: key/value heads (default: --heads)")
    parser.add_argument("--window", type=int, help="without --hf-config: a causal sliding window of this many "
                        "keys before each query")
    parser.add_argument("--softcap", type=float, help="without --hf-config: logit soft-cap")
    parser.add_argument("--bidirectional", action="store_true", help="without --hf-config: not causal")
    parser.add_argument("--seq-len", type=int, nargs="+", required=True,
                        help="the job's sequence length(s) (padded batches: the padded length)")
    parser.add_argument("--batch", type=int, default=1, help="the job's batch size (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the config's, else bf16")
    parser.add_argument("--layouts", default="dense,varlen",
                        help=f"comma-separated, of {','.join(LAYOUTS)} (default dense,varlen; decode: generation)")
    parser.add_argument("--no-backward", action="store_true", help="forward only (inference)")
    parser.add_argument("--processes", type=int, help="parallel processes (default: one per case, up to the CPUs)")
    parser.set_defaults(handler=run_command)


__all__ = ["LAYOUTS", "WarmupCase", "add_warmup_parser", "cases_for_config", "packed_lengths", "run_case", "warmup"]
