"""Pretrain a GPT-MoE with Megatron-core's training pieces, our kernels against Megatron-core's local spec.

    PYTHONPATH=src python examples/megatron/train_gpt_moe.py                                       # 1 GPU
    PYTHONPATH=src torchrun --nproc-per-node 4 examples/megatron/train_gpt_moe.py --ep 2 --etp 2   # 4 GPUs
    PYTHONPATH=src python examples/megatron/train_gpt_moe.py --size tiny --steps 4                 # CPU (gloo)

One process per GPU (or CPU rank, gloo). Each run builds Megatron-core's ``GPTModel`` (``gpt_moe.py``: ~0.55B
parameters by default) with one kernel set, "flashmoe" (``get_gpt_layer_flash_spec``: our core attention and
experts) or "local" (``get_gpt_layer_local_spec``: ``DotProductAttention``, ``SequentialMLP``), from the same initial
weights, and trains it on the same batches with Megatron-core's ``Float16Module`` (bf16 weights),
``DistributedDataParallel`` (gradients reduced in float32), its optimizer (``get_megatron_optimizer``: Adam with
float32 main weights under bf16, gradient clipping), its ``OptimizerParamScheduler`` (warmup, cosine decay) and
``finalize_model_grads``. The step is the no-pipeline
schedule written out (forward, loss, backward, gradient finalisation; Megatron's ``forward_backward_no_pipelining``
allocates a CUDA tensor, so the CPU run could not call it). Data parallelism (every rank), expert parallelism
(``--ep``: the alltoall token dispatcher) and expert tensor parallelism (``--etp``: each expert's hidden dimension
split) are Megatron-core's. Dense tensor parallelism is not offered: Megatron-core 0.19 trains MoE layers under
tensor parallelism only with sequence parallelism, which its norms without TransformerEngine or apex refuse.

Data: random tokens, each sequence a random segment of ``--period`` tokens repeated. The segment's tokens are drawn
from a Zipf distribution (``--zipf`` s: token r has probability ∝ (r+1)^-s; 0 draws uniformly), so the loss moves
from the first steps on: from ``log(vocab)`` to the distribution's entropy H (7.31 nats for s=1 over 32,768 tokens)
as the model learns the token frequencies, then towards about ``H · period / seq`` as it learns to copy (a segment's
first occurrence cannot be predicted). Batch ``step`` of data-parallel rank r is drawn from ``(--seed, step, r)``
alone: every kernel set and every repeat sees the same batches.

``--repeats N`` runs every kernel set N times in one process, interleaved (round r runs the kernel sets in the
given order for even r, reversed for odd r: flashmoe, local, local, flashmoe, ...), each run from the same initial
weights. ``--time-limit S`` stops a run after S seconds (at the same step on every rank; its record says so). Rank 0
writes to ``--out`` (``train_outputs.py``): ``megatron-train.json`` (records: op ``megatron-train``, gpus,
kernels, repeat, tokens_per_s over the steps after ``--warmup``, MFU, peak memory, final_loss = mean loss of the
last 10 steps; the envelope: GPU, versions, commit, date; the comparison of the two kernel sets),
``megatron-train.csv`` (every step of every run) and ``megatron-train.png`` (loss curves, tokens/s, the loss gap).
On a CPU the tokens/s measure nothing (no kernels run there); the run checks the pipeline.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpt_moe  # noqa: E402
from train_outputs import write_outputs  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

# bf16 dense tensor-core peak of an H100/H200 SXM (TFLOP/s), the MFU's denominator
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(gpt_moe.SIZES), default="small")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of tokens/s (default 20)")
    parser.add_argument("--kernels", default="flashmoe,local", help="comma-separated: flashmoe, local")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds per run: every rank stops after the step during which this passes")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (each expert's hidden dim "
                                                           "split over this many ranks)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--period", type=int, default=None,
                        help="length of the repeated random segment (default: a sixteenth of the sequence)")
    parser.add_argument("--zipf", type=float, default=1.0,
                        help="Zipf exponent of the token distribution (default 1; 0: uniform)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="Megatron-core's deterministic_mode: our attention's dQ adds in a fixed order (the "
                             "experts' dx adds on Hopper stay unordered)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="model dtype (default: bfloat16 on GPUs, float32 on CPUs)")
    parser.add_argument("--commit", default=os.environ.get("FLASHMOE_COMMIT", "unknown"))
    parser.add_argument("--out", default="megatron-train-out")
    args = parser.parse_args(argv)
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not args.kernels or any(k not in gpt_moe.KERNELS for k in args.kernels):
        parser.error(f"--kernels takes a comma-separated subset of {gpt_moe.KERNELS}")
    if args.zipf < 0:
        parser.error(f"--zipf must be >= 0, got {args.zipf}")
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if args.steps <= args.warmup and args.steps > 1:
        args.warmup = args.steps // 2
    return args


# ------------------------------------------------------------------------------------------------ process groups
def init_distributed(args) -> torch.device:
    from megatron.core import parallel_state

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29581")
        dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)),
                                device_id=torch.device("cuda", local_rank))
        parallel_state.initialize_model_parallel(expert_model_parallel_size=args.ep,
                                                 expert_tensor_parallel_size=args.etp)
        return torch.device("cuda", local_rank)
    import megatron_cpu

    megatron_cpu.init(expert_parallel=args.ep, expert_tensor_parallel=args.etp)
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------------------- data
def period(size: gpt_moe.Size, args) -> int:
    return args.period or max(1, size.seq_len // 16)


@functools.cache
def token_probabilities(vocab: int, zipf: float) -> torch.Tensor:
    """Zipf's law over ``vocab`` token ids: id r drawn with probability ∝ (r+1)^-zipf (uniform at 0)."""
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-zipf)
    return weights / weights.sum()


