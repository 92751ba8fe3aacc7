"""`flashmoe-science serve` on the CPU (our reference kernels), in a subprocess on a free port, through the openai
client: completions and chat, streaming and not, give the greedy tokens of transformers' own `generate_batch`
(paged eager attention) on the same random weights; a stream closed by the client gives its cache pages back; a
request longer than the cache gets a 400 and the server goes on; the load generator measures it; SIGTERM stops it
with exit status 0, even with a stream open. With ``--kv-cache-dtype e4m3`` the cache holds one byte a value and the
served tokens are those of a float64 oracle whose attention sees the keys and values rounded through e4m3 with the
server's scales. A missing model, an unsupported transformers and an e4m3 cache on the SDPA backend are one-line
errors. The module skips where the installed transformers is outside the supported range."""

import json
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flashmoe_science.serving.bench import ServerProcess, free_port  # noqa: E402
from flashmoe_science.serving.load import run_load, summarize  # noqa: E402
from flashmoe_science.serving.model import load_model, token_ids, words  # noqa: E402
from supported import supported  # noqa: E402

pytestmark = supported("transformers-cb")
CACHE_TOKENS, PAGE_SIZE, POSITIONS = 1024, 16, 512


def tiny_config(path):
    import transformers

    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=POSITIONS)
    path.write_text(config.to_json_string())
    return str(path)


def start_server(folder, device="cpu", *options):
    """`flashmoe-science serve` of a tiny float32 random model in a subprocess, ready, with an openai client."""
    config = tiny_config(folder / "config.json")
    port = free_port()
    command = [sys.executable, "-m", "flashmoe_science.cli", "serve", config, "--port", str(port), "--device", device,
               "--dtype", "float32", "--cache-tokens", str(CACHE_TOKENS), "--page-size", str(PAGE_SIZE),
               "--max-batch-tokens", "256", *options]
    process = ServerProcess(command, port, folder / "server.log")
    try:
        process.wait_ready(timeout_s=240)
    except RuntimeError:
        process.stop()
        raise RuntimeError((folder / "server.log").read_text()[-3000:])
    process.config, process.device = config, device
    process.client = openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return process


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = start_server(tmp_path_factory.mktemp("serve"))
    yield process
    process.stop()


def reference_tokens(config, prompts, max_new_tokens, device="cpu"):
    """Greedy tokens of transformers' continuous batching with its own paged eager attention, same weights."""
    import transformers

    from flashmoe_science.integrations import hf

    model, _ = load_model(config, "transformers-sdpa", device, "float32", seed=0)
    model.set_attn_implementation("paged|eager")
    generation = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)
    outputs = model.generate_batch(inputs=prompts, generation_config=generation, warmup=False,
                                   continuous_batching_config=hf.continuous_batching_config(
                                       PAGE_SIZE, num_blocks=64, max_batch_tokens=256))
    return [list(o.generated_tokens) for o in outputs.values()]


PROMPTS = [[1, 5, 9, 22, 7], [3, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 11, 40, 2, 19, 20, 21, 22, 90, 91]]
NEW = 6


def test_the_server_runs_our_attention(server):
    stats = httpx.get(f"{server.url}/cache").json()
    assert stats["attn_implementation"] == "fmoe_science_flash_attn3", stats
    assert stats["pages"] * stats["page_size"] >= CACHE_TOKENS and stats["max_request_tokens"] == POSITIONS


def test_completions_give_generate_batch_tokens(server):
    check_completions(server)


def check_completions(server):
    want = reference_tokens(server.config, PROMPTS, NEW, server.device)
    for prompt, tokens in zip(PROMPTS, want):
        plain = server.client.completions.create(model=server.config, prompt=words(prompt), max_tokens=NEW)
        assert token_ids(plain.choices[0].text) == tokens
        assert plain.usage.prompt_tokens == len(prompt) and plain.usage.completion_tokens == NEW
        chunks = server.client.completions.create(model=server.config, prompt=words(prompt), max_tokens=NEW,
                                                  stream=True)
        assert token_ids("".join(c.choices[0].text for c in chunks if c.choices)) == tokens


