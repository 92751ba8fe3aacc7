"""Integrations: Hugging Face transformers (``hf``), TorchTitan (``torchtitan``), the ``flash_attn`` interface
(``flash_attn_interface``). The torch.compile custom ops live beside the front doors that call them
(``custom_ops`` says where).
"""
