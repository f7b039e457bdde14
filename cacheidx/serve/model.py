"""The engine's one model call. A model for the engine places its weights, makes its pools and
computes the last token's logits of every lane of a call through a cache index; a variant (a
tensor-parallel decoder, a test's checking model) is another class with these three methods."""

from __future__ import annotations

from typing import Any, Protocol

from ..models import deltanet, llama

__all__ = ["LlamaModel", "Model", "ShardedModel", "token_bytes"]


def token_bytes(kv_heads: int, head_dim: int, kv: str | None = None, itemsize: int = 4) -> int:
    """The bytes one token takes in one layer's key and value pools: ``2 * kv_heads`` rows of
    ``head_dim`` elements of ``itemsize`` bytes (float32: 4); quantized (``kv`` ``"int8"``
    or ``"int4"``), ``head_dim`` or ``head_dim / 2`` bytes of codes and a float32 scale a
    row; ``"int4-turned"``, ``head_dim / 2`` bytes of codes and a float16 scale and int8 zero
    point a group (:func:`cacheidx.models.llama.row_bytes`)."""
    bits = llama.kv_bits("serve.token_bytes", kv)
    if bits is None:
        return 2 * int(kv_heads) * int(head_dim) * int(itemsize)
    return int(kv_heads) * sum(llama.row_bytes(int(head_dim), kv))


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

    def pools(self, weights: Any, slots: Any, kv: str | None = None) -> Any:
        """Empty pools of ``slots`` slots beside ``weights`` (a list of tuples of arrays, or
        of :class:`cacheidx.quantized.Quantized` pools); ``slots`` is a list of each layer's
        where the model says ``windows``. ``kv`` is ``None`` (float pools), ``"int8"`` or
        ``"int4"`` (quantized pools, :func:`cacheidx.models.llama.empty_pools`); the engine
        passes it only when it is given one, so a model of float pools alone may take no
        ``kv`` at all."""

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        """``(logits, pools)``: ``logits`` ``[batch, vocab]`` of each lane's last token of
        ``tokens`` ``[batch, seq]``, placed by ``index`` (the index every layer reads, or, for
        a model that says ``windows``, a list of each layer's); the pools after its stores
        (given up: the call may write into them). A layer of window ``w`` reads its index's
        ``window(w)``."""


class LlamaModel:
    """A Llama decoder (:mod:`cacheidx.models.llama`) with float32 NumPy ``params``; its layers'
    ``windows`` are its config's. A hybrid decoder (``config.layer_types``) says which layers
    keep recurrent state (``recurrent_layers``: Gated DeltaNet layers, whose states are
    :class:`cacheidx.state.Pools` under the index) and what one sequence's states take
    (:meth:`state_bytes`)."""

    def __init__(self, config: llama.Config, params: Any):
        self.config, self.params = config, params
        self.vocab, self.context = config.vocab, config.context
        self.windows = config.layer_windows
        self.recurrent_layers = config.recurrent_layers

    def place(self, xp: Any, device: Any) -> Any:
        return llama.convert(self.params, xp=xp, device=device)

    def pools(self, weights: Any, slots: Any, kv: str | None = None) -> Any:
        """Empty pools beside ``weights``; with recurrent layers ``slots`` is a list of each
        layer's, a recurrent layer's a pair ``(rows, snapshots)``: its running slots (one per
        row of the table) and its snapshot slots (:func:`cacheidx.models.llama.empty_pools`)."""
        return llama.empty_pools(self.config, slots, like=weights["embed"], kv=kv)

    def state_bytes(self) -> int:
        """The bytes one sequence's states take over every recurrent layer (float32): its
        running slot's, or one snapshot's; 0 without recurrent layers."""
        return len(self.recurrent_layers) * deltanet.state_bytes(self.config.linear)

    def token_bytes(self, kv: str | None = None) -> int:
        """The bytes one token takes in every attention layer's pools, float32 or ``kv``'s
        (a recurrent layer keeps none)."""
        c = self.config
        return (c.layers - len(self.recurrent_layers)) * token_bytes(c.kv_heads, c.head_dim, kv)

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

    def pools(self, weights: Any, slots: int, kv: str | None = None) -> Any:
        return self.group.pools(self.local, slots, like=weights["embed"], kv=kv)

    def token_bytes(self, kv: str | None = None) -> int:
        """The bytes one token takes in every layer's pools, over every rank."""
        c = self.config
        return c.layers * token_bytes(c.kv_heads, c.head_dim, kv)

    def _share(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        return llama.forward(weights, self.local, tokens, index, pools, donate=True, last=True,
                             reduce=self.group.reduce)

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        logits, pools = self._forward(weights, tokens, index, pools)
        return logits[:, 0, :], pools
