"""The attention function ``"cacheidx"`` for transformers' ``AttentionInterface``, and which
layers slide.

Laws:

1. A layer attends over its pools in place with ``index.attend`` (the fused store and
   attention, :mod:`cacheidx.attention`): the call's index and every layer's pools come in the
   forward's keyword arguments (``cacheidx_index``, ``cacheidx_pools``: transformers passes a
   decoder's extra keywords down to its attention function), the layer's pools are
   ``cacheidx_pools[module.layer_idx]``, and the pools it wrote replace them in that list, which
   the caller threads on. transformers' mask is not read: the index is the mask. Where the
   engine keeps a table per group of layers (``cacheidx.serve.groups``), ``cacheidx_index`` is
   a list of each layer's index, and the layer reads ``cacheidx_index[module.layer_idx]``.
2. A layer slides exactly where transformers' own mask slides (:func:`layer_windows`): it
   attends under ``index.window(w)``, which counts the token itself, as transformers' window
   does (a key at most ``w - 1`` positions before the query).
3. What transformers passes is applied as its eager attention applies it: ``scaling``
   multiplies the scores, ``softcap`` (Gemma 2's ``attn_logit_softcapping``) caps them, a
   module's ``sinks`` (gpt-oss) add one logit per head to every softmax's denominator, and
   query heads share key-value heads in groups.
4. Called without an index (the model called directly, or a forward that drops its keyword
   arguments), it raises :class:`NoIndex`, naming the layer; a window transformers passes that
   disagrees with law 2 raises ``ValueError``: neither is ever computed wrong quietly.
5. What a call computes follows from what the call passes, never from state that lives for the
   length of a call: ``"cacheidx:OWN"`` (:func:`register` with ``own``) attends through the
   index where the call passes one (laws 1 to 4), and is exactly the model's own implementation
   ``OWN`` (its attention function and its mask) where it passes none. A model left set to it
   serves cacheidx's calls and transformers' own ``generate`` alike, from any number of threads
   at once; only inside :data:`REQUIRED` (the wrapper's probe) does a call without an index
   raise :class:`NoIndex` instead.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["INDEX", "NAME", "POOLS", "REQUIRED", "NoIndex", "attention", "attends_by_index",
           "layer_window", "layer_windows", "over", "register", "text_config"]

NAME = "cacheidx"
#: the forward's keyword arguments the function reads
INDEX, POOLS = "cacheidx_index", "cacheidx_pools"
#: true where a call without an index is an error rather than the model's own attention (law 5):
#: a context's own value, so one thread's probe never touches another thread's calls
REQUIRED: contextvars.ContextVar[bool] = contextvars.ContextVar("cacheidx_index_required",
                                                                default=False)
_KINDS = ("full_attention", "sliding_attention")
_WHERE = "cacheidx.integrations.transformers"


class NoIndex(RuntimeError):
    """The attention function was called without a cache index (law 4)."""


def text_config(config: Any) -> Any:
    """The decoder's own config (a multimodal model's text part; a text model's config)."""
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window as transformers' own mask draws it, ``None`` for a full layer.

    Where the config lists ``layer_types`` (Gemma 2, Qwen2, Qwen3, SmolLM3, gpt-oss), a layer
    slides iff its type is ``"sliding_attention"``, over ``config.sliding_window`` tokens;
    without it (Llama, Mistral, Phi-3) every layer slides over ``config.sliding_window`` tokens
    where that is set, and none slides otherwise. A module's own ``sliding_window`` is not
    read: some models keep it on full layers too.

    Raises ``ValueError`` naming the layer for a kind of attention other than full and sliding
    (chunked, linear, ...), or a sliding layer with no window."""
    config = text_config(config)
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is not None and len(types) < layers:
        raise ValueError(f"{_WHERE}.layer_windows: config.layer_types names {len(types)} layers "
                         f"of {layers}")
    return [layer_window(config, i) for i in range(layers)]


def layer_window(config: Any, layer: int) -> int | None:
    """Layer ``layer``'s window (:func:`layer_windows`), read from ``config`` alone."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return _window(window, "every layer")
    kind = types[layer]
    if kind == "full_attention":
        return None
    if kind != "sliding_attention":
        raise ValueError(f"{_WHERE}.layer_windows: layer {layer} is {kind!r}; cacheidx serves "
                         f"{' and '.join(_KINDS)} layers")
    if window is None:
        raise ValueError(f"{_WHERE}.layer_windows: layer {layer} is sliding_attention but "
                         "config.sliding_window is None")
    return _window(window, f"layer {layer}")


def _window(w: Any, what: str) -> int | None:
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"{_WHERE}.layer_windows: config.sliding_window must be a positive "
                         f"integer for {what}, got {w!r}")
    return w


