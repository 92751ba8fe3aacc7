"""The reference decode family: `decode_reference` (PyTorch; the CPU path, float64, and backend="reference")."""

from __future__ import annotations

from flashmoe_science.attention.decode.problem import CacheCall, DecodeCall, DecodeProblem
from flashmoe_science.attention.decode.reference import decode_reference
from flashmoe_science.attention.record import ran


class ReferenceDecode:
    """`decode_reference`: the CPU path, float64, and backend="reference"."""

    backend = "reference"
    kernel = "decode.decode_reference"

    def run(self, call: CacheCall, problem: DecodeProblem):
        ran("forward", self.backend, self.kernel)
        return decode_reference(call.q, call.k_cache, call.v_cache, call.ends, problem, call.block_table, call.k_new,
                                call.v_new, call.rotary_cos, call.rotary_sin, call.rotary_interleaved,
                                call.alibi_slopes, cache_starts=call.starts, cache_batch_idx=call.cache_rows,
                                cu_seqlens_q=call.cu_seqlens_q, k_scale=call.k_scale, v_scale=call.v_scale)


class ReferenceDecodeFamily:
    """Takes every call."""

    name = "reference"

    def decline(self, call: DecodeCall) -> str | None:
        return None

    def plan(self, call: DecodeCall) -> ReferenceDecode:
        return ReferenceDecode()


REFERENCE = ReferenceDecodeFamily()
