"""What transformers' two serving stacks (`stack_5_24`, `stack_5_25`) share: the e4m3 cache in the
continuous-batching manager, and the longest request its cache and the model's positions hold."""

from __future__ import annotations

from flashmoe_science.integrations.hf_e4m3_cache import use_e4m3_cache


def prepare(manager, kv_scales) -> None:
    """Makes transformers' continuous-batching ``manager`` build an e4m3 paged cache with ``kv_scales``
    (`hf_e4m3_cache.KVScales`), when given them, before its warm-up builds the cache."""
    if kv_scales is not None:
        use_e4m3_cache(manager, kv_scales)


def request_limit(manager, model) -> tuple[int, int]:
    """(page size, most tokens of one request) of a warmed-up ``manager``: its cache's pages or the model's
    positions, whichever is fewer."""
    page_size = manager.continuous_batching_config.page_size
    capacity = manager.batch_processor.cache.num_blocks * page_size
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or capacity
    return page_size, min(capacity, positions)


def check_length(prompt: int, new: int, limit: int) -> None:
    """A 400 (FastAPI's HTTPException) naming the numbers when a request cannot fit: in transformers it would wait
    forever for pages that never come."""
    from fastapi import HTTPException

    if prompt + new > limit:
        raise HTTPException(status_code=400, detail=(
            f"the prompt ({prompt} tokens) plus max_tokens ({new}) exceeds this server's limit of {limit} tokens per "
            f"request (its KV cache and the model's positions)"))
