"""The README's two-rank snippet (ring attention and expert-parallel MoE, forward and backward) on gloo, ending in
`destroy_process_group`: run by test_shutdown.py as two processes, each of which must exit 0. Before the shutdown it
checks that the autograd graphs refer to the default group as None, never to the group's object (which would keep
the group alive until the interpreter's exit, where gloo's teardown aborts)."""

import torch
import torch.distributed as dist

from flashmoe_science.distributed import ExpertParallelMoE, ring_attention, zigzag_shard, zigzag_unshard


def custom_nodes(tensor):
    """The nodes of ``tensor``'s autograd graph that carry a ring or an exchange (our distributed Functions)."""
    seen, stack, found = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "ring") or hasattr(node, "exchange"):
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    q, k, v = (zigzag_shard(torch.randn(1, 2, 96, 16)).requires_grad_() for _ in range(3))
    out = ring_attention(q, k, v, causal=True)
    moe = ExpertParallelMoE(d_model=32, d_ff=16, num_experts=8, top_k=2)
    y = moe(torch.randn(10, 32, requires_grad=True))
    (ring_node,), (moe_node,) = custom_nodes(out), custom_nodes(y)
    assert ring_node.ring.group is None and moe_node.exchange.group is None
    (out.sum() + y.sum()).backward()
    assert ring_node.ring is None and moe_node.exchange is None  # spent
    assert zigzag_unshard(out.detach()).shape == (1, 2, 96, 16)
    dist.destroy_process_group()  # out, y and their graphs stay alive until the interpreter exits


if __name__ == "__main__":
    main()