def test_chat_completions_give_generate_batch_tokens(server):
    """The word tokenizer's chat template is the messages' text, so a chat is the same prompt."""
    want = reference_tokens(server.config, PROMPTS[:1], NEW)[0]
    messages = [{"role": "user", "content": words(PROMPTS[0])}]
    reply = server.client.chat.completions.create(model=server.config, messages=messages, max_tokens=NEW)
    assert token_ids(reply.choices[0].message.content) == want
    stream = server.client.chat.completions.create(model=server.config, messages=messages, max_tokens=NEW,
                                                   stream=True)
    assert token_ids("".join(c.choices[0].delta.content or "" for c in stream if c.choices)) == want


def _cache(server) -> dict:
    return httpx.get(f"{server.url}/cache").json()


def test_a_closed_stream_gives_its_pages_back(server):
    stream = server.client.completions.create(model=server.config, prompt=words(range(1, 60)), max_tokens=300,
                                              stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    held = _cache(server)
    assert held["requests_active"] == 1 and held["free_fraction"] + held["reusable_fraction"] < 1, held
    stream.close()
    deadline = time.monotonic() + 30
    while (stats := _cache(server))["requests_active"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["requests_active"] == 0 and stats["requests_waiting"] == 0, stats
    assert stats["free_fraction"] + stats["reusable_fraction"] == pytest.approx(1.0), stats


def test_a_prompt_longer_than_the_limit_gets_a_400_and_the_server_goes_on(server):
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.completions.create(model=server.config, prompt=words([3] * (POSITIONS - 2)), max_tokens=8)
    assert refused.value.status_code == 400
    assert f"limit of {POSITIONS} tokens" in json.dumps(refused.value.body), refused.value.body
    reply = server.client.completions.create(model=server.config, prompt=words([1, 2]), max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_the_load_generator_measures_concurrent_streams(server):
    prompts = [words(p) for p in PROMPTS + PROMPTS[:1]]
    lines = run_load(server.url, server.config, prompts, max_tokens=5, concurrency=2)
    summary = summarize(lines)
    assert summary["errors"] == 0 and summary["requests"] == 4, summary
    assert summary["completion_tokens"] == 20 and summary["prompt_tokens"] == sum(map(len, PROMPTS + PROMPTS[:1]))
    assert 0 < summary["ttft_ms_p50"] <= summary["ttft_ms_p99"] and summary["tokens_per_s"] > 0
    # a stream that fell behind gets its tokens' texts joined in one event (transformers' serve merges what is
    # queued), so the events are 1 to 5 and their text is the 5 tokens
    assert all(1 <= len(line.chunks) <= 5 and len(token_ids(line.text)) == 5 for line in lines)
    paced = run_load(server.url, server.config, prompts, max_tokens=2, concurrency=4, rate=10.0)
    sends = sorted(line.sent for line in paced)
    # request i leaves at the start + i / rate: one sent late narrows its gap to the next (a loaded machine: 88 ms),
    # the span of the four stays 0.3 s less the first one's lateness (unpaced, four streams leave together)
    assert summarize(paced)["errors"] == 0 and sends[-1] - sends[0] >= 0.25


def e4m3_oracle_tokens(config, prompts, new_tokens, device="cpu"):
    """The served model's greedy tokens with its keys and values rounded as the server's e4m3 cache holds them
    (the same weights, and the same scales: calibrated the same way on them)."""
    from integrations.e4m3_oracle import oracle

    from flashmoe_science.integrations.hf_e4m3_cache import calibrate_scales

    model, _ = load_model(config, "flashmoe", device, "float32", seed=0)
    return oracle(model, prompts, new_tokens, calibrate_scales(model, seed=0))


def check_e4m3_server(folder, device="cpu"):
    process = start_server(folder, device, "--kv-cache-dtype", "e4m3")
    try:
        stats = _cache(process)
        one_byte_a_value = stats["pages"] * stats["page_size"] * 2 * 2 * 2 * 16  # layers, k/v, KV heads, head dim
        assert stats["kv_cache_dtype"] == "e4m3" and stats["cache_bytes"] == one_byte_a_value, stats
        want = e4m3_oracle_tokens(process.config, PROMPTS, NEW, device)
        for prompt, tokens in zip(PROMPTS, want):
            chunks = process.client.completions.create(model=process.config, prompt=words(prompt), max_tokens=NEW,
                                                       stream=True)
            assert token_ids("".join(c.choices[0].text for c in chunks if c.choices)) == tokens
    finally:
        assert process.stop() == 0


def test_an_e4m3_kv_cache_serves_the_tokens_of_its_rounded_keys_and_values(tmp_path):
    check_e4m3_server(tmp_path)


def test_sigterm_stops_the_server_with_a_stream_open(server):
    opened = threading.Event()

    def long_stream():
        try:
            for _ in server.client.completions.create(model=server.config, prompt=words([5, 6]), max_tokens=400,
                                                      stream=True):
                opened.set()
        except Exception:  # the server goes away under it
            pass

    reader = threading.Thread(target=long_stream, daemon=True)
    reader.start()
    assert opened.wait(60)
    started = time.monotonic()
    assert server.stop(timeout_s=60) == 0
    assert time.monotonic() - started < 30


def test_serve_bench_writes_records_and_a_plot(tmp_path):
    """`flashmoe-science serve-bench` end to end on one backend: a server started and stopped (status 0), a record
    per concurrency with every request done, the JSON and the PNG."""
    from flashmoe_science.cli import main

    config = tiny_config(tmp_path / "config.json")
    # 16 new tokens: on a loaded machine a stream may deliver several tokens in one chunk, and ITL needs two chunks
    new_tokens = 16
    status = main(["serve-bench", config, "--backends", "flashmoe", "--kv-cache-dtypes", "auto,e4m3",
                   "--concurrency", "1,3", "--requests", "2,3", "--prompt-tokens", "4:30", "--new-tokens",
                   str(new_tokens),
                   "--cache-tokens", "1024", "--page-size", "16", "--max-batch-tokens", "256",
                   "--out", str(tmp_path / "out"), "--commit", "test"])
    assert status == 0
    results = list((tmp_path / "out").glob("*.json"))
    records = json.loads(results[0].read_text())["records"]
    assert [(r["op"], r["backend"], r["kv_cache_dtype"], r["concurrency"], r["requests"]) for r in records] == [
        ("serve", "flashmoe", dtype, concurrency, requests) for dtype in ("auto", "e4m3")
        for concurrency, requests in ((1, 2), (3, 3))]
    assert all(r["errors"] == 0 and r["completion_tokens"] == new_tokens * r["requests"]
               and r["server_exit_status"] == 0
               for r in records)
    assert records[0]["cache_bytes"] == 4 * records[2]["cache_bytes"]  # float32 against one byte a value
    assert all(r["tokens_per_s"] > 0 and r["itl_ms_p50"] is not None for r in records)
    assert results[0].with_suffix(".png").exists()


@pytest.mark.gpu
def test_on_cuda_completions_give_generate_batch_tokens(tmp_path):
    """On CUDA continuous batching takes the block-table decode (and CUDA graphs): the served tokens still equal
    transformers' paged eager ones on the same float32 weights."""
    process = start_server(tmp_path, device="cuda")
    try:
        check_completions(process)
    finally:
        assert process.stop() == 0


@pytest.mark.gpu
def test_on_cuda_an_e4m3_kv_cache_serves_the_tokens_of_its_rounded_keys_and_values(tmp_path):
    """The block-table decode kernel on the e4m3 pages with their scales, and the e4m3 prefill writes, under CUDA
    graphs: the tokens of the float64 oracle on the same rounding."""
    check_e4m3_server(tmp_path, device="cuda")


def test_serve_bench_plans_every_model_backend_and_cache(tmp_path):
    """One server per model, backend and (flashmoe only) KV-cache dtype, model by model, each served under its file
    name; requests per run: one number for all concurrencies or one each, else refused; --cache-gib likewise, one
    number for all models or one each."""
    import argparse

    from flashmoe_science.cli import build_parser
    from flashmoe_science.serving.bench import (add_bench_arguments, cache_gib_of, requests_per_run, serve_command,
                                                servers)

    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    add_bench_arguments(parser)
    args = parser.parse_args(["a/dense.json", "b/moe.json", "--kv-cache-dtypes", "auto,e4m3", "--requests", "2,8,64"])
    assert servers(args) == [(model, backend, dtype) for model in ("a/dense.json", "b/moe.json")
                             for backend, dtype in (("flashmoe", "auto"), ("flashmoe", "e4m3"),
                                                    ("transformers-sdpa", "auto"))]
    options = dict(page_size=16, cache_tokens=64, cache_gib=None, max_batch_tokens=32, seed=0, device=None,
                   dtype=None, no_cuda_graphs=True)
    command = serve_command("a/dense.json", "flashmoe", "e4m3", 1234, argparse.Namespace(**options))
    assert command[command.index("--served-model-name") + 1] == "dense"
    assert command[command.index("--kv-cache-dtype") + 1] == "e4m3"
    assert command[command.index("--cache-tokens") + 1] == "64" and "--cache-gib" not in command
    def bench_args(*argv):
        return build_parser().parse_args(["serve-bench", *argv])

    command = serve_command("b/moe.json", "flashmoe", "e4m3", 1234, bench_args("a/dense.json", "b/moe.json",
                                                                                 "--cache-gib", "0.5"))
    assert command[command.index("--cache-gib") + 1] == "0.5" and "--cache-tokens" not in command
    gib_args = bench_args("a/dense.json", "b/moe.json", "--cache-gib", "4,1")  # one per model
    assert [cache_gib_of(gib_args, model) for model in gib_args.models] == [4.0, 1.0]
    command = serve_command("b/moe.json", "flashmoe", "auto", 1234, gib_args)
    assert command[command.index("--cache-gib") + 1] == "1.0"
    with pytest.raises(ValueError, match="--cache-gib: one number or one per model"):
        cache_gib_of(bench_args("m", "--cache-gib", "4,1"), "m")
    assert cache_gib_of(bench_args("m"), "m") is None
    assert requests_per_run(args) == [2, 8, 64]
    assert requests_per_run(parser.parse_args(["m", "--requests", "3"])) == [3, 3, 3]
    assert requests_per_run(parser.parse_args(["m", "--concurrency", "1,64"])) == [4, 128]
    with pytest.raises(ValueError, match="one number or one per concurrency"):
        requests_per_run(parser.parse_args(["m", "--requests", "3,4"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--kv-cache-dtypes", "fp16"])


def test_process_running_counts_an_exited_unreaped_child_as_exited():
    """What `serve-bench --after-pid` waits on: a running process, then the same process exited but not yet reaped
    by its parent (a zombie), then gone."""
    import os
    import subprocess

    from flashmoe_science.serving.bench import process_running

    assert process_running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert process_running(child.pid)
    child.stdin.close()
    deadline = time.monotonic() + 30
    while process_running(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_running(child.pid)  # exited; the zombie is still there until the wait below
    child.wait()
    assert not process_running(child.pid)


def test_bad_command_input_is_one_line(tmp_path, capsys, monkeypatch):
    from flashmoe_science.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "MODEL_OR_CONFIG must be a model directory" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", tiny_config(tmp_path / "config.json"), "--device", "cuda"]) == 2
    assert capsys.readouterr().err.endswith("--device cuda: there is no CUDA device here "
                                            "(torch.cuda.is_available() is False); use --device cpu\n")


def test_an_e4m3_cache_on_the_sdpa_backend_is_refused(tmp_path, capsys):
    from flashmoe_science.cli import main

    config = tiny_config(tmp_path / "config.json")
    assert main(["serve", config, "--backend", "transformers-sdpa", "--kv-cache-dtype", "e4m3"]) == 2
    assert "--kv-cache-dtype e4m3 needs --backend flashmoe" in capsys.readouterr().err


def test_an_unsupported_transformers_is_refused_by_name(monkeypatch, capsys):
    from flashmoe_science.cli import main
    from flashmoe_science.integrations import versions

    monkeypatch.setattr(versions, "installed", lambda distribution: "5.99.0")
    assert main(["serve", "config.json"]) == 2
    error = capsys.readouterr().err
    assert "installed: transformers 5.99.0;" in error and 'pip install "transformers>=5.24,<5.26"' in error


def test_a_cache_sized_in_gib_holds_the_tokens_of_its_dtype(tmp_path):
    """--cache-gib: keys and values of every layer's KV heads per token, one byte a value for e4m3 (twice a bf16
    cache's tokens in the same memory); what cannot hold a token, or is not a positive number, is refused."""
    import transformers

    from flashmoe_science.serving.model import cache_tokens_in

    config = transformers.AutoConfig.from_pretrained(tiny_config(tmp_path / "config.json"))
    per_token_bf16 = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads, head dim 16, 2 bytes
    assert cache_tokens_in(1, config, "auto", torch.bfloat16) == 2**30 // per_token_bf16
    assert cache_tokens_in(1, config, "e4m3", torch.bfloat16) == 2 * (2**30 // per_token_bf16)
    assert cache_tokens_in(1, config, "auto", torch.float32) == 2**30 // (2 * per_token_bf16)
    with pytest.raises(ValueError, match="holds no token"):
        cache_tokens_in(1e-9, config, "auto", torch.bfloat16)
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="--cache-gib must be a positive number"):
            cache_tokens_in(bad, config, "auto", torch.bfloat16)


def test_cache_tokens_and_cache_gib_are_exclusive(tmp_path, capsys):
    from flashmoe_science.cli import main

    config = tiny_config(tmp_path / "config.json")
    with pytest.raises(SystemExit):
        main(["serve", config, "--cache-tokens", "64", "--cache-gib", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("kv_cache_dtype,tokens", [("auto", 512), ("e4m3", 2048)])
def test_a_server_sized_in_gib_has_the_pages_of_that_memory(tmp_path, kv_cache_dtype, tokens):
    """`serve --cache-gib` builds a cache of the tokens that memory holds (float32 here: 512 bytes a token of the
    tiny model; e4m3: 128 bytes, four times the tokens and pages in the same bytes), in pages of --page-size, as
    /cache reports."""
    config = tiny_config(tmp_path / "config.json")
    port = free_port()
    gib = 2**-12  # 262144 bytes
    command = [sys.executable, "-m", "flashmoe_science.cli", "serve", config, "--port", str(port), "--device", "cpu",
               "--dtype", "float32", "--cache-gib", str(gib), "--page-size", str(PAGE_SIZE),
               "--max-batch-tokens", "256", "--kv-cache-dtype", kv_cache_dtype]
    process = ServerProcess(command, port, tmp_path / "server.log")
    try:
        process.wait_ready(timeout_s=240)
        cache = httpx.get(f"{process.url}/cache").json()
        assert (cache["pages"], cache["cache_bytes"], cache["kv_cache_dtype"]) == (
            tokens // PAGE_SIZE, 2**18, "float32" if kv_cache_dtype == "auto" else "e4m3")
    finally:
        process.stop()
