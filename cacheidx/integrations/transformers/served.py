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
   (found by one token's call through a one-slot pool); and, for a model with recurrent
   layers, one whose states do not carry from one call to the next (found at wrap time: a
   short prompt computed whole and token by token must give one result) or a layer that
   keeps both keys and values and a state (:func:`~.states.layout_of`).
3. A wrapped model is set to ``"cacheidx:OWN"``, ``OWN`` the implementation it had
   (:func:`~.attention.over`): a call that passes an index attends through it, any other call
   is the model's own (transformers' ``generate`` runs on it unchanged), so the setting holds
   no call's state and any number of wrappers, engines and threads share one model. Wrappers
   of one model share one hold: the first sets the model, the last to :meth:`restore` sets it
   back to what the first found; a model already set to ``"cacheidx"`` or ``"cacheidx:OWN"``
   is left so.
4. **Recurrent layers** (hybrid and state-space decoders: Gated DeltaNet, short convolutions,
   Mamba and Mamba 2 layers; :mod:`.states`). ``recurrent_layers`` names them, each keeping
   one or more kinds of state (``state_kinds[i]``: conv window, recurrent or SSM state, each a
   row shape and dtype). Its pools are a tuple of :class:`cacheidx.state.Pools` (``running
   [rows, *shape]``, ``snapshots [n, *shape]``), one a kind, from ``slots[i]`` a pair ``(rows,
   snapshots)``; an attention layer's are its ``(keys, values)`` as before (``slots[i]`` a
   number), a layer that keeps nothing (an MLP layer) gets ``()``. A call starts each state
   from ``cacheidx.state.start(index, pools)`` and stores it after with
   ``cacheidx.state.store(index, final, pools)`` (``index`` the layer's), through a
   transformers ``Cache`` of the call (:class:`~.states.CallCache`). transformers' kernels give
   a call's final state alone, so the model says ``final_states_only`` (a caller cuts its
   chunks to end at a snapshot's block end). Its kernels mask no padding out of a state, so
   a multi-token call is computed one token a call (each column a call of its own, where a
   lane's padding stores nothing) wherever a lane holds padding beside valid tokens
   (:func:`~.states.mixed`), wherever the model's own kernels drop the state a multi-token call
   starts from (``stepwise``: Mamba's and Falcon-Mamba's scan, which the wrap-time check
   finds) and the call resumes one, and always when traced (a compiled call cannot look at
   its values: a compiled prefill of ``seq`` columns is ``seq`` calls in one program). Hence
   ``lanes_per_prefill = 1``: one lane a prefill, unpadded where the caller's shapes are its
   own, computes its chunk in one call. A model without recurrent layers has none of this:
   ``recurrent_layers`` is ``()``.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

from ... import masks
from . import attention as attn  # the module (the package exports no function by that name)
from . import states

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
        config = attn.text_config(hf_model.config)
        #: each layer's entry of :func:`~.states.layout_of` (law 4): all attention without
        #: recurrent layer types, so an attention-only model is never run to find it
        self.layout = (states.layout_of(hf_model, self.name) if _recurrent_types(config)
                       else [states.ATTENTION] * int(config.num_hidden_layers))
        self.recurrent_layers = tuple(i for i, e in enumerate(self.layout)
                                      if e not in (states.ATTENTION, states.NOTHING))
        #: each recurrent layer's kinds of state (law 4)
        self.state_kinds = {i: self.layout[i] for i in self.recurrent_layers}
        attends = [i for i, e in enumerate(self.layout) if e == states.ATTENTION]
        self.windows = ([attn.layer_window(config, i) if i in attends else None
                         for i in range(len(self.layout))] if self.recurrent_layers
                        else attn.layer_windows(hf_model.config))
        self.layers, self.kv_heads, self.head_dim = (
            shape_of(hf_model.config) if attends else (len(self.layout), 0, 0))
        self.vocab = int(config.vocab_size)
        self.context = getattr(config, "max_position_embeddings", None)
        #: whether a multi-token call that resumes a state runs one token a call (law 4)
        self.stepwise = False
        self._held = False
        #: the model's attention implementation before its first wrapper (law 3)
        self.previous = self._hold() if attends else hf_model.config._attn_implementation
        try:
            if attends:
                self._probe()
            if self.recurrent_layers:
                self._probe_states()
        except BaseException:
            self.restore()
            raise

    #: read by the engine for a model with recurrent layers (law 4): transformers' kernels give
    #: a call's final state alone, and a lane padded beside its tokens is computed stepwise
    final_states_only = True
    lanes_per_prefill = 1

    def state_bytes(self) -> int:
        """The bytes one sequence's states take over every recurrent layer (law 4): each kind's
        row in its dtype (the model's, or the one its modeling code keeps the state in)."""
        return sum(k.bytes for i in self.recurrent_layers for k in self.state_kinds[i])

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
        A recurrent layer's ``slots`` are a pair ``(rows, snapshots)``: a
        :class:`cacheidx.state.Pools` of zeros of each kind of its state (law 4; ``kv`` is the
        attention layers' alone), and a layer that keeps nothing gets ``()``. Raises
        ``ValueError`` naming the function for another ``kv``, for ``"int4"`` with an odd
        ``head_dim`` and for a list of another length, ``TypeError`` for a layer's slots of
        the other form."""
        import array_api_compat.torch as xp

        from ... import state
        from ...attention import layout
        from ...models import llama

        bits, kv_name = llama.kv_bits(_POOLS, kv), kv
        if bits == 4 and self.head_dim % 2:
            raise ValueError(f"cacheidx.{_POOLS}: int4 packs two codes a byte, so head_dim "
                             f"must be even; {self.name}'s is {self.head_dim}")
        p = next(self.hf.parameters())
        each = [slots] * self.layers if isinstance(slots, int) else list(slots)
        if len(each) != len(self.layout):
            raise ValueError(f"cacheidx.{_POOLS}: slots names {len(each)} layers; "
                             f"{self.name} has {len(self.layout)}")
        order = None if bits is None else llama.quantized_layout(xp, self.kv_heads,
                                                                 self.head_dim, p.device)

        def kv(n: Any) -> Any:
            if bits is None:
                return tuple(layout.zeros(xp, n, self.kv_heads, self.head_dim,
                                          dtype=self.hf.dtype, device=p.device) for _ in "kv")
            return llama.kv_pair(kv_name, n, self.kv_heads, self.head_dim, xp=xp,
                                 device=p.device, layout=order)

        out = []
        for i, (entry, n) in enumerate(zip(self.layout, each, strict=True)):
            if entry == states.NOTHING:
                out.append(())
            elif entry == states.ATTENTION:
                if isinstance(n, bool) or not isinstance(n, int):
                    raise TypeError(f"cacheidx.{_POOLS}: layer {i} of {self.name} attends: its "
                                    f"slots are a number, got {n!r}")
                out.append(kv(n))
            else:
                if not (isinstance(n, tuple | list) and len(n) == 2):
                    raise TypeError(f"cacheidx.{_POOLS}: layer {i} of {self.name} is "
                                    "recurrent: its slots are a pair (rows, snapshots), got "
                                    f"{n!r}")
                out.append(tuple(state.zeros(n[0], n[1], k.shape, dtype=k.dtype, xp="torch",
                                             device=p.device) for k in entry))
        return out

    def token_bytes(self, kv: str | None = None) -> int:
        """The bytes one token takes in every attention layer's pools: the model's dtype, or
        ``kv``'s codes and scales (a recurrent layer's states are :meth:`state_bytes`)."""
        from ...serve.model import token_bytes

        size = self.hf.dtype.itemsize
        attends = sum(e == states.ATTENTION for e in self.layout)
        return attends * token_bytes(self.kv_heads, self.head_dim, kv, itemsize=size)

    def forward(self, weights: Any, tokens: Any, index: Any, pools: Any) -> tuple[Any, Any]:
        """``(logits [batch, vocab], pools)``: law 1."""
        import torch

        now = self.hf.config._attn_implementation
        # the model's own attention would drop the index (a model without attention has none)
        if self.kv_heads and not attn.attends_by_index(now):
            raise RuntimeError(f"{_WHERE}: {self.name}'s attention implementation is {now!r} "
                               "(set back since it was wrapped), so it would not attend "
                               f"through the index: wrap it again with {_WHERE}")
        written = list(pools)
        first = index[0] if isinstance(index, list) else index
        # transformers takes a 4D mask as prepared and builds none (the index is the mask;
        # zeros: were a layer to add it after all, it would change nothing)
        unread = torch.zeros((1, 1, 1, 1), device=tokens.device)
        if not self.recurrent_layers:
            with torch.no_grad():  # compiled too: pools that required grad would be a new
                out = self.hf(input_ids=tokens, attention_mask=unread,  # program
                              position_ids=first.positions(), use_cache=False, logits_to_keep=1,
                              **{attn.INDEX: index, attn.POOLS: written})
            return out.logits[:, -1, :], written
        # (law 4) a traced call cannot look at its values, so it steps whenever it could need to
        if tokens.shape[1] > 1 and (torch.compiler.is_compiling() or states.mixed(index) or
                                    (self.stepwise and _resumes(first))):
            logits = None
            for t in range(tokens.shape[1]):
                logits, written = self._call(tokens[:, t:t + 1], _column(index, t), written,
                                             unread)
            return logits, written
        return self._call(tokens, index, written, unread)

    def _call(self, tokens: Any, index: Any, written: list[Any], unread: Any) -> tuple[Any, Any]:
        """One call of a model with recurrent layers over a :class:`~.states.CallCache`."""
        import torch

        first = index[0] if isinstance(index, list) else index
        call = states.CallCache(self.layout, index, written)
        # a model of recurrent layers alone is given no mask (Mamba multiplies its hidden
        # states by what it gets): it has no attention to take the placeholder
        mask = unread if self.kv_heads else None
        with torch.no_grad():
            out = self.hf(input_ids=tokens, attention_mask=mask, position_ids=first.positions(),
                          cache=call.cache, use_cache=True, logits_to_keep=1,
                          **{attn.INDEX: index, attn.POOLS: written})
        return out.logits[:, -1, :], call.stored(written)

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
        pools = self.pools(None, self._slots(1))
        index = ci.rows(1, [1], xp="torch", device=device)
        tokens = torch.zeros((1, 1), dtype=torch.int64, device=device)
        required = attn.REQUIRED.set(True)  # a layer called without the index raises
        try:
            _, written = self.forward(None, tokens, index, pools)
            missing = [i for i, e in enumerate(self.layout)
                       if e == states.ATTENTION and written[i] is pools[i]]
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


    def _slots(self, n: int) -> list[Any]:
        """Each layer's slots for ``n`` slots a pool and a state's ``(n, 0)``."""
        return [(n, 0) if i in self.state_kinds else n for i in range(len(self.layout))]

    def _probe_states(self) -> None:
        """A prompt of 6 tokens, computed whole, in two calls (2 then 4 tokens) and one token a
        call, each from zero pools (law 2 and 4): the first and the third must give one
        result, else the model's states do not carry from call to call and it is refused; the
        second differing means its kernels drop a multi-token call's start state, so such calls
        run one token a call (:attr:`stepwise`)."""
        import torch

        import cacheidx as ci

        device = next(self.hf.parameters()).device
        n = 6
        tokens = (torch.arange(n, device=device) * 37 + 11) % self.vocab
        table = torch.arange(n, device=device)[None]

        def run(cuts: list[int]) -> Any:
            pools, logits = self.pools(None, self._slots(n)), None
            for a, b in zip(cuts, cuts[1:], strict=False):
                index = ci.make(torch.arange(a, b, device=device)[None], table)
                logits, pools = self.forward(None, tokens[None, a:b], index, pools)
            return logits.float()

        whole, split = run([0, n]), run([0, 2, n])
        if not _close(whole, run(list(range(n + 1))), self.hf.dtype):
            raise ValueError(f"{_WHERE}: {self.name}'s recurrent layers do not carry their "
                             "state from one call to the next through transformers' cache "
                             "(a prompt computed whole and one token a call differ), so "
                             "cacheidx cannot serve it")
        self.stepwise = not _close(whole, split, self.hf.dtype)


_KINDS = ("full_attention", "sliding_attention")


def _recurrent_types(config: Any) -> bool:
    """Whether ``config``'s layer types name a kind other than full and sliding attention (a
    recurrent, convolution or MLP-only layer: :func:`~.states.layout_of` then reads which)."""
    try:
        types = getattr(config, "layer_types", None)
    except (AttributeError, KeyError, TypeError):
        types = None
    return bool(types) and any(t not in _KINDS for t in types)


def _close(a: Any, b: Any, dtype: Any) -> bool:
    """Whether two calls' logits agree within what their dtype's arithmetic leaves (a chunked
    and a recurrent form of one state differ by rounding; a dropped state by far more)."""
    tol = 1e-3 if dtype.itemsize >= 4 else 3e-2
    return bool((a - b).abs().max() <= tol * max(1.0, float(a.abs().max())))


def _resumes(index: Any) -> bool:
    """Whether a lane's first valid token is past position 0 (it starts from a state); read
    on the host."""
    valid = masks.valid(index)
    first = index.pos.masked_fill(~valid, -1).clamp(min=-1)
    first = first.masked_fill(~valid, int(index.pos.max()) + 1).amin(dim=1)
    return bool((valid.any(dim=1) & (first > 0)).any())


def _column(index: Any, t: int) -> Any:
    """The index of column ``t`` of the call alone (each of a list's)."""
    if isinstance(index, list):
        return [_column(ix, t) for ix in index]
    return dataclasses.replace(index, pos=index.pos[:, t:t + 1])


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