def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *,
              scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
              sliding_window: int | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention function (see the module's laws): ``query`` ``[batch, heads,
    seq, dim]``, ``key`` and ``value`` ``[batch, kv_heads, seq, dim]``; returns ``(out,
    None)``, ``out`` ``[batch, seq, heads, dim]``."""
    index, pools = kwargs.get(INDEX), kwargs.get(POOLS)
    layer = getattr(module, "layer_idx", None)
    if index is None or pools is None:
        raise NoIndex(f"{_WHERE}: the attention of layer {layer} ({type(module).__name__}) was "
                      f"called without {INDEX} and {POOLS}: serve the model through "
                      f"{_WHERE}.model (or set_attn_implementation back to 'eager' to call it "
                      "directly)")
    if isinstance(index, list):  # one index a layer: its group's table (law 1)
        index = index[layer]
    if dropout and module.training:
        raise ValueError(f"{_WHERE}: {type(module).__name__} is in training mode with dropout "
                         f"{dropout}; cacheidx attends for inference (call model.eval())")
    config = module.config
    window = layer_window(config, layer)
    if sliding_window is not None and sliding_window != window:
        # transformers' flash path slides by what it passes, its eager path by the mask
        raise ValueError(f"{_WHERE}: layer {layer} of {type(module).__name__} is passed "
                         f"sliding_window={sliding_window}, but its mask slides by {window}")
    if window is not None:
        index = index.window(window)
    if softcap is None:
        softcap = getattr(text_config(config), "attn_logit_softcapping", None)
    sinks = getattr(module, "sinks", None)
    if sinks is not None:  # a plain tensor: dynamo cannot read a Parameter's type's module,
        sinks = sinks.detach()  # which attend's library check does
    kpool, vpool = pools[layer]
    out, kpool, vpool = index.attend(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), kpool, vpool,
        scale=scaling, softcap=softcap, sinks=sinks, donate=True)
    pools[layer] = (kpool, vpool)
    return out, None


def over(own: str) -> Callable[..., tuple[Any, Any]]:
    """The attention function of ``"cacheidx:own"`` (law 5): :func:`attention` where the call
    passes an index or pools, else the model's own implementation ``own`` with the arguments
    it was given (``"eager"``: the eager function of the module's modeling file, which
    transformers passes as its default; any other: ``AttentionInterface``'s entry). One
    function for each ``own``, made once."""
    return _over(own)


@functools.cache
def _over(own: str) -> Callable[..., tuple[Any, Any]]:
    def dispatched(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                   **kwargs: Any) -> tuple[Any, Any]:
        if kwargs.get(INDEX) is not None or kwargs.get(POOLS) is not None:
            return attention(module, query, key, value, attention_mask, **kwargs)
        if _required():
            attention(module, query, key, value, attention_mask, **kwargs)  # raises NoIndex
        return _own(module, own)(module, query, key, value, attention_mask, **kwargs)

    dispatched.__name__ = dispatched.__qualname__ = f"cacheidx_over_{own}"
    return dispatched


def _required() -> bool:
    import torch

    # (dynamo does not trace a ContextVar; the probe that sets it is never compiled)
    return not torch.compiler.is_compiling() and REQUIRED.get()


def _own(module: Any, own: str) -> Callable[..., Any]:
    """The function ``module``'s own code calls for the implementation ``own``: the interface's
    entry, or for ``"eager"`` the default its code passes the interface, its modeling file's
    ``eager_attention_forward`` (a subclass's own file first)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = next((f for c in type(module).__mro__
                  if (f := getattr(sys.modules.get(c.__module__), "eager_attention_forward",
                                   None)) is not None), None)
    if own == "eager" and eager is None:
        raise NoIndex(f"{_WHERE}: {type(module).__name__} was called without {INDEX}, and its "
                      "modeling file has no eager_attention_forward to attend by itself")
    return ALL_ATTENTION_FUNCTIONS.get_interface(own, eager)


def attends_by_index(implementation: Any) -> bool:
    """Whether a model set to ``implementation`` attends through the index when a call passes
    one: ``"cacheidx"`` or a ``"cacheidx:OWN"`` (law 5)."""
    return isinstance(implementation, str) and (implementation == NAME or
                                                implementation.startswith(NAME + ":"))


def register(own: str | None = None) -> str:
    """Registers :func:`attention` in transformers' ``AttentionInterface`` as ``"cacheidx"``
    (again: the same function) and returns the name. With ``own`` (an implementation the model
    may be set to: ``"eager"``, ``"sdpa"``, ...), also registers ``"cacheidx:own"`` (law 5:
    :func:`over`, with ``own``'s mask in ``AttentionMaskInterface`` where it has one) and
    returns that name; an ``own`` that already attends by the index is returned as it is."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    if own is None or attends_by_index(own):
        return NAME if own is None else own
    # (":": transformers reads a name "a/b" with no ":" before the "/" as a hub kernel's)
    name = f"{NAME}:{own}"
    AttentionInterface.register(name, over(own))
    masks = AttentionMaskInterface()
    if own in masks:  # (else transformers builds no mask for own, nor for name)
        AttentionMaskInterface.register(name, masks[own])
    return name
