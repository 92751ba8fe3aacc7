"""`flashmoe-science serve`: transformers' OpenAI-compatible server (``transformers serve``'s FastAPI app, its
continuous batching) running a model on this library's kernels, and a load generator on the ``openai`` client.

- `model`: the served model, from a local directory or a config file with random weights, on our attention
  (varlen prefill, block-table decode: ``hf.register_flash``; optionally an e4m3 KV cache: ``hf_e4m3_cache``) and
  our MoE blocks, or on transformers' SDPA;
- `server`: the app and its lifecycle (length checks, cache statistics, a clean stop on SIGINT/SIGTERM);
- `load`: concurrent streams against a running server: tokens/s, time to first token, inter-token latency;
- `bench`: servers started one after the other on the same model and workload, loaded at several concurrencies.

The serving packages (fastapi, uvicorn, openai: the ``serve`` extra) are imported by these modules only; nothing
else in the library imports them.
"""
