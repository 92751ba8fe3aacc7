"""``torchtitan.train`` for this torch: TorchTitan 0.3.0's trainer, after :func:`torch_compat.install` (a no-op on
torch >= 2.12). Same arguments as ``-m torchtitan.train``::

    PYTHONPATH=src torchrun --nproc-per-node 1 examples/torchtitan/train.py \\
        --module flashmoe_jobs --config qwen3_moe_flash --debug.seed 0 --training.steps 300
"""

import torch_compat

torch_compat.install()

from torchtitan.train import main  # noqa: E402  (after install: torchtitan.train imports its FSDP module)

if __name__ == "__main__":
    main()
