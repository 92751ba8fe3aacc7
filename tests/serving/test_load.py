"""The load generator's statistics on hand-made timelines (no server): nearest-rank percentiles, throughput over
the whole run, TTFT from the send, ITL between chunks, TPOT per request, errors counted apart."""

import pytest

from flashmoe_science.serving.load import Timeline, percentile, summarize


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


def test_summary_of_two_requests_and_an_error():
    lines = [Timeline(sent=0.0, chunks=[0.5, 0.6, 0.8], ended=0.8, prompt_tokens=10, completion_tokens=3),
             Timeline(sent=0.2, chunks=[1.2, 1.3], ended=2.0, prompt_tokens=4, completion_tokens=2),
             Timeline(sent=0.3, ended=0.4, error="APIError: boom")]
    summary = summarize(lines)
    assert summary["requests"] == 3 and summary["errors"] == 1 and summary["error_examples"] == ["APIError: boom"]
    assert summary["completion_tokens"] == 5 and summary["prompt_tokens"] == 14
    assert summary["seconds"] == 2.0 and summary["tokens_per_s"] == 2.5
    assert summary["ttft_ms_p50"] == pytest.approx(500) and summary["ttft_ms_p99"] == pytest.approx(1000)
    # gaps 100, 200 (first request) and 100 (second): p50 100 ms, p99 200 ms
    assert summary["itl_ms_p50"] == pytest.approx(100) and summary["itl_ms_p99"] == pytest.approx(200)
    # TPOT: (0.8 - 0.5) / 2 = 150 ms and (2.0 - 1.2) / 1 = 800 ms
    assert summary["tpot_ms_p50"] == pytest.approx(150)


@pytest.mark.parametrize("kwargs,message", [(dict(concurrency=0), "concurrency"), (dict(rate=0.0), "rate")])
def test_bad_load_arguments(kwargs, message):
    from flashmoe_science.serving.load import run_load

    options = dict(concurrency=1, rate=None) | kwargs
    with pytest.raises(ValueError, match=message):
        run_load("http://127.0.0.1:9", "m", ["t1"], 1, **options)

