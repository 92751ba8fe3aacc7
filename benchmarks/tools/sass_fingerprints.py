"""Fingerprints of the SASS of every Gluon sm_90 kernel, built offline (no GPU: ptxas and cuobjdump ship with
triton): one line per kernel and config, the sha256 of its instruction lines and their count. Run it before and
after a change that must leave the kernels alone (a move, a rename, a compatibility shim) and diff the outputs.

    PYTHONPATH=src python benchmarks/tools/sass_fingerprints.py [NAME ...] > before.txt

The attention feature builds follow the offline build tests (tests/attention/test_*sm90_build.py): a window bounded
on both sides, one bounded on the left only, softcap, ALiBi, a packed (varlen) batch and all of them at once, in the
forward (the persistent kernel, and the varlen short-causal plan with overlapped items) and in the three backward
kernels; an attn_bias read by TMA and by the consumers' loads (forward), with and without its gradient (backward).
The MoE operands
are the offline build tests' (tests/moe), at Mixtral's and Qwen3's dims.
"""

from __future__ import annotations

import hashlib
import pathlib
import re
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "moe"))
sys.path.insert(0, str(ROOT / "tests"))  # sm90_helpers, which the MoE cases import

from flashmoe_science.attention.hopper import bwd_dq_sm90, bwd_sm90, bwd_sm90_hdim256, fwd_sm90  # noqa: E402
from flashmoe_science.attention.hopper.bwd_common import offline_features  # noqa: E402
from flashmoe_science.attention.mask import make_mask  # noqa: E402
from flashmoe_science.attention.tiles import AttentionTiles  # noqa: E402
from flashmoe_science.gluon.build import offline_sass  # noqa: E402
from flashmoe_science.moe.dispatch import sort_buffers  # noqa: E402
from flashmoe_science.moe.hopper import dx_sm90, wgrad_sm90  # noqa: E402

META = torch.device("meta")


def _forward(head_dim, block_n, stages, causal, q_buffers=1, cross_item=False):
    return fwd_sm90.compile_offline(head_dim, causal, AttentionTiles(128, block_n, 8, stages), q_buffers=q_buffers,
                                    cross_item=cross_item)


def _forward_features(head_dim=128, block_n=128, stages=2, causal=False, window=None, softcap=None, alibi=False,
                      varlen=False, q_buffers=1, cross_item=False):
    return fwd_sm90.compile_offline(head_dim, causal, AttentionTiles(128, block_n, 8, stages), 132, q_buffers,
                                    cross_item, mask=make_mask(causal, window, softcap), alibi=alibi, varlen=varlen)


# offline_features arguments: each feature alone and all at once (a window bounded on both sides and one bounded on
# the left only: causal with a left bound builds as the former)
BACKWARD_FEATURES = {
    "window": dict(window=(100, 20)),
    "left": dict(window=(300, -1)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=True),
    "varlen_causal": dict(varlen=True, causal=True),
    "all": dict(causal=True, window=(100, -1), softcap=5.0, alibi=True, varlen=True),
}


def _backward_features(module, head_dim, name):
    return module.compile_offline(head_dim, offline_features(**BACKWARD_FEATURES[name]))


def _mixtral_rows():
    sort, _, _ = sort_buffers(4096, 2, 8, 128, META)
    return sort, sort.tile_expert.numel() * 128


def _dx():
    sort, rows = _mixtral_rows()
    return dx_sm90.compile_offline(torch.empty(rows, 28672, dtype=torch.bfloat16, device=META),
                                   torch.empty(8, 28672, 4096, dtype=torch.bfloat16, device=META),
                                   torch.empty(4096, 4096, dtype=torch.float32, device=META), sort,
                                   dx_sm90.DxConfig())


def _dh():
    import test_moe_dh_sm90 as cases

    return dx_sm90.compile_offline(*cases._meta_case(4096, 2, 8, 4096, 14336), cases.AB_CONFIGS[0], gemm="dh")


def _dh_swiglu():
    import test_moe_dh_sm90 as cases

    a, w2, dgu, swiglu, sort = cases._swiglu_case(4096, 8, 128, 2048, 768, device=META)
    return dx_sm90.compile_offline(a, w2, dgu, sort, dx_sm90.DH_SWIGLU_CONFIG, gemm="dh_swiglu", swiglu=swiglu)


