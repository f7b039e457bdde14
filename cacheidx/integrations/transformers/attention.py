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
"""

from __future__ import annotations

from typing import Any

__all__ = ["INDEX", "NAME", "POOLS", "NoIndex", "attention", "layer_window", "layer_windows",
           "register", "text_config"]

NAME = "cacheidx"
#: the forward's keyword arguments the function reads
INDEX, POOLS = "cacheidx_index", "cacheidx_pools"
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


def register() -> str:
    """Registers :func:`attention` in transformers' ``AttentionInterface`` as ``"cacheidx"``
    (again: the same function) and returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    return NAME
