"""A transformers decoder as a :class:`cacheidx.serve` model: its own modeling code, attending
through the index with the ``"cacheidx"`` attention function (:mod:`.attention`).

Laws:

1. ``forward(weights, tokens, index, pools)`` is one call of the transformers model: its tokens,
   the index's positions as ``position_ids``, no transformers cache and no mask built (a 4D
   placeholder transformers takes as prepared, never read), the last token's logits only;
   every layer attends over its own pools (``[slots, kv_heads, head_dim]``, the model's
   dtype, one key and one value pool a layer; or quantized pools, ``pools(..., kv="int8")``
   or ``"int4"``, :mod:`cacheidx.quantized`) and the pools it wrote come back. ``index`` is
   the index every layer reads, or a list of each layer's (the engine's table of the layer's
   group, ``cacheidx.serve.groups``); ``slots`` of :meth:`~TransformersModel.pools` a number
   or a list of each layer's.
2. A model that cannot be served is refused when it is wrapped, with a ``ValueError`` naming
   the model and what it lacks: an encoder or encoder-decoder (no causal decoder), multi-head
   latent attention (it caches a latent, not keys and values per head), a kind of layer other
   than full and sliding attention, and a forward that does not pass its keyword arguments
   down to its attention function or attends outside transformers' ``AttentionInterface``
   (found by one token's call through a one-slot pool).
3. A wrapped model is set to ``"cacheidx:OWN"``, ``OWN`` the implementation it had
   (:func:`~.attention.over`): a call that passes an index attends through it, any other call
   is the model's own (transformers' ``generate`` runs on it unchanged), so the setting holds
   no call's state and any number of wrappers, engines and threads share one model. Wrappers
   of one model share one hold: the first sets the model, the last to :meth:`restore` sets it
   back to what the first found; a model already set to ``"cacheidx"`` or ``"cacheidx:OWN"``
   is left so.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

from . import attention as attn  # the module (the package exports no function by that name)

__all__ = ["TransformersModel", "shape_of"]

_WHERE = "cacheidx.integrations.transformers.model"  # (the function users call)
_POOLS = "integrations.transformers.TransformersModel.pools"
_HOLDING = threading.Lock()  # taking and giving back a hold: never held during a call


@dataclasses.dataclass
class _Hold:
    """A wrapped model's implementation before its first wrapper, and how many hold it."""

    previous: Any
    wrappers: int = 0


#: each wrapped model's hold (law 3); a model that goes away takes its entry with it
_HOLDS: weakref.WeakKeyDictionary[Any, _Hold] = weakref.WeakKeyDictionary()


