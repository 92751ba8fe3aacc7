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
    """Started transfers into ``recv``; ``wait()`` blocks until they are done (on NCCL: until the current stream
    waits for them) and copies staged data to the device."""

    def __init__(self, works, send: torch.Tensor, recv: torch.Tensor, staging: torch.Tensor | None = None):
        # send is held until the wait: a temporary (x[rows]) must outlive the transfer that reads it
        self.works, self.send, self.recv, self.staging = works, send, recv, staging

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        if self.staging is not None:
            self.recv.copy_(self.staging)
        self.send = None
        return self.recv


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


def ring_shift(send: torch.Tensor, recv_shape, next_rank: int, prev_rank: int, group, tag: int) -> Pending:
    """Start sending ``send`` to global rank ``next_rank`` and receiving a tensor of ``recv_shape`` (send's dtype)
    from ``prev_rank`` (one ``batch_isend_irecv``)."""
    recv = torch.empty(recv_shape, dtype=send.dtype, device=send.device)
    staging = None
    if _staged(group, send):
        send, staging = send.cpu(), torch.empty(recv_shape, dtype=send.dtype, device="cpu")
    ops = [dist.P2POp(dist.isend, send, next_rank, group, tag),
           dist.P2POp(dist.irecv, recv if staging is None else staging, prev_rank, group, tag)]
    return Pending(dist.batch_isend_irecv(ops), send, recv, staging)


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> Pending:
    """Start an uneven all-to-all of the rows of ``send`` (``all_to_all_single``, asynchronous)."""
    recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
    staging = None
    if _staged(group, send):
        send, staging = send.cpu(), torch.empty(recv.shape, dtype=send.dtype, device="cpu")
    work = dist.all_to_all_single(recv if staging is None else staging, send, recv_splits, send_splits, group=group,
                                  async_op=True)
    return Pending([work], send, recv, staging)


def all_to_all_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """Exchange a ``(W, n)`` int64 table of counts: row w goes to rank w; row s of the result came from rank s."""
    device = send_counts.device
    if _staged(group, send_counts):
        send_counts = send_counts.cpu()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return recv_counts.to(device)
