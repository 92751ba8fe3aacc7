"""Ring attention through the Triton kernels (run under TRITON_INTERPRET=1 on the CPU): the cropped, windowed
blocks of the ring go through the same forward and backward kernels the GPU runs."""

import torch

import ring_cases
from flashmoe_science.distributed import ring_attention, zigzag_shard


def ring_triton_kernels(rank, world_size):
    q, k, v = (torch.randn(1, 2, 8 * world_size + 3, 16) for _ in range(3))
    grad = torch.randn_like(q)
    for causal, window in ((True, None), (False, (3, 5))):
        full = [t.double().requires_grad_() for t in (q, k, v)]
        expected = ring_cases.dense_attention(*full, causal, window)
        expected.backward(grad.double())
        local = [zigzag_shard(t).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, causal=causal, window=window, backend="triton")
        out.backward(zigzag_shard(grad))
        for name, got, ref in (("out", out, expected.detach()), *(
                (f"d{n}", t.grad, r.grad) for n, t, r in zip("qkv", local, full))):
            ring_cases.check_close(f"{name} (causal={causal}, window={window})", got, zigzag_shard(ref))


CASES = ["ring_triton_kernels"]
