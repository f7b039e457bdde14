"""Hugging Face transformers decoders served through the index, by their own modeling code.

    from cacheidx.integrations import transformers as cit
    cit.register()                         # "cacheidx", in transformers' AttentionInterface
    engine = Engine(cit.model(hf_model), backend="torch", pages=512)
    cit.generate(hf_model, prompts, max_new_tokens=16)   # greedy tokens through the Engine
    cit.generate(hf_model, prompts, kv="int8")           # ... over int8 pools

transformers passes a decoder's extra forward keywords down to its attention function; the
function registered here reads the call's cache index and the pools from them and attends
with ``index.attend`` (:mod:`.attention`), sliding layers under ``index.window(w)``
(:func:`layer_windows`); a call that passes none gets the model's own attention, so what a
call computes never hangs on another call, and threads share a model. :func:`model` wraps a
model for :class:`cacheidx.serve.Engine` (:mod:`.served`: what it refuses and why);
:func:`load` reads a ``save_pretrained`` folder or a GGUF file for ``python -m cacheidx.serve
--model PATH``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .attention import NAME, NoIndex, layer_windows, register
from .files import Loaded, load
from .served import TransformersModel

__all__ = ["NAME", "Loaded", "NoIndex", "TransformersModel", "generate",
           "layer_windows", "load", "model", "register", "stop_ids"]

_WHERE = "cacheidx.integrations.transformers.generate"


def model(hf_model: Any) -> TransformersModel:
    """``hf_model`` as a model :class:`cacheidx.serve.Engine` serves on the torch backend (see
    :class:`~.served.TransformersModel` for its laws and what it refuses). Its attention
    implementation becomes ``"cacheidx:OWN"``, which attends through the index only where a
    call passes one (transformers' own ``generate`` still runs on it); ``.restore()`` sets it
    back once no other wrapper holds it."""
    return TransformersModel(hf_model)


def stop_ids(hf_model: Any) -> frozenset[int]:
    """The ids that end a generation: the model's ``generation_config.eos_token_id`` (one id or
    several; none where it has none)."""
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(e) for e in ([eos] if isinstance(eos, int) else eos))


def generate(hf_model: Any, prompts: Iterable[Any], *, max_new_tokens: int = 16,
             page_size: int = 16, pages: int | None = None, cache: bool = True,
             kv: str | None = None, **engine_options: Any) -> list[list[int]]:
    """Greedy tokens of each prompt (a sequence of token ids) through
    :class:`cacheidx.serve.Engine` on the torch backend, on ``hf_model``'s device: paged pools
    of ``pages`` pages of ``page_size`` tokens (``None``: every prompt's pages), prompts'
    prefixes read from the prefix cache (``cache``), chunked prefill and continuous batching
    (``engine_options``: ``lanes``, ``chunk``, ``compile``, ...); a sliding group's pool
    holds one window at least. ``kv``: ``None``, pools in the model's dtype; ``"int8"`` or
    ``"int4"``, quantized pools (:mod:`cacheidx.quantized`: 8-bit or 4-bit codes and a
    float32 scale per token and kv head, ``Engine(kv=...)``); ``"int4-turned"``, turned 4-bit
    pools (:mod:`cacheidx.turned`). A prompt stops after
    ``max_new_tokens`` tokens or at an id of :func:`stop_ids` (kept).

    Any number of threads may call it on one model at once, each getting the tokens it gets
    alone, and transformers' own ``generate`` runs on the model meanwhile: the model is set to
    ``"cacheidx:OWN"`` (:func:`~.attention.over`: the index where a call passes one, its own
    attention otherwise), and the last call to return, raising or not, sets it back to what the
    first found (:class:`~.served.TransformersModel`, law 3). Raises ``TypeError`` or
    ``ValueError`` naming the prompt for one that is no sequence of ids or that the engine
    cannot serve, ``ValueError`` naming the function for another ``kv``, and
    :class:`~.served.TransformersModel`'s errors for a model it cannot."""
    from ... import backends
    from ...models.llama import kv_bits
    from ...serve import Engine, Request
    from ...serve.groups import Groups
    from ...serve.requests import checked

    kv_bits(_WHERE.removeprefix("cacheidx."), kv)

    stop = stop_ids(hf_model)
    requests = []
    for k, prompt in enumerate(prompts):
        try:
            fields = checked(prompt, max_new_tokens, 0.0, stop)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{_WHERE}: prompt {k}: {e}") from None
        requests.append(Request(k, **fields))
    served = model(hf_model)
    try:
        if pages is None and isinstance(page_size, int) and page_size > 0:
            # every prompt's pages; a sliding group's pool holds a window at least (the engine
            # names a page_size it cannot take)
            pages = Groups.of(served.windows).pools(
                max(1, sum(-(-(len(r.prompt) + r.max_new_tokens - 1) // page_size)
                           for r in requests)), page_size)
        device = backends.get("torch").device_label(next(hf_model.parameters()).device)
        engine = Engine(served, backend="torch", device=engine_options.pop("device", device),
                        pages=pages, page_size=page_size, cache=cache, kv=kv,
                        **engine_options)
        results = engine.run(requests)
    finally:
        served.restore()
    for k, r in enumerate(results):
        if r.error is not None:
            raise ValueError(f"{_WHERE}: prompt {k} failed: {r.error}")
    return [list(r.tokens) for r in results]
