"""Host time of the sm_90 attention backward through autograd, with and without the prepared launches
(api._PREPARED_BACKWARD / bwd_sm90.PreparedBackward), beside cuDNN's backward: the backward as bench times it
(do_bench median of torch.autograd.grad, graph retained) and the host's time per call (50 calls without a sync,
per call).

    PYTHONPATH=src python scripts/host_bwd_sm90.py [--cases B4xH8xL2048xD64xcausal,...]
"""

import argparse
import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmoe_science.attention import api
from flashmoe_science.attention.hopper import bwd_sm90

CASES = "B4xH8xL2048xD64xcausal,B4xH8xL2048xD64xfull,B4xH8xL4096xD64xcausal,B8xH16xL1024xD128xcausal"


def _direct(q, k, v, out, lse, grad_out, delta, dq, dk, dv, causal, softmax_scale):
    bwd_sm90.attention_backward_sm90(q, k, v, out, lse, grad_out, delta, dq, dk, dv, causal, softmax_scale)


def _times(fn):
    median = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        fn()
    host = (time.perf_counter() - start) / 50 * 1e6
    torch.cuda.synchronize()
    return median, host


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=CASES)
    args = parser.parse_args()
    prepared_path = api._sm90_backward
    for case in args.cases.split(","):
        b, h, length, d, mask = case.split("x")
        b, h, length, d = int(b[1:]), int(h[1:]), int(length[1:]), int(d[1:])
        causal = mask == "causal"
        q, k, v, grad_out = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        line = [case]
        for name, path in (("prepared", prepared_path), ("unprepared", _direct)):
            api._sm90_backward = path
            try:
                out = api.flash_attention_science(*leaves, causal=causal)
                ms, host = _times(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True))
            finally:
                api._sm90_backward = prepared_path
            line.append(f"{name} {ms:.3f} ms (host {host:.0f} us/call)")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            ms, host = _times(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True))
        line.append(f"cudnn {ms:.3f} ms (host {host:.0f} us/call)")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
