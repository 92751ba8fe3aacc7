"""Integrations: torch.compile custom ops (``ops``, registered on import) and Hugging Face transformers (``hf``)."""

from flashmoe_science.integrations import ops

__all__ = ["ops"]
