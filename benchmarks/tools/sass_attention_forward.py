"""Compile the Gluon sm_90 attention forward on a machine without a GPU (ptxas ships with triton) and report
registers, shared memory, spills and the SASS instruction mix. Catches compile errors before using GPU time.

    PYTHONPATH=src:benchmarks/tools python benchmarks/tools/sass_attention_forward.py [--sass out.sass] [--q-buffers N] [--cross-item]
        [--window L R] [--softcap C] [--alibi] [--varlen] [--consumers 2|3] D BLOCK_N STAGES CAUSAL

Besides the whole kernel's counts it prints each consumer's key-tile loop (`gluon.build.sass_loops`: the SASS
between a backward branch and its target that holds HGMMAs): its instructions, spills and exp2s per 64 query rows
and key tile, the numbers to compare between two and three consumers.
"""
import argparse

import torch

from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.tiles import AttentionTiles
from flashmoe_science.gluon.build import sass_loops
from sass_tools import sass_counts


def compile_once(d, bn, stages, causal, dtype=torch.bfloat16, q_buffers=1, cross_item=False, window=None,
                 softcap=None, alibi=False, varlen=False, consumers=2):
    tiles = AttentionTiles(64 * consumers, bn, 4 * consumers, stages, use_tma=True)
    return fwd_sm90.compile_offline(d, causal, tiles, None, q_buffers, cross_item, dtype,
                                    mask=make_mask(causal, window, softcap), alibi=alibi, varlen=varlen)


def sweep(head_dims=(128,)):
    """Every mask/feature constexpr combination of the forward at each head dim's tiles (non-causal and causal
    plans): prints one line each; raises on the first that does not build."""
    import itertools

    from flashmoe_science.attention.hopper.tiles import sm90_forward_tiles

    masks = {"none": (False, None), "causal": (True, None), "window": (False, (100, 20)), "left": (False, (100, -1)),
             "causal_window": (True, (100, -1))}
    for d, (name, (causal, window)), softcap, alibi, varlen in itertools.product(
            head_dims, masks.items(), (None, 30.0), (False, True), (False, True)):
        t = sm90_forward_tiles(d, causal or window is not None and window[1] >= 0, 4096)
        k = compile_once(d, t.block_n, t.num_stages, causal, window=window, softcap=softcap, alibi=alibi,
                         varlen=varlen)
        _, counts = sass_counts(k.asm["cubin"])
        print(f"D{d} {name} softcap{int(bool(softcap))} alibi{int(alibi)} varlen{int(varlen)}: smem "
              f"{k.metadata.shared} LDL {counts['LDL']} STL {counts['STL']}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sass")
    p.add_argument("--q-buffers", type=int, default=1)
    p.add_argument("--cross-item", action="store_true")
    p.add_argument("--window", type=int, nargs=2)
    p.add_argument("--softcap", type=float)
    p.add_argument("--alibi", action="store_true")
    p.add_argument("--varlen", action="store_true")
    p.add_argument("--sweep", action="store_true", help="build every mask/feature combination (slow)")
    p.add_argument("--consumers", type=int, default=2, help="consumer warpgroups (64 query rows each)")
    p.add_argument("config", nargs="*", type=int, default=[128, 128, 2, 0], help="D BLOCK_N STAGES CAUSAL")
    a = p.parse_args()
    if a.sweep:
        sweep()
        raise SystemExit
    d, bn, st, c = a.config
    k = compile_once(d, bn, st, bool(c), q_buffers=a.q_buffers, cross_item=a.cross_item, window=a.window,
                     softcap=a.softcap, alibi=a.alibi, varlen=a.varlen, consumers=a.consumers)
    sass, counts = sass_counts(k.asm["cubin"])
    print(f"D{d} {64 * a.consumers}x{bn} stages{st} causal{c} qbuf{a.q_buffers} cross{int(a.cross_item)} "
          f"window{a.window} softcap{a.softcap} alibi{int(a.alibi)} varlen{int(a.varlen)}: smem {k.metadata.shared} "
          f"| {counts}")
    # one key tile per iteration: two products (S: D/16 HGMMAs, P·V: BLOCK_N/16), each consumer's loop on 64 rows
    per_tile = d // 16 + bn // 16
    for loop in sass_loops(sass):
        if loop["HGMMA"] == per_tile:
            print(f"key loop {loop['start']:#x}-{loop['end']:#x}: {loop['instructions']} instructions per 64 rows and "
                  f"key tile, MUFU.EX2 {loop['MUFU.EX2']}, LDL {loop['LDL']}, STL {loop['STL']}")
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)

