"""The few communication steps the distributed algorithms need, on any initialised process group.

NCCL moves CUDA tensors; gloo moves CPU tensors. CUDA tensors on a gloo group are staged through host memory, so the
algorithms also run with several processes sharing one GPU (how the single-GPU tests exercise the GPU kernels
between ranks); NCCL groups never stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_rank_and_size(group) -> tuple[int, int]:
    """This process's rank in ``group`` (None: the default group) and the group's size, with clear errors."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first "
                           "(torchrun sets up the environment it reads)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of `group`")
    return rank, dist.get_world_size(group)


def _staged(group, tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


class Pending:
    """Started transfers into ``recvs``; ``wait()`` blocks until they are done (on NCCL: until the current stream
    waits for them), copies staged data to the device and returns ``recvs`` (one tensor when one was started)."""

    def __init__(self, works, sends, recvs, stagings=None):
        # sends are held until the wait: a temporary (x[rows]) must outlive the transfer that reads it
        self.works, self.sends, self.recvs = works, sends, recvs
        self.stagings = stagings or [None] * len(recvs)

    def wait(self):
        for work in self.works:
            work.wait()
        for recv, staging in zip(self.recvs, self.stagings):
            if staging is not None:
                recv.copy_(staging)
        self.sends = None
        return self.recvs[0] if len(self.recvs) == 1 else self.recvs


def _wire(group, send: torch.Tensor, recv: torch.Tensor):
    """(what to send, where to receive, the staging buffer or None): host copies for CUDA tensors on gloo."""
    if not _staged(group, send):
        return send, recv, None
    staging = torch.empty(recv.shape, dtype=recv.dtype, device="cpu")
    return send.cpu(), staging, staging


def gather_ints(values: list[int], group, device) -> torch.Tensor:
    """All ranks' ``values`` (the same count on each) as a ``(W, len(values))`` int64 CPU tensor: one all-gather."""
    _, world_size = group_rank_and_size(group)
    if dist.get_backend(group) == "gloo":
        device = "cpu"
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=group)
    return torch.stack(everyone).cpu()


def all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (the same shape on each), on ``tensor``'s device."""
    _, world_size = group_rank_and_size(group)
    source = tensor.cpu() if _staged(group, tensor) else tensor
    everyone = [torch.empty_like(source) for _ in range(world_size)]
    dist.all_gather(everyone, source, group=group)
    return [t.to(tensor.device) for t in everyone]


def ring_shift(sends: list[torch.Tensor], recvs: list[torch.Tensor], next_rank: int, prev_rank: int, group,
               tag: int) -> Pending:
    """Start sending each of ``sends`` (contiguous) to global rank ``next_rank`` and receiving each of ``recvs``
    (contiguous, preallocated) from ``prev_rank``: one ``batch_isend_irecv``, no packing copy."""
    ops, wires, stagings = [], [], []
    for i, (send, recv) in enumerate(zip(sends, recvs)):
        send, target, staging = _wire(group, send, recv)
        wires.append(send)
        stagings.append(staging)
        ops += [dist.P2POp(dist.isend, send, next_rank, group, tag + 2 * i),
                dist.P2POp(dist.irecv, target, prev_rank, group, tag + 2 * i)]
    return Pending(dist.batch_isend_irecv(ops) if ops else [], wires, recvs, stagings)


def all_gather_into(sends: list[torch.Tensor], recvs: list[torch.Tensor], group) -> Pending:
    """Start an all-gather of each of ``sends`` (contiguous, the same shape on every rank) into ``recvs``
    (``all_gather_into_tensor``: rank w's tensor at rows ``[w·n, (w + 1)·n)`` of dim 0), asynchronous."""
    works, wires, stagings = [], [], []
    for send, recv in zip(sends, recvs):
        send, target, staging = _wire(group, send, recv)
        works.append(dist.all_gather_into_tensor(target, send, group=group, async_op=True))
        wires.append(send)
        stagings.append(staging)
    return Pending(works, wires, recvs, stagings)


def reduce_scatter_into(send: torch.Tensor, recv: torch.Tensor, group) -> Pending:
    """Start summing ``send`` (contiguous, ``W·n`` rows: rank w's part at rows ``[w·n, (w + 1)·n)`` of dim 0) over the
    ranks, rank w receiving the sum of every rank's part w into ``recv`` (``reduce_scatter_tensor``), asynchronous."""
    wire, target, staging = _wire(group, send, recv)
    work = dist.reduce_scatter_tensor(target, wire, group=group, async_op=True)
    return Pending([work], [wire], [recv], [staging])


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group,
               out: torch.Tensor | None = None) -> Pending:
    """Start an uneven all-to-all of the rows of ``send`` (``all_to_all_single``, asynchronous), into ``out`` (contiguous,
    ``sum(recv_splits)`` rows) when given."""
    recv = send.new_empty((sum(recv_splits), *send.shape[1:])) if out is None else out
    wire, target, staging = _wire(group, send, recv)
    work = dist.all_to_all_single(target, wire, recv_splits, send_splits, group=group, async_op=True)
    return Pending([work], [wire], [recv], [staging])


def all_to_all_counts(send_counts: torch.Tensor, group, out: torch.Tensor | None = None) -> Pending:
    """Start exchanging a ``(W, n)`` int64 table of counts: row w goes to rank w; row s of the result (``out``,
    contiguous, when given) came from rank s. Asynchronous: the caller computes while the few bytes fly, then waits."""
    recv = torch.empty_like(send_counts) if out is None else out
    wire, target, staging = _wire(group, send_counts, recv)
    work = dist.all_to_all_single(target, wire, group=group, async_op=True)
    return Pending([work], [wire], [recv], [staging])