def shape_of(config: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder's config: what its pools hold."""
    c = attn.text_config(config)
    heads = int(c.num_attention_heads)
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or int(c.hidden_size) // heads
    return int(c.num_hidden_layers), int(kv), int(head_dim)


class TransformersModel:
    """``hf_model`` (a transformers ``PreTrainedModel`` that generates) served by the engine on
    the torch backend, on the device the engine names. ``vocab`` is its vocabulary's size,
    ``context`` its ``max_position_embeddings`` (the engine refuses a longer request),
    ``windows`` each layer's sliding window (:func:`~.attention.layer_windows`).

    Raises ``TypeError`` for anything but a transformers model, ``ValueError`` for one it
    cannot serve (law 2)."""

    def __init__(self, hf_model: Any):
        try:
            from transformers import PreTrainedModel
        except ImportError:
            raise ImportError(f"{_WHERE}: needs transformers (pip install transformers)") from None
        if not isinstance(hf_model, PreTrainedModel):
            raise TypeError(f"{_WHERE}: expected a transformers PreTrainedModel, got "
                            f"{type(hf_model).__name__}")
        self.hf = hf_model
        self.name = type(hf_model).__name__
        refused(hf_model)
        self.windows = attn.layer_windows(hf_model.config)
        self.layers, self.kv_heads, self.head_dim = shape_of(hf_model.config)
        config = attn.text_config(hf_model.config)
        self.vocab = int(config.vocab_size)
        self.context = getattr(config, "max_position_embeddings", None)
        self._held = False
        #: the model's attention implementation before its first wrapper (law 3)
        self.previous = self._hold()
        try:
            self._probe()
        except BaseException:
            self.restore()
            raise

    def _hold(self) -> Any:
        """Takes a hold on the model (law 3), setting it to ``"cacheidx:OWN"`` where none held
        it; returns what it was before the first hold."""
        hf = self.hf
        with _HOLDING:
            hold = _HOLDS.get(hf)
            if hold is None:
                previous = hf.config._attn_implementation
                name = attn.register(previous)
                if name != previous:
                    hf.set_attn_implementation(name)
                if hf.config._attn_implementation != name:
                    hf.set_attn_implementation(previous)  # (sub-configs it may have set)
                    raise ValueError(f"{_WHERE}: {self.name} cannot set its attention "
                                     "implementation (it does not attend through "
                                     "transformers' AttentionInterface)")
                hold = _HOLDS[hf] = _Hold(previous)
            hold.wrappers += 1
            self._held = True
            return hold.previous

    def place(self, xp: Any, device: Any) -> Any:
        """The model moved to ``device``; its parameters (what a compiled step keeps at one
        address: the module reads them itself). Raises ``ValueError`` for a namespace other
        than torch's."""
        import array_api_compat

        if not array_api_compat.is_torch_namespace(xp):
            raise ValueError(f"{_WHERE}: a transformers model runs on the torch backend, not "
                             f"{getattr(xp, '__name__', xp)}")
        self.hf.to(device)
        return dict(self.hf.named_parameters())

    def pools(self, weights: Any, slots: Any, kv: str | None = None) -> Any:
        """One ``(keys, values)`` pair of zeros a layer, ``[slots, kv_heads, head_dim]``, in the
        model's dtype on its device (``slots`` a number, or a list of each layer's), laid out as
        :mod:`cacheidx.attention.layout` chooses (head-major on the CPU). With ``kv``
        (``"int8"``, ``"int4"``) each is a :class:`cacheidx.quantized.Quantized` pool of codes
        and float32 scales, laid out alike; its attention's output is in the model's dtype.
        Raises ``ValueError`` naming the function for another ``kv``, and for ``"int4"`` with
        an odd ``head_dim``."""
        import array_api_compat.torch as xp

        from ... import quantized
        from ...attention import layout
        from ...models import llama

        bits = llama.kv_bits(_POOLS, kv)
        if bits == 4 and self.head_dim % 2:
            raise ValueError(f"cacheidx.{_POOLS}: int4 packs two codes a byte, so head_dim "
                             f"must be even; {self.name}'s is {self.head_dim}")
        p = next(self.hf.parameters())
        each = [slots] * self.layers if isinstance(slots, int) else list(slots)
        if bits is None:
            return [tuple(layout.zeros(xp, n, self.kv_heads, self.head_dim, dtype=self.hf.dtype,
                                       device=p.device) for _ in "kv")
                    for n in each]
        order = llama.quantized_layout(xp, self.kv_heads, self.head_dim, p.device)
        return [tuple(quantized.zeros(n, self.kv_heads, self.head_dim, bits=bits, xp=xp,
                                      device=p.device, layout=order) for _ in "kv")
                for n in each]

    def token_bytes(self, kv: str | None = None) -> int:
        """The bytes one token takes in every layer's pools: the model's dtype, or ``kv``'s
        codes and scales."""
        from ...serve.model import token_bytes

        size = self.hf.dtype.itemsize
        return self.layers * token_bytes(self.kv_heads, self.head_dim, kv, itemsize=size)

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        """``(logits [batch, vocab], pools)``: law 1."""
        import torch

        now = self.hf.config._attn_implementation
        if not attn.attends_by_index(now):  # the model's own attention would drop the index
            raise RuntimeError(f"{_WHERE}: {self.name}'s attention implementation is {now!r} "
                               "(set back since it was wrapped), so it would not attend "
                               f"through the index: wrap it again with {_WHERE}")
        written = list(pools)
        first = index[0] if isinstance(index, list) else index
        # transformers takes a 4D mask as prepared and builds none (the index is the mask;
        # zeros: were a layer to add it after all, it would change nothing)
        unread = torch.zeros((1, 1, 1, 1), device=tokens.device)
        with torch.no_grad():  # compiled too: pools that required grad would be a new program
            out = self.hf(input_ids=tokens, attention_mask=unread, position_ids=first.positions(),
                          use_cache=False, logits_to_keep=1,
                          **{attn.INDEX: index, attn.POOLS: written})
        return out.logits[:, -1, :], written

    def restore(self) -> None:
        """Gives this wrapper's hold back (law 3). The last hold given back, or none left at
        all, sets the model's attention implementation back to :attr:`previous` where it
        attends by the index (an implementation set since by hand is kept). Again: the
        same."""
        hf = self.hf
        with _HOLDING:
            if self._held:
                self._held = False
                hold = _HOLDS[hf]
                hold.wrappers -= 1
                if hold.wrappers:
                    return
                del _HOLDS[hf]
            elif hf in _HOLDS:  # other wrappers hold it: theirs to give back
                return
            now = hf.config._attn_implementation
            if attn.attends_by_index(now) and now != self.previous:
                hf.set_attn_implementation(self.previous)

    def _probe(self) -> None:
        """One token through a one-slot pool a layer: every layer's attention must get the
        index from the forward's keywords and write its pools (law 2)."""
        import torch

        import cacheidx as ci

        device = next(self.hf.parameters()).device
        pools = self.pools(None, 1)
        index = ci.rows(1, [1], xp="torch", device=device)
        tokens = torch.zeros((1, 1), dtype=torch.int64, device=device)
        required = attn.REQUIRED.set(True)  # a layer called without the index raises
        try:
            _, written = self.forward(None, tokens, index, pools)
            missing = [i for i in range(self.layers) if written[i] is pools[i]]
        except attn.NoIndex:
            raise ValueError(f"{_WHERE}: {self.name}'s forward does not pass its keyword "
                             "arguments down to its attention function, so no layer gets "
                             "the cache index") from None
        finally:
            attn.REQUIRED.reset(required)
        if missing:
            raise ValueError(f"{_WHERE}: layers {missing} of {self.name} never called the "
                             f"attention function {attn.NAME!r}: they attend outside "
                             "transformers' AttentionInterface")


def refused(hf_model: Any) -> None:
    """Raises ``ValueError`` naming what ``hf_model`` lacks where it is no causal decoder
    cacheidx can serve (law 2, before any call)."""
    name = type(hf_model).__name__
    config = attn.text_config(hf_model.config)
    if getattr(hf_model.config, "is_encoder_decoder", False):
        raise ValueError(f"{_WHERE}: {name} is an encoder-decoder; cacheidx serves causal "
                         "decoders (a decoder's self-attention over its own pools)")
    if not hf_model.can_generate():
        raise ValueError(f"{_WHERE}: {name} cannot generate (an encoder, or a model without "
                         "a language-model head); cacheidx serves causal decoders")
    for key in ("kv_lora_rank", "q_lora_rank"):
        if getattr(config, key, None) is not None:
            raise ValueError(f"{_WHERE}: {name} uses multi-head latent attention "
                             f"(config.{key} = {getattr(config, key)}): it caches a compressed "
                             "latent, and cacheidx's pools hold keys and values per kv head")
    for path, module in hf_model.named_modules():
        if hasattr(module, "layer_idx") and getattr(module, "is_causal", True) is False:
            raise ValueError(f"{_WHERE}: {name}'s {path} attends both ways (is_causal is "
                             "False): an encoder's attention; cacheidx serves causal decoders")
