"""The distributed benchmark's harness in a gloo group (its CPU smoke sizes): every rank gets the same records."""

import torch

from flashmoe_science.bench.distributed import run_scaling_bench
from flashmoe_science.distributed.comm import all_gather


def bench_scaling_smoke(rank, world_size):
    records = run_scaling_bench()
    ops = {(r["op"], r["pass"]) for r in records}
    expected = {(op, p) for op in ("ring-attention", "ep-moe") for p in ("fwd", "fwd+bwd")}
    if ops != expected:
        raise AssertionError(f"records cover {sorted(ops)}, expected {sorted(expected)}")
    mine = torch.tensor([len(records)], device="cpu")
    if len({int(t) for t in all_gather(mine, None)}) != 1:
        raise AssertionError("ranks returned different numbers of records")
    for record in records:
        if not (record["ms"] > 0 and record["ms_1gpu"] > 0 and record["efficiency"] > 0):
            raise AssertionError(f"bad timing in {record}")
    backends = {(r["pass"], r["backend"]) for r in records if r["op"] == "ring-attention"}
    expected = {(p, f"flashmoe-ring/{e}") for p in ("fwd", "fwd+bwd") for e in ("allgather", "ring")}
    expected.add(("fwd+bwd", "flashmoe-ring/allgather+grad-allgather"))
    if backends != expected:  # torch-cp runs on GPUs only
        raise AssertionError(f"ring backends {sorted(backends)}")
    if any(r["world_size"] != world_size for r in records):
        raise AssertionError("world_size not recorded")


CASES = ["bench_scaling_smoke"]
