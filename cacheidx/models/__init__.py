"""Models written against the array API standard that thread their caches through a cache index.

``cacheidx.models.llama``: a Llama decoder (RMSNorm, rotary positions from ``index.positions()``,
grouped-query attention, SwiGLU, tied embeddings), with random weights for tiny test configs.
``cacheidx.models.deltanet``: a Gated DeltaNet token mixer (Qwen3.5's linear attention) whose
states are pools under the index (:mod:`cacheidx.state`), a layer kind of the Llama decoder's
``Config(layer_types=...)``.
``cacheidx.models.gguf``: SmolLM2-135M-Instruct (or any Llama GGUF file) as float32 weights.
"""

from . import deltanet, llama
from .llama import Config, empty_pools, forward, random_params

__all__ = ["Config", "deltanet", "empty_pools", "forward", "llama", "random_params"]
