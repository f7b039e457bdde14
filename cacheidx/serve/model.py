"""The engine's one model call. A model for the engine places its weights, makes its pools and
computes the last token's logits of every lane of a call through a cache index; a variant (a
tensor-parallel decoder, a test's checking model) is another class with these three methods."""

from __future__ import annotations

from typing import Any, Protocol

from ..models import llama

__all__ = ["LlamaModel", "Model"]


class Model(Protocol):
    def place(self, xp: Any, device: Any) -> Any:
        """The weights as arrays of namespace ``xp`` on ``device``."""

    def pools(self, weights: Any, slots: int) -> Any:
        """Empty pools of ``slots`` slots beside ``weights`` (a list of tuples of arrays)."""

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        """``(logits, pools)``: ``logits`` ``[batch, vocab]`` of each lane's last token of
        ``tokens`` ``[batch, seq]``, placed by ``index``; the pools after its stores (given
        up: the call may write into them)."""


class LlamaModel:
    """A Llama decoder (:mod:`cacheidx.models.llama`) with float32 NumPy ``params``."""

    def __init__(self, config: llama.Config, params: Any):
        self.config, self.params = config, params

    def place(self, xp: Any, device: Any) -> Any:
        return llama.convert(self.params, xp=xp, device=device)

    def pools(self, weights: Any, slots: int) -> Any:
        return llama.empty_pools(self.config, slots, like=weights["embed"])

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        logits, pools = llama.forward(weights, self.config, tokens, index, pools, donate=True,
                                      last=True)
        return logits[:, 0, :], pools
