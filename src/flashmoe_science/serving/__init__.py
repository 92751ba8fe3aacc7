"""`flashmoe-science serve`: transformers' OpenAI-compatible server (``transformers serve``'s FastAPI app, its
continuous batching) running a model on this library's kernels, and a load generator on the ``openai`` client.

- `model`: the served model, from a local directory or a config file with random weights, on our attention
  (varlen prefill, block-table decode: ``hf.register_flash``; optionally an e4m3 KV cache: ``hf_e4m3_cache``) and
  our MoE blocks, or on transformers' SDPA;
- `server`: the app and its lifecycle (length checks, cache statistics, a clean stop on SIGINT/SIGTERM), on
  transformers' serving internals as of 5.24 (`stack_5_24`) or 5.25 (`stack_5_25`), with what both share (`cb`);
- `load`: concurrent streams against a running server: tokens/s, time to first token, inter-token latency;
- `bench`: servers started one after the other on the same model and workload, loaded at several concurrencies.

The serving packages (fastapi, uvicorn, openai: the ``serve`` extra) are imported by these modules only; nothing
else in the library imports them.
"""