def batch(step: int, size: gpt_moe.Size, args, device):
    """This data-parallel rank's batch of ``step``: (tokens, positions, labels), the same for every kernel set."""
    from megatron.core import parallel_state

    rank = parallel_state.get_data_parallel_rank()
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    segments = torch.multinomial(token_probabilities(size.vocab, args.zipf), size.micro_batch * period(size, args),
                                 replacement=True, generator=generator).view(size.micro_batch, -1)
    repeats = -(-(size.seq_len + 1) // segments.shape[1])
    stream = segments.repeat(1, repeats)[:, :size.seq_len + 1]
    positions = torch.arange(size.seq_len).expand(size.micro_batch, -1)
    return stream[:, :-1].to(device), positions.to(device), stream[:, 1:].to(device)


# ------------------------------------------------------------------------------------------------------ training
def make_trainer(model, config, args):
    """Megatron-core's DDP around ``model``, its optimizer (on a CPU: ``megatron_cpu.MainGradAdamW``) and its
    LR/weight-decay scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    if torch.cuda.is_available():
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr / 10, weight_decay=0.01, adam_beta1=0.9,
                            adam_beta2=0.95, bf16=config.bf16, clip_grad=1.0), [ddp])
    else:  # Megatron-core's optimizer allocates CUDA tensors
        import megatron_cpu

        optimizer = megatron_cpu.MainGradAdamW(ddp, lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10,
                                        lr_warmup_steps=warmup, lr_decay_steps=max(args.steps, warmup + 1),
                                        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=1,
                                        wd_incr_style="constant")
    return ddp, optimizer, scheduler


def forward_backward(ddp, optimizer, tokens, positions, labels, causal_mask) -> torch.Tensor:
    """A step's forward, loss (the mean over tokens), backward and gradient finalisation, gradients zeroed first;
    returns this rank's language-model loss. The optimizer then steps on the ``main_grad`` this leaves."""
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens, positions, causal_mask, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    return loss


def train_step(ddp, optimizer, scheduler, tokens, positions, labels, causal_mask, stop: bool) -> tuple[float, bool]:
    """One step; returns the data-parallel mean of the language-model loss and whether any rank asked to ``stop``
    (one all-reduce carries both: every rank then stops after the same step)."""
    from megatron.core import parallel_state

    loss = forward_backward(ddp, optimizer, tokens, positions, labels, causal_mask)
    optimizer.step()
    scheduler.step(increment=1)
    reported = torch.stack([loss.detach(), torch.tensor(float(stop), device=loss.device)])
    dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    total, stops = reported.tolist()
    return total / parallel_state.get_data_parallel_world_size(), stops > 0


def causal_mask(size: gpt_moe.Size, device):
    """The mask the models are called with: None on a GPU, where Megatron's local attention builds its causal mask
    itself; Megatron's boolean mask (True: masked) on the CPU. Ours reads the layer's mask type."""
    if device.type == "cuda":
        return None
    return torch.ones(1, 1, size.seq_len, size.seq_len, dtype=torch.bool, device=device).triu(1)


def build(kernels: str, size: gpt_moe.Size, args, device):
    """The model with ``kernels`` as a run trains it: the config, Float16Module under bf16, on ``device``."""
    config = gpt_moe.transformer_config(size, expert_parallel=args.ep, expert_tensor_parallel=args.etp,
                                        bf16=args.dtype == "bfloat16", deterministic=args.deterministic)
    model = gpt_moe.build_model(kernels, config, size, args.seed)
    if config.bf16:  # as Megatron's training builds it: every weight in bf16 (norms included), float32 logits/loss
        model = Float16Module(config, model)
    return model.to(device), config


def run(kernels: str, repeat: int, size: gpt_moe.Size, args, device, on_step) -> dict:
    """Train one model with ``kernels`` (the ``repeat``-th time); returns its record and per-step rows."""
    from megatron.core import parallel_state

    model, config = build(kernels, size, args, device)
    ddp, optimizer, scheduler = make_trainer(model, config, args)
    causal = causal_mask(size, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dp = parallel_state.get_data_parallel_world_size()
    tokens_per_step = dp * size.micro_batch * size.seq_len
    rows, timed, began, stopped = [], 0.0, time.perf_counter(), False
    for step in range(args.steps):
        tokens, positions, labels = batch(step, size, args, device)
        start = time.perf_counter()
        late = args.time_limit is not None and start - began > args.time_limit
        loss, stopped = train_step(ddp, optimizer, scheduler, tokens, positions, labels, causal, late)  # syncs
        seconds = time.perf_counter() - start
        if step >= args.warmup:
            timed += seconds
        rows.append({"kernels": kernels, "step": step, "loss": loss, "tokens_per_s": tokens_per_step / seconds})
        on_step(rows[-1])
        if stopped:
            break
    world = dist.get_world_size()
    measured = len(rows) - args.warmup
    tokens_per_s = tokens_per_step * measured / timed if measured > 0 and timed > 0 else None
    tail = [row["loss"] for row in rows[-10:]]
    record = {"op": "megatron-train", "model": model_label(size), "gpus": world if device.type == "cuda" else 0,
              "kernels": kernels, "repeat": repeat, "dp": dp, "ep": args.ep, "etp": args.etp, "steps": len(rows),
              "stopped_by_time_limit": stopped, "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_s,
              "tokens_per_s_per_gpu": tokens_per_s / world if tokens_per_s else None,
              "mfu_percent": mfu(tokens_per_s, size, world), "final_loss": sum(tail) / len(tail),
              "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)}
    del ddp, optimizer, scheduler, model
    gc.collect()  # DDP's hooks and the optimizer refer back to the model: free it before the next run builds its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"record": record, "rows": rows}


def model_label(size: gpt_moe.Size) -> str:
    total, active = size.parameters()
    return (f"GPT-MoE {total / 1e9:.2f}B ({active / 1e9:.2f}B active), {size.layers} layers, d={size.hidden}, "
            f"{size.experts} experts top-{size.top_k}, {size.seq_len} tokens x {size.micro_batch} per rank")


def mfu(tokens_per_s, size: gpt_moe.Size, world: int):
    if not tokens_per_s or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    peak = next((tflops for gpu, tflops in PEAK_TFLOPS.items() if gpu in name), None)
    if peak is None:
        return None
    return 100 * tokens_per_s * size.train_flops_per_token() / (world * peak * 1e12)


# ------------------------------------------------------------------------------------------------------- outputs
def envelope(args, size: gpt_moe.Size) -> dict:
    total, active = size.parameters()
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "megatron_core": importlib.metadata.version("megatron-core"),
            "triton": _version("triton"), "commit": args.commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "model": {"size": args.size, **vars(size), "parameters": total, "active_parameters": active},
            "dtype": args.dtype, "lr": args.lr,
            "data": f"random tokens (Zipf exponent {args.zipf}), segments of {period(size, args)} repeated",
            "repeats": args.repeats,
            "note": (f"examples/megatron/train_gpt_moe.py: Megatron-core {_version('megatron-core')}'s GPTModel, DDP "
                     f"(float32 gradient reduction), Adam and cosine schedule; flashmoe = get_gpt_layer_flash_spec, "
                     f"local = get_gpt_layer_local_spec, same initial weights and batches; tokens/s over steps "
                     f"{args.warmup}-{args.steps - 1}, final_loss = mean of the last 10 steps' loss; {args.repeats} "
                     f"repeat(s), kernel sets interleaved in one process")}


def _version(package: str):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    device = init_distributed(args)
    size = gpt_moe.SIZES[args.size]
    rank0 = dist.get_rank() == 0
    order = [args.kernels if r % 2 == 0 else args.kernels[::-1] for r in range(args.repeats)]
    results, document = [], None
    try:
        for repeat, kernels in ((r, k) for r, round_ in enumerate(order) for k in round_):
            def on_step(row, kernels=kernels, repeat=repeat):
                if rank0 and (row["step"] % 10 == 0 or row["step"] == args.steps - 1):
                    print(f"[{kernels}] repeat {repeat} step {row['step']:4d}  loss {row['loss']:.4f}  "
                          f"{row['tokens_per_s']:,.0f} tokens/s", flush=True)
            results.append(run(kernels, repeat, size, args, device, on_step))
            # after every run: a later run stopped by a time limit leaves the earlier ones written
            document = write_outputs(Path(args.out), envelope(args, size), results) if rank0 else None
        if rank0:
            print(json.dumps({"records": document["records"], "summary": document["summary"]}, indent=1))
        return document
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
