"""Model loading: aliases, GGUF and hub sources, our compact Llama-family model."""

from specdec.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
