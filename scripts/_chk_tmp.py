import math, torch
from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.hopper import bwd_sm90_hdim256 as m
for causal in (False, True):
    b, h, L, d = 2, 4, 1000, 256
    q, k, v, go = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    with torch.no_grad():
        out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
    delta = (out.float() * go.float()).sum(-1)
    res = []
    for kw in (dict(), dict(num_stages=1), dict(num_stages=1, dq_by_tma=True)):
        acc = torch.zeros(b, h, L, d, device="cuda"); dk = torch.empty_like(k); dv = torch.empty_like(v)
        m.launch(q, k, v, lse, go, delta, acc, dk, dv, causal, scale, **kw)
        res.append((acc, dk, dv))
    for r in res[1:]:
        print(causal, [(x - y).abs().max().item() for x, y in zip(res[0], r)], res[0][0].abs().max().item())
