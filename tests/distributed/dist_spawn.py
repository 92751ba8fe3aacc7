"""Run test cases in W gloo processes (torch.multiprocessing.spawn) and bring back what each rank found.

A case is a function ``case(rank, world_size) -> None`` that raises on failure, after its last collective (a rank
that raises early leaves the others waiting in a collective until the timeout); all cases of one world size run in
one spawn (starting processes and importing torch costs seconds on the CI machine). `run_cases` returns, per case,
None when every rank passed, else the first failing rank's error text.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str, backend: str, device: str) -> None:
    import importlib

    torch.set_num_threads(1)
    options = {}
    if device == "cuda":  # the cases create their tensors on this rank's GPU (several ranks may share one)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.set_default_device(torch.device("cuda", torch.cuda.current_device()))
        if backend == "nccl":
            options["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60), **options)  # a hung collective fails the case
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as report:
        for name in names:
            started, error = time.perf_counter(), None
            try:
                torch.manual_seed(1234)  # the same inputs on every rank
                module, case = name.rsplit(".", 1)
                getattr(importlib.import_module(module), case)(rank, world_size)
            except Exception:
                error = traceback.format_exc()
            report.write(json.dumps([name, error]) + "\n")
            report.flush()
            dist.barrier()
            if rank == 0 and os.environ.get("FLASHMOE_CASE_PROGRESS"):  # a run cut short by its limit shows how far
                failure = f"FAILED: {error.strip().splitlines()[-1]}" if error else "ok"
                print(f"{backend} x{world_size} {name}: {failure} {time.perf_counter() - started:.1f} s",
                      file=sys.__stderr__, flush=True)
    if backend == "nccl":
        # the reports are on disk and every rank has passed the last barrier: NCCL's teardown (destroy_process_group,
        # or its handlers at interpreter exit) adds nothing a test reads, so the workers leave without it
        torch.cuda.synchronize()
        os._exit(0)
    dist.destroy_process_group()


def run_cases(names: list[str], world_size: int, backend: str = "gloo", device: str = "cpu",
              env: dict[str, str] | None = None) -> dict[str, str | None]:
    """Run the cases ``names`` ("module.function", modules importable from this folder) in ``world_size`` ranks of a
    ``backend`` group, tensors on ``device`` ("cuda": rank r on GPU r mod the GPU count; gloo stages through host
    memory, so several ranks may share one GPU; NCCL needs a GPU per rank), with ``env`` added to the processes'
    environment (e.g. TRITON_INTERPRET=1, read when triton is imported)."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        return _run(names, world_size, backend, device)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run(names, world_size, backend, device):
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_worker, args=(world_size, _free_port(), names, out_dir, backend, device), nprocs=world_size)
            crash = ""
        except mp.ProcessRaisedException as error:  # e.g. ranks out of step after a failed case: a timeout
            crash = f" (the processes then failed: {error})"
        results: dict[str, str | None] = dict.fromkeys(names)
        for rank in reversed(range(world_size)):  # rank 0's error wins
            with open(os.path.join(out_dir, f"rank{rank}.txt")) as report:
                found = dict(json.loads(line) for line in report)
            for name in names:
                if name not in found:
                    results[name] = f"rank {rank}: did not run{crash}"
                elif found[name] is not None:
                    results[name] = f"rank {rank}: {found[name]}"
    return results
