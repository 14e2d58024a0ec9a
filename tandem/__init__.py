"""Tandem: multimodal LLM serving with a scheduler and workers sharing a feature segment."""

__version__ = "0.1.0"