def _down():
    sort, rows = _mixtral_rows()
    return dx_sm90.compile_offline(torch.empty(rows, 14336, dtype=torch.bfloat16, device=META),
                                   torch.empty(8, 4096, 14336, dtype=torch.bfloat16, device=META),
                                   torch.empty(4096, 4096, dtype=torch.float32, device=META), sort,
                                   dx_sm90.LONG_K_CONFIG, gemm="down",
                                   row_scale=torch.empty(4096, 2, dtype=torch.float32, device=META))


def _wgrad():
    import test_moe_wgrad_sm90 as cases

    return wgrad_sm90.compile_offline(*cases._meta_dw1(), wgrad_sm90.WgradConfig())


KERNELS = {
    "fwd_d128_causal": lambda: _forward(128, 128, 2, True),
    "fwd_d64_cross": lambda: _forward(64, 128, 3, False, 2, True),
    "fwd_d64": lambda: _forward(64, 128, 2, False),
    "fwd_d256_causal_q2": lambda: _forward(256, 64, 2, True, 2),
    "bwd_d128_causal": lambda: bwd_sm90.compile_offline(128, True),
    "bwd_d64": lambda: bwd_sm90.compile_offline(64, False),
    "bwd_d192": lambda: bwd_sm90.compile_offline(192, False),
    "bwd_dq_d256": lambda: bwd_dq_sm90.compile_offline(256, False),
    "bwd_dkdv_d256_causal": lambda: bwd_sm90_hdim256.compile_offline(256, True),
    "bwd_dq_d256_causal": lambda: bwd_dq_sm90.compile_offline(256, True),
    "fwd_d128_window": lambda: _forward_features(window=(100, 20)),
    "fwd_d128_left": lambda: _forward_features(window=(100, -1)),
    "fwd_d128_softcap": lambda: _forward_features(softcap=30.0),
    "fwd_d128_alibi": lambda: _forward_features(alibi=True),
    "fwd_d128_varlen": lambda: _forward_features(varlen=True),
    "fwd_d128_varlen_causal": lambda: _forward_features(causal=True, varlen=True),
    "fwd_d128_all": lambda: _forward_features(window=(100, 20), softcap=30.0, alibi=True, varlen=True),
    "fwd_d64_varlen_causal_cross": lambda: _forward_features(64, 64, 3, True, varlen=True, q_buffers=2,
                                                             cross_item=True),
    **{f"bwd_d128_{name}": (lambda name=name: _backward_features(bwd_sm90, 128, name)) for name in BACKWARD_FEATURES},
    **{f"bwd_dkdv_d256_{name}": (lambda name=name: _backward_features(bwd_sm90_hdim256, 256, name))
       for name in BACKWARD_FEATURES},
    **{f"bwd_dq_d256_{name}": (lambda name=name: _backward_features(bwd_dq_sm90, 256, name))
       for name in BACKWARD_FEATURES},
    "fwd_d128_causal_bias_tma": lambda: fwd_sm90.compile_offline(128, True, AttentionTiles(128, 128, 8, 2), 132,
                                                             bias="tma"),
    "fwd_d128_bias_loads": lambda: fwd_sm90.compile_offline(128, False, AttentionTiles(128, 128, 8, 2), 132,
                                                        bias="loads"),
    "bwd_d128_causal_bias": lambda: bwd_sm90.compile_offline(128, offline_features(True, bias=(1, 4, 256, 256))),
    "bwd_d128_causal_bias_grad": lambda: bwd_sm90.compile_offline(
        128, offline_features(True, bias=(1, 4, 256, 256)), bias_grad="atomic"),
    "moe_dx": _dx,
    "moe_dh": _dh,
    "moe_dh_swiglu": _dh_swiglu,
    "moe_down": _down,
    "moe_wgrad": _wgrad,
}


def fingerprint(sass: str) -> tuple[str, int]:
    """(sha256 prefix, count) of the instruction lines (``/*0a10*/ ...``): addresses and opcodes, no file names."""
    lines = [line.strip() for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], len(lines)


def main(names: list[str]) -> int:
    failed = 0
    for name, build in KERNELS.items():
        if names and name not in names:
            continue
        start = time.time()
        try:
            digest, count = fingerprint(offline_sass(build()))
        except Exception as error:  # report every kernel, then fail
            failed += 1
            print(f"{name:24s} FAILED {type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}", flush=True)
            continue
        print(f"{name:24s} {digest} {count:6d} instructions {time.time() - start:5.1f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
