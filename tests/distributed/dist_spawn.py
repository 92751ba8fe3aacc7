"""Run test cases in W gloo processes (torch.multiprocessing.spawn) and bring back what each rank found.

A case is a function ``case(rank, world_size) -> None`` that raises on failure; all cases of one world size run in
one spawn (starting processes and importing torch costs seconds on the CI machine). The pytest side asks
``results[(world_size, case_name)]``: None when every rank passed, else the first rank's error text.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, module: str, names: list[str], out_dir: str) -> None:
    import importlib

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))  # a hung collective fails the case
    cases = importlib.import_module(module)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as report:
        for name in names:
            try:
                torch.manual_seed(1234)  # the same inputs on every rank
                getattr(cases, name)(rank, world_size)
                report.write(json.dumps([name, None]) + "\n")
            except Exception:
                report.write(json.dumps([name, traceback.format_exc()]) + "\n")
            report.flush()
            dist.barrier()
    dist.destroy_process_group()


def run_cases(module: str, names: list[str], world_size: int) -> dict[str, str | None]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, _free_port(), module, names, out_dir), nprocs=world_size)
        results: dict[str, str | None] = dict.fromkeys(names)
        for rank in reversed(range(world_size)):  # rank 0's error wins
            with open(os.path.join(out_dir, f"rank{rank}.txt")) as report:
                found = dict(json.loads(line) for line in report)
            for name in names:
                if name not in found:
                    results[name] = f"rank {rank}: did not run"
                elif found[name] is not None:
                    results[name] = f"rank {rank}: {found[name]}"
    return results
