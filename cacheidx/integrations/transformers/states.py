"""A call's transformers ``Cache`` over cacheidx's pools: the recurrent layers' states start from
and go back to :mod:`cacheidx.state`'s pools, the attention layers' keys and values go through
the index (:mod:`.attention`).

Laws:

1. **Which layers keep what** (:func:`layout_of`): the model's own ``DynamicCache`` fed one
   token says it. A layer transformers gives a ``LinearAttentionLayer`` is recurrent, and each
   state it then holds (a conv window ``conv_states[i]``, a recurrent or SSM state
   ``recurrent_states[i]``) is one kind of state: a :class:`Kind` of the shape and dtype that
   token gave it. A layer given a ``DummyLayer`` keeps nothing (an MLP or MoE layer of
   Nemotron-H). A layer that keeps both keys and values and a state (transformers' ``hybrid``
   layers: Zamba's shared attention beside its Mamba) is refused: a layer's pools here are one
   or the other.
2. **A call's cache** (:class:`CallCache`, a transformers ``Cache``): a recurrent layer's
   every kind starts from ``cacheidx.state.start(index, pools)`` and is marked as having a
   previous state, always: a lane that starts from zero reads zeros, which the modeling code's
   own prefill pads with (its conv window) or starts from (its scan), so one code path serves
   a prompt's first chunk and every later one. An attention layer's ``update`` returns the
   call's keys and values unchanged: the attention function stores them through the index.
   After the model ran, :meth:`CallCache.stored` gives each recurrent layer's pools after
   ``cacheidx.state.store(index, final, pools)`` (``closed`` None: transformers' kernels give
   the state after the call's last token alone, so a caller cuts its chunks to end where a
   snapshot's block ends).
3. **Order.** A lane's valid tokens are a chunk of its sequence (:mod:`cacheidx.state`'s law
   3), and a call of this cache has no lane that holds padding beside valid tokens
   (:func:`mixed`): the modeling code masks no padding out of a state (cacheidx passes it no
   2D mask), so such padding would flow into the state. The wrapper computes such a call one
   column a call instead (:class:`~.served.TransformersModel`, law 4).

Private transformers API used, and why: ``LinearAttentionLayer``'s attributes
``conv_states``, ``recurrent_states``, ``is_conv_states_initialized``,
``is_recurrent_states_initialized``, ``has_previous_state``, ``conv_kernel_size``,
``number_of_states``, ``device`` and ``dtype`` (cache_utils.py keeps a layer's states there and
no public method sets a state from outside; :class:`CallCache` sets them to the pools' starts
and reads them back). ``CacheLayerMixin`` and ``DummyLayer`` are subclassed and used as
transformers' own ``DynamicCache`` uses them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ... import masks

__all__ = ["ATTENTION", "FORWARD", "NOTHING", "CallCache", "Kind", "layout_of", "mixed"]

#: a layer's entry in :func:`layout_of` that keeps keys and values, or nothing
ATTENTION, NOTHING = "attention", "nothing"
_WHERE = "cacheidx.integrations.transformers"
FORWARD = "integrations.transformers.TransformersModel.forward"


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of a recurrent layer's state: ``conv_states[index]`` (``what`` ``"conv"``) or
    ``recurrent_states[index]`` (``"recurrent"``) of its ``LinearAttentionLayer``, a row of
    ``shape`` in ``dtype``."""

    what: str
    index: int
    shape: tuple[int, ...]
    dtype: Any

    @property
    def bytes(self) -> int:
        """The bytes one sequence's state of this kind takes."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def layout_of(hf_model: Any, name: str) -> list[Any]:
    """Each layer's entry (law 1): :data:`ATTENTION`, :data:`NOTHING`, or a tuple of the
    :class:`Kind` s a recurrent layer keeps (conv kinds first, then recurrent ones, each by
    index). Raises ``ValueError`` naming the model and the layer for one it cannot serve."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin

    from .attention import text_config

    config = text_config(hf_model.config)
    cache = DynamicCache(config=config)
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        hf_model(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=device), cache=cache,
                 use_cache=True, logits_to_keep=1)
    layers = int(config.num_hidden_layers)
    if len(cache.layers) != layers:
        raise ValueError(f"{_WHERE}.model: {name}'s cache has {len(cache.layers)} layers for "
                         f"its {layers}: cacheidx cannot tell which layer keeps what")
    out: list[Any] = []
    for i, layer in enumerate(cache.layers):
        linear = isinstance(layer, LinearAttentionCacheLayerMixin)
        if linear and isinstance(layer, CacheLayerMixin):
            raise ValueError(f"{_WHERE}.model: layer {i} of {name} keeps both keys and values "
                             f"and a recurrent state ({type(layer).__name__}); cacheidx's pools "
                             "hold one or the other a layer")
        if isinstance(layer, DummyLayer):
            out.append(NOTHING)
        elif not linear:
            out.append(ATTENTION)
        else:
            kinds = [Kind(what, k, tuple(s.shape[1:]), s.dtype)
                     for what, states in (("conv", layer.conv_states),
                                          ("recurrent", layer.recurrent_states))
                     for k, s in sorted(states.items()) if s is not None]
            if not kinds:
                raise ValueError(f"{_WHERE}.model: layer {i} of {name} is a recurrent layer "
                                 "that kept no state after a token: cacheidx cannot tell "
                                 "what it keeps")
            out.append(tuple(kinds))
    return out


