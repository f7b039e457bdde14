"""Models written against the array API standard that thread their caches through a cache index.

``cacheidx.models.llama``: a Llama decoder (RMSNorm, rotary positions from ``index.positions()``,
grouped-query attention, SwiGLU, tied embeddings), with random weights for tiny test configs.
``cacheidx.models.gguf``: SmolLM2-135M-Instruct (or any Llama GGUF file) as float32 weights.
"""

from . import llama
from .llama import Config, empty_pools, forward, random_params

__all__ = ["Config", "empty_pools", "forward", "llama", "random_params"]
