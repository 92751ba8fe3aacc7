"""A load generator on the ``openai`` client: streaming completions against an OpenAI-compatible server.

Requests are sent closed-loop (``concurrency`` streams, each sending its next request when the last one ends) or at a
fixed rate (``rate`` requests per second, at most ``concurrency`` in flight). Each streamed request records when it
was sent, when each chunk of text arrived and the token counts of the server's final usage chunk (asked for with
``stream_options``). From those:

- throughput: completion tokens of all requests / (last end - first send);
- time to first token (TTFT): first text chunk - send, per request;
- inter-token latency (ITL): the gaps between consecutive text chunks of a request, which is what a client sees (a
  server sends one chunk per token while it keeps up; transformers' serve joins the texts of a stream that fell
  behind into one chunk);
- time per output token (TPOT): (end - first token) / (tokens - 1), per request.

Percentiles are the nearest-rank p50 and p99 over all requests (TTFT, TPOT) or all gaps (ITL). A request that
raises, returns no text, or streams an error chunk counts as an error, with its message kept.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field


@dataclass
class Timeline:
    """One request as the client saw it (seconds from `time.perf_counter`)."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    ended: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""
    error: str | None = None


def percentile(values, q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0..100) of ``values``; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def _stream(client, model: str, prompt: str, max_tokens: int) -> Timeline:
    line = Timeline(sent=time.perf_counter())
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                if choice.text:
                    line.chunks.append(now)
                    line.text += choice.text
            if chunk.usage is not None:
                line.prompt_tokens, line.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            error = getattr(chunk, "error", None) or (chunk.model_extra or {}).get("error")
            if error:
                line.error = str(error)
    except Exception as error:  # counted, not raised: a load test reports its failures
        line.error = f"{type(error).__name__}: {error}"
    line.ended = time.perf_counter()
    if line.error is None and not line.chunks:
        line.error = "no text streamed"
    return line


async def _run(base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
               rate: float | None, timeout_s: float) -> list[Timeline]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(index: int, prompt: str) -> Timeline:
        if rate is not None:
            await asyncio.sleep(max(0.0, start + index / rate - time.perf_counter()))
        async with gate:
            return await _stream(client, model, prompt, max_tokens)

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await client.close()


def run_load(base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
             rate: float | None = None, timeout_s: float = 600.0) -> list[Timeline]:
    """Sends every prompt once as a streaming completion (greedy, ``max_tokens`` new tokens) with ``concurrency``
    streams, closed loop or at ``rate`` requests/s; returns each request's `Timeline`, in the order of
    ``prompts``."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    return asyncio.run(_run(base_url, model, prompts, max_tokens, concurrency, rate, timeout_s))


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def summarize(lines: list[Timeline]) -> dict:
    """Throughput, TTFT / ITL / TPOT percentiles and errors of one load run (the module docstring's definitions)."""
    done = [line for line in lines if line.error is None]
    tokens = sum(line.completion_tokens or len(line.chunks) for line in done)
    span = max((line.ended for line in lines), default=0.0) - min((line.sent for line in lines), default=0.0)
    ttft = [line.chunks[0] - line.sent for line in done]
    gaps = [b - a for line in done for a, b in zip(line.chunks, line.chunks[1:])]
    tpot = [(line.ended - line.chunks[0]) / (n - 1) for line in done
            if (n := line.completion_tokens or len(line.chunks)) > 1]
    errors = [line.error for line in lines if line.error is not None]
    return {"requests": len(lines), "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "completion_tokens": tokens, "prompt_tokens": sum(line.prompt_tokens or 0 for line in done),
            "seconds": round(span, 3), "tokens_per_s": round(tokens / span, 2) if span > 0 else None,
            "ttft_ms_p50": _ms(percentile(ttft, 50)), "ttft_ms_p99": _ms(percentile(ttft, 99)),
            "itl_ms_p50": _ms(percentile(gaps, 50)), "itl_ms_p99": _ms(percentile(gaps, 99)),
            "tpot_ms_p50": _ms(percentile(tpot, 50))}