def _classes() -> tuple[type, type]:
    from transformers.cache_utils import Cache, CacheLayerMixin

    class Passing(CacheLayerMixin):
        """An attention layer's place in a call's cache: its keys and values go through the
        index (the attention function stores them), so ``update`` keeps nothing."""

        is_compileable = True

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            pass

        def update(self, key_states: Any, value_states: Any, *args: Any,
                   **kwargs: Any) -> tuple[Any, Any]:
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return query_length, 0  # (never read: cacheidx's placeholder mask is taken whole)

        def get_seq_length(self) -> int:
            return 0  # (read only where no position_ids are passed; cacheidx passes them)

        def get_max_length(self) -> int:
            return -1

    class Call(Cache):
        pass

    return Passing, Call


_CLASSES: tuple[type, type] | None = None


class CallCache:
    """One call's transformers ``Cache`` (law 2): ``cache`` is the object the model is given;
    ``layout`` is :func:`layout_of`'s, ``index`` the call's index (or a list of each layer's),
    ``pools`` each layer's pools (a recurrent layer's: a tuple of :class:`cacheidx.state.Pools`,
    one a kind)."""

    def __init__(self, layout: list[Any], index: Any, pools: list[Any]):
        global _CLASSES
        from transformers.cache_utils import DummyLayer, LinearAttentionLayer

        from ... import state

        if _CLASSES is None:
            _CLASSES = _classes()
        passing, call = _CLASSES
        self.layout, self.index, self.pools = layout, index, pools
        layers: list[Any] = []
        for i, entry in enumerate(layout):
            if entry == ATTENTION:
                layers.append(passing())
            elif entry == NOTHING:
                layers.append(DummyLayer())
            else:
                ix = self.index_of(i)
                _check_pools(i, entry, pools[i])
                layer = LinearAttentionLayer(number_of_states=1 + max(k.index for k in entry))
                for kind, pools_ in zip(entry, pools[i], strict=True):
                    start = state.start(ix, pools_)
                    if kind.what == "conv":
                        layer.conv_states[kind.index] = start
                        layer.is_conv_states_initialized[kind.index] = True
                        layer.conv_kernel_size[kind.index] = kind.shape[-1]
                    else:
                        layer.recurrent_states[kind.index] = start
                        layer.is_recurrent_states_initialized[kind.index] = True
                    # a zero start is what transformers' prefill starts from (law 2)
                    layer.has_previous_state[kind.index] = True
                    layer.dtype, layer.device = start.dtype, start.device
                layers.append(layer)
        self.cache = call(layers=layers)

    def index_of(self, layer: int) -> Any:
        return self.index[layer] if isinstance(self.index, list) else self.index

    def stored(self, written: list[Any]) -> list[Any]:
        """``written`` (the attention layers' pools after the call) with each recurrent layer's
        pools after its stores (law 2)."""
        from ... import state

        out = list(written)
        for i, entry in enumerate(self.layout):
            if entry in (ATTENTION, NOTHING):
                continue
            layer, ix = self.cache.layers[i], self.index_of(i)
            out[i] = tuple(
                state.store(ix, (layer.conv_states if kind.what == "conv"
                                 else layer.recurrent_states)[kind.index], pools_, donate=True)
                for kind, pools_ in zip(entry, self.pools[i], strict=True))
        return out


def _check_pools(layer: int, kinds: tuple[Kind, ...], pools: Any) -> None:
    """Raises naming the forward where a recurrent layer's pools are not one
    :class:`cacheidx.state.Pools` a kind, of its kind's row shape and dtype."""
    fn = f"cacheidx.{FORWARD}"
    if not (isinstance(pools, tuple) and len(pools) == len(kinds)):
        raise TypeError(f"{fn}: layer {layer}'s pools must be a tuple of {len(kinds)} "
                        f"state.Pools ({', '.join(k.what for k in kinds)}), got "
                        f"{type(pools).__name__}")
    for kind, p in zip(kinds, pools, strict=True):
        if not (isinstance(p, tuple) and len(p) == 2):
            raise TypeError(f"{fn}: layer {layer}'s {kind.what} pools must be a state.Pools, "
                            f"got {type(p).__name__}")
        for name, pool in zip(("running", "snapshots"), p, strict=True):
            row = tuple(getattr(pool, "shape", ())[1:])
            if row != kind.shape or getattr(pool, "dtype", None) != kind.dtype:
                raise ValueError(f"{fn}: layer {layer}'s {kind.what} {name} pool holds "
                                 f"{getattr(pool, 'dtype', None)} rows of {list(row)}; the "
                                 f"layer's state is {kind.dtype} of {list(kind.shape)}")


def mixed(index: Any) -> bool:
    """Whether a lane of ``index`` (or of any of a list's) holds both valid tokens and padding
    (law 3). Reads the index's values on the host: never call it traced."""
    indices = index if isinstance(index, list) else [index]
    for ix in {id(i): i for i in indices}.values():
        valid = masks.valid(ix)
        if bool((valid.any(dim=1) & ~valid.all(dim=1)).any()):
            return True
    return False
