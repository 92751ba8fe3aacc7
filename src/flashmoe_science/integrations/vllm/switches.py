"""The environment switches of the vLLM plugin (no vLLM import: the plugin entry and the CPU tests read them)."""

# "1": the plugin's ``register()`` replaces vLLM's kernel for unquantized MoE layers by ours (integrations/vllm/moe.py).
MOE_SWITCH = "FLASHMOE_SCIENCE_VLLM_MOE"
