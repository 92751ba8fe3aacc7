"""Re-measure the brief's B4 H8 L2048 D64 shape, where the 22fad09 bench recorded `auto` 3x slower than the Triton
kernel (forward) and 1.4-1.9x (backward): device time vs host time per call, twice, beside the FA3-grid shape."""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmoe_science import flash_attention_science
from flashmoe_science.bench.attention import cuda_median_ms

for b, h, length in ((4, 8, 2048), (8, 32, 2048), (4, 8, 2048)):
    for causal in (False, True):
        q, k, v = (torch.randn(b, h, length, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        line = [f"B{b} H{h} L{length} causal={int(causal)}"]
        for name in ("auto", "triton", "cudnn"):
            if name == "cudnn":
                def fn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            else:
                def fn(name=name):
                    return flash_attention_science(q, k, v, causal=causal, backend=name)
            fn()
            torch.cuda.synchronize()
            ms = cuda_median_ms(fn)
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host = (time.perf_counter() - t0) / 200 * 1e3
            torch.cuda.synchronize()
            # device time alone: a CUDA graph-free proxy, 20 calls queued behind a 5 ms sleep kernel
            torch.cuda._sleep(10_000_000)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                fn()
            e.record()
            torch.cuda.synchronize()
            line.append(f"{name}: bench {ms:.4f} ms, host {host:.4f} ms/call, queued {s.elapsed_time(e) / 20:.4f} ms")
        # backward (autograd), auto vs triton
        for name in ("auto", "triton"):
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = flash_attention_science(qq, kk, vv, causal=causal, backend=name)
            dout = torch.randn_like(out)
            bwd = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
            bwd()
            line.append(f"bwd {name}: {cuda_median_ms(bwd, grad_to_none=[qq, kk, vv]):.4f} ms")
        print(" | ".join(line), flush=True)
