"""The benchmark harness behind `flashmoe-science bench`.

- `bench.attention`: ours against every SDPA backend and compiled FlexAttention (`run_attention_bench`).
- `bench.moe`: the MoE layer benchmark (`run_moe_bench(quick, progress)`).
- `bench.report`: what every benchmark shares: the `Progress` bar, environment metadata, JSON files, tables, plots.

Records are flat dicts, one per measurement; a result file is the environment envelope plus the list of records.
"""
