"""Which exchange moves an expert-parallel layer's tokens, with every declined exchange's reason.

- ``symm_mem`` (``symm_exchange``): our kernels store the tokens straight into the peers' buffers over peer
  mappings of symmetric memory; no host read, CUDA-graph capturable. Needs CUDA tensors on an NCCL group whose
  ranks share one host and reach each other's GPU by peer access, and a torch with
  ``torch.distributed._symmetric_memory``.
- ``nccl`` (``expert_parallel``): uneven all-to-all collectives sized by one host read of the counts per call;
  any process group (NCCL, gloo on CPUs), overlap chunks.

Every rank must choose alike (the exchanges do not talk to each other): the checks read what every rank shares (the
device type, the group's backend, torch) and, once per group, what the ranks report of their host and peer access
(one all-gather, kept).
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashmoe_science.backends import Choice, choose


@dataclass(frozen=True)
class ExchangeProblem:
    x: torch.Tensor
    group: object  # None: the default group
    exchange: str = "auto"


class SymmetricMemoryExchange:
    name = "symm_mem"

    def decline(self, problem: ExchangeProblem) -> str | None:
        if not problem.x.is_cuda:
            return f"x is on {problem.x.device.type}: peer mappings need CUDA tensors"
        backend = dist.get_backend(problem.group)
        if "nccl" not in backend:  # "nccl", or a per-device map such as "cuda:nccl,cpu:gloo"
            return f"the group's backend is {backend}: symmetric memory takes NCCL groups (one GPU per rank)"
        if not symmetric_memory_importable():
            return "this torch has no torch.distributed._symmetric_memory"
        return _peers_reason(_group_name(problem.group))

    def plan(self, problem: ExchangeProblem) -> str:
        return "our kernels store tokens into the peers' symmetric buffers; device barriers, no host read"


class NcclExchange:
    name = "nccl"

    def decline(self, problem: ExchangeProblem) -> str | None:
        return None

    def plan(self, problem: ExchangeProblem) -> str:
        return "all_to_all_single of uneven splits, sized by one host read of the counts per call"


EXCHANGES = (SymmetricMemoryExchange(), NcclExchange())
EXCHANGE_NAMES = ("auto", *(e.name for e in EXCHANGES))


def check_exchange(exchange) -> None:
    if exchange not in EXCHANGE_NAMES:
        raise ValueError(f"exchange must be one of {EXCHANGE_NAMES}, got {exchange!r}")


def check_capacity_args(capacity_factor, max_tokens) -> None:
    """``capacity_factor`` None or a number > 0; ``max_tokens`` None or an int >= 1."""
    if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                        or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0):
        raise ValueError(f"capacity_factor must be None or a number > 0, got {capacity_factor!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be None or an int >= 1, got {max_tokens!r}")


def plan_exchange(problem: ExchangeProblem) -> Choice:
    """The exchange of a call: the first of ``EXCHANGES`` that takes it ("auto"), or the one named (its refusal
    raises ValueError with the reason)."""
    check_exchange(problem.exchange)
    return choose(EXCHANGES, problem, problem.exchange)


def describe_exchange(choice: Choice) -> str:
    lines = [f"exchange: {choice.backend}: {choice.plan}"]
    lines += [f"  not {name}: {why}" for name, why in choice.declined]
    return "\n".join(lines)


def symmetric_memory_importable() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


@functools.lru_cache(maxsize=None)
def _peers_reason(group_name: str) -> str | None:
    """Why the group's GPUs cannot map each other's memory (None: they can), from one all-gather of each rank's
    host name and peer access to every GPU it sees."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    here = torch.cuda.current_device()
    reachable = all(torch.cuda.can_device_access_peer(here, other)
                    for other in range(torch.cuda.device_count()) if other != here)
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (socket.gethostname(), reachable), group=group)
    hosts = {host for host, _ in reports}
    if len(hosts) > 1:
        return f"the group spans {len(hosts)} hosts: peer mappings reach the GPUs of one host"
    blocked = [rank for rank, (_, ok) in enumerate(reports) if not ok]
    if blocked:
        return f"ranks {blocked} cannot reach every GPU of the host by peer access (no NVLink or P2P)"
    return None
