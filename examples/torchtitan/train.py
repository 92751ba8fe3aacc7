"""``torchtitan.train`` on this torch: TorchTitan 0.3.0's trainer after :func:`torch_compat.install` (which changes
nothing on a torch that has all TorchTitan uses). Same arguments as ``-m torchtitan.train``::

    PYTHONPATH=src torchrun --nproc-per-node 1 examples/torchtitan/train.py \\
        --module flashmoe_jobs --config qwen3_moe_flash --debug.seed 0 --training.steps 300
"""

import sys

import torch_compat

provided = torch_compat.install()
if provided:
    print(f"torch_compat: provided for this torch: {', '.join(provided)}", file=sys.stderr)

from torchtitan.train import main  # noqa: E402  (after install: torchtitan.train imports its FSDP module)

if __name__ == "__main__":
    main()
