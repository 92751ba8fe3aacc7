"""GPU time of the token sort: one launch (_sort_one_chunk, where one chunk holds every pair) against the three
launches (count, scan, scatter), each captured in a CUDA graph and replayed (do_bench median, host time excluded).

    PYTHONPATH=src python scripts/ab_sort.py
"""
import torch
import triton.testing

from flashmoe_science.moe.dispatch import _sort_sizes, flat_ids, sort_buffers, sort_launches

CASES = [("mixtral T=1", 1, 2, 8), ("mixtral T=16", 16, 2, 8), ("mixtral T=64", 64, 2, 8),
         ("qwen3 T=1", 1, 8, 128), ("qwen3 T=16", 16, 8, 128)]


def graph_us(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3


def main():
    for name, num_tokens, top_k, num_experts in CASES:
        ids = torch.topk(torch.randn(num_tokens, num_experts, device="cuda"), top_k).indices
        block_m = 16
        sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, block_m, ids.device)
        one = sort_launches(flat_ids(ids), sort, None, None)
        _, _, num_chunks, _ = _sort_sizes(num_tokens * top_k, num_experts, block_m)
        three_sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, block_m, ids.device)
        counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device="cuda")
        three_sort.sorted_pair_ids.fill_(num_tokens * top_k)
        three = sort_launches(flat_ids(ids), three_sort, counts, torch.empty_like(counts))

        def run_one():
            for launch in one:
                launch()

        def run_three():
            three_sort.sorted_pair_ids.fill_(num_tokens * top_k)  # (sort_buffers' torch.full)
            for launch in three:
                launch()

        t_one, t_three = graph_us(run_one), graph_us(run_three)
        same = all(torch.equal(getattr(sort, f), getattr(three_sort, f))
                   for f in ("sorted_pair_ids", "pair_row", "tile_expert", "expert_counts", "expert_row_start"))
        print(f"{name:14s} one launch {t_one:6.2f} us | three launches + fill {t_three:6.2f} us | same result {same}")


if __name__ == "__main__":
    main()
