"""The FP8 experts' number format, shared by the front door and planner (``fp8.py``) and the kernels
(``triton_fp8_gemm.py``): e4m3 values, 128x128 weight blocks and 1x128 activation groups (see fp8.py)."""

from flashmoe_science.fp8_format import FP8, FP8_MAX  # noqa: F401  (the kernels here read them from this module)

BLOCK = 128  # weight blocks are BLOCK x BLOCK, activation groups 1 x BLOCK
SCALE_EPS = 1e-10  # the smallest amax a group's scale is computed from (an all-zero group stays zero)
