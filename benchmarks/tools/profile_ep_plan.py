"""Device ops and time of the expert-parallel exchange plan: the PyTorch plan (``pair_plan.plan_pairs_reference``, the
CPU path) against the Triton plan (``triton_plan.plan_pairs``, the CUDA path) at the distributed bench's EP routing
(Qwen3-30B-A3B: top-8 of 128 experts, 16k tokens per rank), per world size and chunk count, on one GPU.

A plan here is what ``_plan_exchange`` runs without a process group: the plan itself and the host read of the count
tables (the call's synchronisation); the counts all-to-all between its two halves is left out.
Printed and written (``--out``, JSON) per row: the kernels, memcpys and memsets it launched (``torch.profiler``),
the host µs from the first launch to the counts on the host (median of ``--repeats``, synchronised before each), the
device µs (sum of its kernels), and whether both plans give the same counts, slots, rows and local ids.

    PYTHONPATH=src python benchmarks/tools/profile_ep_plan.py [--tokens 16384] [--world-sizes 2,4,8] [--chunks 1,2]

Without CUDA it prints the PyTorch plan's device ops as ``TorchDispatchMode`` sees them (aten ops that compute, not
views or allocations) on CPU tensors: the Triton plan is two launches by construction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashmoe_science.distributed.pair_plan import plan_pairs_reference as _plan_pairs

NUM_EXPERTS, TOP_K = 128, 8  # bench/distributed.EP_MODEL's routing
NOT_DEVICE_WORK = {"view", "t", "slice", "select", "unsqueeze", "empty", "scalar_tensor", "_reshape_alias",
                   "as_strided", "detach", "alias"}


def plan_once(plan, topk_ids, world_size, chunks):
    """One plan as ``_plan_exchange`` runs it, without the counts all-to-all (``tables[1]`` is left unwritten)."""
    tables = torch.empty((2, world_size, chunks), dtype=torch.int64, device=topk_ids.device)
    slots, pair_token, pair_ids = plan(topk_ids, NUM_EXPERTS, world_size, tables[0], lambda: None)
    sent = sum(sum(row) for row in tables.tolist()[0])
    return tables[0], slots, pair_token[:sent], pair_ids[:sent]


def device_ops(plan, topk_ids, world_size, chunks) -> dict:
    """Kernels, memcpys and memsets of one plan, and their device µs (the first of each signature already run)."""
    from torch.profiler import ProfilerActivity, profile

    plan_once(plan, topk_ids, world_size, chunks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        plan_once(plan, topk_ids, world_size, chunks)
        torch.cuda.synchronize()
    counts = {"kernels": 0, "memcpy": 0, "memset": 0}
    device_us = 0.0
    for event in trace.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = "memcpy" if "memcpy" in name else "memset" if "memset" in name else "kernels"
        counts[kind] += 1
        device_us += event.device_time if kind == "kernels" else 0.0
    return {**counts, "device_us": round(device_us, 1)}


def host_us(plan, topk_ids, world_size, chunks, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        plan_once(plan, topk_ids, world_size, chunks)
        samples.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(samples), 1)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NOT_DEVICE_WORK:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def routing(tokens: int, device) -> torch.Tensor:
    """Distinct experts per token, uniformly at random, as the bench's random logits route them."""
    return torch.rand(tokens, NUM_EXPERTS, device=device).argsort(1)[:, :TOP_K].contiguous()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--chunks", default="1,2")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    records = []
    if not torch.cuda.is_available():
        topk_ids = routing(args.tokens, "cpu")
        for world_size in world_sizes:
            for chunks in chunk_counts:
                with _CountOps() as counter:
                    plan_once(_plan_pairs, topk_ids, world_size, chunks)
                records.append({"plan": "torch", "device": "cpu", "T": args.tokens, "world_size": world_size,
                                "chunks": chunks, "aten_ops": len(counter.ops)})
                print(f"W={world_size} chunks={chunks}: the PyTorch plan, {len(counter.ops)} aten ops: "
                      f"{' '.join(counter.ops)}")
    else:
        from flashmoe_science.distributed.triton_plan import plan_pairs

        topk_ids = routing(args.tokens, "cuda")
        for world_size in world_sizes:
            for chunks in chunk_counts:
                reference = plan_once(_plan_pairs, topk_ids, world_size, chunks)
                same = all(torch.equal(a, b) for a, b in zip(plan_once(plan_pairs, topk_ids, world_size, chunks),
                                                             reference))
                for name, plan in (("torch", _plan_pairs), ("triton", plan_pairs)):
                    row = {"plan": name, "device": torch.cuda.get_device_name(), "T": args.tokens,
                           "world_size": world_size, "chunks": chunks, "same_as_torch": same,
                           **device_ops(plan, topk_ids, world_size, chunks),
                           "host_us": host_us(plan, topk_ids, world_size, chunks, args.repeats)}
                    records.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
