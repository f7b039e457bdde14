"""The engine's one model call. A model for the engine places its weights, makes its pools and
computes the last token's logits of every lane of a call through a cache index; a variant (a
tensor-parallel decoder, a test's checking model) is another class with these three methods."""

from __future__ import annotations

from typing import Any, Protocol

from ..models import llama

__all__ = ["LlamaModel", "Model", "ShardedModel"]


class Model(Protocol):
    """What the engine calls. A model may also say where the call's inputs go (``device``,
    instead of the engine's ``device`` name) and how to read an output on the host
    (``host``), and what requests it can take: ``vocab`` (token ids below it) and ``context``
    (the most tokens a request holds, prompt and new ones); the engine refuses any other
    request when it is submitted. A model whose layers slide says each layer's window
    (``windows``: ``None`` for a full layer); the engine then keeps one table and one pool
    of pages per group of layers of one window (:mod:`cacheidx.serve.groups`)."""

    def place(self, xp: Any, device: Any) -> Any:
        """The weights as arrays of namespace ``xp`` on ``device``."""

    def pools(self, weights: Any, slots: Any) -> Any:
        """Empty pools of ``slots`` slots beside ``weights`` (a list of tuples of arrays);
        ``slots`` is a list of each layer's where the model says ``windows``."""

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        """``(logits, pools)``: ``logits`` ``[batch, vocab]`` of each lane's last token of
        ``tokens`` ``[batch, seq]``, placed by ``index`` (the index every layer reads, or, for
        a model that says ``windows``, a list of each layer's); the pools after its stores
        (given up: the call may write into them). A layer of window ``w`` reads its index's
        ``window(w)``."""


class LlamaModel:
    """A Llama decoder (:mod:`cacheidx.models.llama`) with float32 NumPy ``params``; its layers'
    ``windows`` are its config's."""

    def __init__(self, config: llama.Config, params: Any):
        self.config, self.params = config, params
        self.vocab, self.context = config.vocab, config.context
        self.windows = config.layer_windows

    def place(self, xp: Any, device: Any) -> Any:
        return llama.convert(self.params, xp=xp, device=device)

    def pools(self, weights: Any, slots: Any) -> Any:
        return llama.empty_pools(self.config, slots, like=weights["embed"])

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        logits, pools = llama.forward(weights, self.config, tokens, index, pools, donate=True,
                                      last=True)
        return logits[:, 0, :], pools


class ShardedModel:
    """A Llama decoder split over a tensor-parallel ``group`` (:func:`cacheidx.parallel.group`):
    each rank places its share of the heads and hidden units (``group.shard``) and its pools,
    the call runs under ``group.map`` (every rank, or every device of a JAX mesh, on its own
    share) and each layer's parts are summed by ``group.reduce``. Every rank reads the same
    index, placed where the group says (``device``); the logits come back whole."""

    def __init__(self, config: llama.Config, params: Any, group: Any):
        self.config, self.params, self.group = config, params, group
        self.vocab, self.context = config.vocab, config.context
        self.local = config  # one rank's config, once placed
        self._forward = group.map(self._share)

    @property
    def device(self) -> Any:
        return self.group.replicated

    def host(self, x: Any) -> Any:
        return self.group.host(x)

    def place(self, xp: Any, device: Any) -> Any:
        self.local, weights = self.group.shard(self.config, self.params)
        return weights

    def pools(self, weights: Any, slots: int) -> Any:
        return self.group.pools(self.local, slots, like=weights["embed"])

    def _share(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        return llama.forward(weights, self.local, tokens, index, pools, donate=True, last=True,
                             reduce=self.group.reduce)

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        logits, pools = self._forward(weights, tokens, index, pools)
        return logits[:, 0, :], pools
