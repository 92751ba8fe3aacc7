"""The PyTorch reference as a backend: CPU tensors, float64, and backend="reference". It takes every call; autograd
differentiates its forward, and `attention_backward_lse` runs its textbook backward."""

from __future__ import annotations

from flashmoe_science.attention import reference
from flashmoe_science.attention.record import ran

FORWARD_KERNEL = "reference.attention_reference"
BACKWARD_KERNEL = "reference.attention_backward_reference"


class ReferenceForward:
    """`reference.attention_reference`: materialised attention, differentiable by autograd."""

    backend = "reference"
    kernel = FORWARD_KERNEL
    differentiable = True  # autograd runs through its PyTorch ops
    tiles = None

    def run(self, q, k, v, features, softmax_scale, out=None, lse=None):
        """(out, lse), copied into `out` where given (an engine's buffer: inference only)."""
        ran("forward", self.backend, self.kernel)
        result, result_lse = reference.attention_reference(q, k, v, features, softmax_scale)
        if out is None:
            return result, result_lse
        out.copy_(result)
        return out, result_lse

    def describe(self, problem, requested: str, with_features: str, declined: str) -> str:
        q = problem.q
        where = ("backend='reference' was requested" if problem.backend == "reference" else
                 "float64 has no tensor-core kernel" if q.is_cuda else f"{q.device.type} tensors run the PyTorch reference")
        return where + with_features


class ReferenceBackward:
    """`reference.attention_backward_reference`: the textbook formulas from a given out and lse."""

    backend = "reference"
    kernel = BACKWARD_KERNEL
    title = "the PyTorch reference"

    def run(self, q, k, v, out, lse, grad_out, features, softmax_scale: float):
        ran("backward", self.backend, self.kernel)
        return reference.attention_backward_reference(q, k, v, out, lse, grad_out, features, softmax_scale)


class _ReferenceAttentionBackward:
    name = "reference"
    title = "the PyTorch reference"

    def decline(self, question) -> str | None:
        return None

    def plan(self, question) -> ReferenceBackward:
        return REFERENCE_BACKWARD


class ReferenceAttention:
    """Takes every call: the last entry of every backend list."""

    name = "reference"
    title = "the PyTorch reference"
    runs_kernels = False
    policy = ("CPU tensors, float64", "PyTorch reference", "autograd through the reference")
    backward = _ReferenceAttentionBackward()

    def decline(self, problem) -> str | None:
        return None

    def plan(self, problem) -> ReferenceForward:
        return REFERENCE_FORWARD


REFERENCE_FORWARD = ReferenceForward()
REFERENCE_BACKWARD = ReferenceBackward()
REFERENCE = ReferenceAttention()
