"""One decision per cache call: `plan_decode` walks `DECODE_BACKENDS` with `backends.choose` (a dense chunk, the
Triton cache kernels, the reference) and returns the family's plan with why the ones before declined."""

from __future__ import annotations

from flashmoe_science.attention.decode.dense_backend import DENSE
from flashmoe_science.attention.decode.problem import DecodeCall, DecodeProblem
from flashmoe_science.attention.decode.reference_backend import REFERENCE
from flashmoe_science.attention.decode.triton_backend import TRITON
from flashmoe_science.backends import Choice, choose

# The ordered backend list of decode calls (walked by backends.choose, as every attention call's).
DECODE_BACKENDS = (DENSE, TRITON, REFERENCE)
BACKENDS = ("auto", *(b.name for b in DECODE_BACKENDS))


def plan_decode(problem: DecodeProblem, q, num_splits="auto", backend: str = "auto") -> Choice:
    """The decode backend that runs a checked call, its plan (tiles, splits) and why the ones before declined."""
    return choose(DECODE_BACKENDS, DecodeCall(problem, q, num_splits), backend)
