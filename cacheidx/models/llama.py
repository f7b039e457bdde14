"""A Llama decoder on the array API standard, threading its pools through a cache index.

The model never looks inside the index it is given: every layer stores its keys and values and
attends over the pools in place with ``index.attend`` (or, with ``Config(attention="extend")``,
the spec's path: ``index.extend`` then :func:`attend` under ``index.mask()``), and the rotary
angles come from ``index.positions()``. The same function therefore serves a whole prompt, a
chunk of a prompt over contiguous or paged pools, a prefix shared by several sequences, one-token
decoding after ``index.advance()``, and (when the index selects columns) a read of a few columns
per token.

Parameters are a plain pytree (dicts and lists of arrays of one namespace), so the forward runs
eagerly on NumPy, PyTorch or CuPy and compiles under ``jax.jit`` or ``torch.compile``. Linear
weights are stored ``[in, out]`` so a layer is ``x @ w``; the query and key weights are in the
half-split rotary layout (the first half of a head's features pairs with the second half), which
is what transformers uses; ``cacheidx.models.gguf`` converts a GGUF file's interleaved layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace

from ..attention import layout as pool_layout
from ..attention.softmax import reference
from . import deltanet

__all__ = [
    "Config",
    "attend",
    "empty_pools",
    "forward",
    "kv_bits",
    "kv_pair",
    "row_bytes",
    "turned_groups",
    "linear_layer",
    "matmul",
    "random_params",
    "rms_norm",
    "rotate",
    "tree_map",
]


@dataclass(frozen=True)
class Config:
    """The shape of a Llama decoder. Hashable, so it can be a static argument of a compiled step."""

    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    head_dim: int | None = None
    rope_base: float = 10000.0
    eps: float = 1e-5
    tied: bool = True
    #: mantissa bits every matrix product keeps of its inputs; ``None`` keeps what the
    #: library keeps. 10 makes a CPU multiply as a GPU does under TF32 (a numerical check).
    #: The products inside ``index.attend`` keep what the library keeps.
    matmul_mantissa: int | None = None
    #: the positions the model was trained for (a GGUF file's ``context_length``); a server
    #: refuses a longer request. ``None``: no limit known.
    context: int | None = None
    #: how a layer attends: ``"attend"``, ``index.attend`` over the pools in place; or
    #: ``"extend"``, the spec's path: ``extend``'s seen, then :func:`attend` under ``mask``
    attention: str = "attend"
    #: each layer's sliding window (``None``: the layer reads every position); ``None``:
    #: every layer full. :func:`forward` passes ``index.window(w)`` to a layer of window ``w``
    windows: tuple[int | None, ...] | None = None
    #: each layer's kind: ``"attention"``, or ``"linear_attention"``, a Gated DeltaNet token
    #: mixer (:mod:`cacheidx.models.deltanet`) whose states are pools under the index
    #: (:mod:`cacheidx.state`); ``None``: every layer attends
    layer_types: tuple[str, ...] | None = None
    #: a linear-attention layer's sizes (:class:`cacheidx.models.deltanet.Shape`)
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_key_dim: int = 8
    linear_value_dim: int = 8
    linear_kernel: int = 4

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(
                f"cacheidx.models.llama.Config: {self.heads} query heads do not group over "
                f"{self.kv_heads} key-value heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"cacheidx.models.llama.Config: head_dim {self.head_dim} is odd")
        if self.attention not in ("attend", "extend"):
            raise ValueError("cacheidx.models.llama.Config: attention must be 'attend' or "
                             f"'extend', got {self.attention!r}")
        if self.matmul_mantissa is not None and not 0 < self.matmul_mantissa <= 23:
            raise ValueError("cacheidx.models.llama.Config: matmul_mantissa must be 1 to 23, "
                             f"got {self.matmul_mantissa}")
        if self.windows is not None:
            windows = tuple(self.windows)
            if len(windows) != self.layers:
                raise ValueError(f"cacheidx.models.llama.Config: windows names {len(windows)} "
                                 f"layers of {self.layers}")
            for i, w in enumerate(windows):
                if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
                    raise TypeError(f"cacheidx.models.llama.Config: windows[{i}] must be None "
                                    f"or a positive integer, got {w!r}")
                if w is not None and w < 1:
                    raise ValueError(f"cacheidx.models.llama.Config: windows[{i}] must be None "
                                     f"or a positive integer, got {w}")
            object.__setattr__(self, "windows", windows)
        if self.layer_types is not None:
            kinds = tuple(self.layer_types)
            if len(kinds) != self.layers:
                raise ValueError(f"cacheidx.models.llama.Config: layer_types names "
                                 f"{len(kinds)} layers of {self.layers}")
            for i, kind in enumerate(kinds):
                if kind not in ("attention", "linear_attention"):
                    raise ValueError(f"cacheidx.models.llama.Config: layer_types[{i}] must be "
                                     f"'attention' or 'linear_attention', got {kind!r}")
                if kind != "attention" and self.layer_windows[i] is not None:
                    raise ValueError(f"cacheidx.models.llama.Config: layer {i} is a linear-"
                                     f"attention layer, which has no window (windows[{i}] = "
                                     f"{self.layer_windows[i]})")
            object.__setattr__(self, "layer_types", kinds)
            if self.recurrent_layers:
                self.linear  # noqa: B018  (checks the sizes)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window, ``None`` for a full layer."""
        return self.windows if self.windows is not None else (None,) * self.layers

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that keep states (``"linear_attention"``), in order."""
        kinds = self.layer_types or ()
        return tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")

    @property
    def linear(self) -> deltanet.Shape:
        """A linear-attention layer's sizes."""
        return deltanet.Shape(self.dim, self.linear_key_heads, self.linear_value_heads,
                              self.linear_key_dim, self.linear_value_dim, self.linear_kernel,
                              self.eps)

    @classmethod
    def tiny(cls, **overrides) -> Config:
        """A decoder small enough for the conformance suite: 2 layers, 4 query / 2 kv heads."""
        base = dict(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, rope_base=10000.0)
        base.update(overrides)
        return cls(**base)


def random_params(config: Config, *, seed: int = 0, xp=None, device=None, dtype=None) -> dict:
    """Random weights for ``config`` (for tests), as arrays of namespace ``xp`` (NumPy by default).

    Drawn with NumPy from ``seed`` and then converted, so every namespace gets the same numbers.
    """
    rng = np.random.default_rng(seed)
    c = config

    def linear(n_in, n_out):
        return rng.standard_normal((n_in, n_out), dtype=np.float32) / np.float32(math.sqrt(n_in))

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    recurrent = set(c.recurrent_layers)

    def mixer(i):
        # drawn in the order an attention layer always drew its weights
        if i in recurrent:
            return {"attn_norm": norm(c.dim), "linear": deltanet.random_params(c.linear, rng)}
        return {
            "attn_norm": norm(c.dim),
            "wq": linear(c.dim, c.heads * c.head_dim),
            "wk": linear(c.dim, c.kv_heads * c.head_dim),
            "wv": linear(c.dim, c.kv_heads * c.head_dim),
            "wo": linear(c.heads * c.head_dim, c.dim),
        }

    params = {
        "embed": rng.standard_normal((c.vocab, c.dim), dtype=np.float32),
        "layers": [
            {
                **mixer(i),
                "ffn_norm": norm(c.dim),
                "w_gate": linear(c.dim, c.hidden),
                "w_up": linear(c.dim, c.hidden),
                "w_down": linear(c.hidden, c.dim),
            }
            for i in range(c.layers)
        ],
        "norm": norm(c.dim),
    }
    if not c.tied:
        params["out"] = linear(c.dim, c.vocab)
    return convert(params, xp=xp, device=device, dtype=dtype)


def tree_map(f, tree, *more):
    """``f`` over the arrays of a params pytree (nested dicts, lists and tuples), taking the
    matching leaves of ``more`` trees of the same structure as further arguments."""
    if isinstance(tree, dict):
        return {k: tree_map(f, v, *(m[k] for m in more)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        mapped = (tree_map(f, *leaves) for leaves in zip(tree, *more, strict=True))
        # a named tuple (a quantized pool, cacheidx.quantized.Quantized) takes its fields
        return type(tree)(*mapped) if hasattr(tree, "_fields") else type(tree)(mapped)
    return f(tree, *more)


def convert(params, *, xp=None, device=None, dtype=None):
    """``params`` with every array turned into one of namespace ``xp`` (a module or a name).

    A linear weight ``[in, out]`` (every NumPy matrix but the embedding) is placed as the
    transpose of an ``[out, in]`` array, the layout of ``torch.nn.Linear``: ``x @ w`` is the
    same product, and a backend's fast linear kernel (oneDNN's, on the CPU) reads the weight
    as it stores it instead of reordering it on every call."""
    if xp is None:
        return params
    xp = _namespace(xp)

    def place(p, linear):
        if linear:
            p = np.ascontiguousarray(p.T)
        a = xp.asarray(p, device=device) if device is not None else xp.asarray(p)
        a = a if dtype is None else xp.astype(a, dtype)
        return xp.matrix_transpose(a) if linear else a

    def go(p, key=None):
        if isinstance(p, dict):
            return {k: go(v, k) for k, v in p.items()}
        if isinstance(p, list | tuple):
            return [go(v) for v in p]
        return place(p, isinstance(p, np.ndarray) and p.ndim == 2 and key != "embed")

    return go(params)


def _namespace(xp):
    """The array-API namespace of ``xp``: a backend's name (its adapter's: the built-in list is
    the registry's, ``backends.BUILTIN``), a namespace module, or a library module."""
    if not isinstance(xp, str):
        return array_namespace(xp.zeros(1)) if hasattr(xp, "zeros") else xp
    from .. import backends

    return backends.get(xp).xp


#: the quantized pools ``empty_pools(kv=...)`` makes: their codes' width in bits
KV = {"int8": 8, "int4": 4, "int4-turned": 4}
#: the channels a scale of ``"int4-turned"`` pools covers, at most: keys', values'
#: (:mod:`cacheidx.turned`; ``benchmarks/int4_layouts.py`` chose them)
TURNED_GROUPS = (16, 64)


def kv_bits(fn: str, kv) -> int | None:
    """``kv`` checked: ``None`` (float pools), ``"int8"``, ``"int4"`` or ``"int4-turned"``; its
    width in bits (``None`` for float pools). Raises ``ValueError`` naming ``cacheidx.{fn}``
    otherwise."""
    if kv is None:
        return None
    if not isinstance(kv, str) or kv not in KV:
        raise ValueError(f"cacheidx.{fn}: kv must be None (float pools), 'int8', 'int4' or "
                         f"'int4-turned', got {kv!r:.60}")
    return KV[kv]


def turned_groups(head_dim: int) -> tuple[int, int]:
    """The groups of ``"int4-turned"`` keys and values for rows of ``head_dim``: each the
    largest divisor of ``head_dim`` dividing :data:`TURNED_GROUPS`' own."""
    return tuple(math.gcd(int(head_dim), g) for g in TURNED_GROUPS)


def row_bytes(head_dim: int, kv) -> tuple[int, int]:
    """The bytes a key row and a value row of ``head_dim`` take in pools of ``kv`` (float32
    for ``None``), codes and scales (and zero points) included."""
    if kv is None:
        return 4 * head_dim, 4 * head_dim
    if kv == "int4-turned":  # float16 scales and int8 zero points, a group each
        return tuple(head_dim // 2 + 3 * (head_dim // g) for g in turned_groups(head_dim))
    row = head_dim * KV[kv] // 8 + 4  # a float32 scale a row
    return row, row


def kv_pair(kv, slots: int, kv_heads: int, head_dim: int, *, xp, device=None, layout=None,
            scale_dtype=None):
    """One layer's ``(k_pool, v_pool)`` of ``slots`` quantized as ``kv`` says (``"int8"``,
    ``"int4"``: :func:`cacheidx.quantized.zeros`; ``"int4-turned"``:
    :func:`cacheidx.turned.zeros`, keys and values in :func:`turned_groups`), in ``xp`` on
    ``device``, in the memory order ``layout`` (the library's preferred where ``None``)."""
    from .. import quantized, turned

    order = layout or quantized_layout(xp, kv_heads, head_dim, device)
    if kv == "int4-turned":
        return tuple(turned.zeros(slots, kv_heads, head_dim, group=g, xp=xp, device=device,
                                  scale_dtype=scale_dtype, layout=order)
                     for g in turned_groups(head_dim))
    return tuple(quantized.zeros(slots, kv_heads, head_dim, bits=KV[kv], xp=xp, device=device,
                                 scale_dtype=scale_dtype, layout=order) for _ in "kv")


def empty_pools(config: Config, slots, *, like=None, xp=None, dtype=None, device=None,
                layout=None, kv=None):
    """One ``(k_pool, v_pool)`` pair per layer, each ``[slots, kv_heads, head_dim]`` of zeros
    (``slots`` a number, or a sequence of each layer's: layers whose windows differ keep pools
    of their own sizes, ``cacheidx.serve.groups``). A linear-attention layer
    (``config.layer_types``) gets ``(conv, recurrent)`` instead, two
    :class:`cacheidx.state.Pools` of zeros (:func:`cacheidx.models.deltanet.empty_pools`), and
    its entry of ``slots`` is a pair ``(rows, snapshots)``: running slots, one per row of the
    table, and snapshot slots, read in blocks of the index's ``m`` (:mod:`cacheidx.state`).
    Its pools are float (``dtype``, else ``like``'s or float32) whatever ``kv`` is.

    The namespace, dtype and device are those of the array ``like`` (a weight, say) unless given.
    ``layout`` is the pools' memory order (:mod:`cacheidx.attention.layout`: ``"head"``,
    ``"token"``, or ``None`` for the order the library's attention path prefers: head-major
    for NumPy, and for torch on the CPU).

    ``kv``: ``None``, float pools of that dtype; ``"int8"`` or ``"int4"``, each pool a
    :class:`cacheidx.quantized.Quantized` of 8-bit or 4-bit codes and one scale per token
    and kv head (:func:`cacheidx.quantized.zeros`), in the same namespace, device and
    ``layout``; their scales are float32, or ``dtype`` where it is given (``like``'s dtype
    is not theirs). A layer then stores each token's codes and scales, and reads back what
    they stand for (:mod:`cacheidx.quantized`'s laws). ``"int4-turned"``: turned 4-bit pools
    (:func:`kv_pair`; float16 scales unless ``dtype`` is given). Raises ``ValueError`` for another
    ``kv``, and for ``"int4"`` with an odd ``head_dim`` (two codes a byte).
    """
    fn = "models.llama.empty_pools"
    bits = kv_bits(fn, kv)
    if bits == 4 and config.head_dim % 2:
        raise ValueError(f"cacheidx.{fn}: int4 packs two codes a byte, so head_dim must be "
                         f"even, got {config.head_dim}")
    if layout not in (None, *pool_layout.LAYOUTS):
        raise ValueError(f"cacheidx.{fn}: layout must be one of {pool_layout.LAYOUTS} or "
                         f"None, got {layout!r}")
    scale_dtype = dtype
    if like is not None:
        xp = array_namespace(like) if xp is None else _namespace(xp)
        dtype = like.dtype if dtype is None else dtype
        device = _device(like) if device is None else device
    else:
        xp = _namespace("numpy" if xp is None else xp)
        dtype = xp.float32 if dtype is None else dtype
    each = [slots] * config.layers if isinstance(slots, int | np.integer) else list(slots)
    if len(each) != config.layers:
        raise ValueError(f"cacheidx.{fn}: {len(each)} pool sizes for {config.layers} layers")
    recurrent = set(config.recurrent_layers)
    for i, n in enumerate(each):
        pair = isinstance(n, tuple | list) and len(n) == 2
        if i in recurrent and not pair:
            raise ValueError(f"cacheidx.{fn}: layer {i} keeps recurrent state: its slots must "
                             f"be a pair (rows, snapshots), got {n!r:.60}")
        if i not in recurrent and pair:
            raise ValueError(f"cacheidx.{fn}: layer {i} attends: its slots must be a number, "
                             f"got {n!r:.60}")
    if bits is None:
        def pair(n):
            return tuple(pool_layout.zeros(xp, n, config.kv_heads, config.head_dim,
                                           dtype=dtype, device=device, layout=layout)
                         for _ in "kv")
    else:
        order = layout or quantized_layout(xp, config.kv_heads, config.head_dim, device)

        def pair(n):
            return kv_pair(kv, n, config.kv_heads, config.head_dim, xp=xp, device=device,
                           layout=order, scale_dtype=scale_dtype)

    def states(rows, snapshots):
        return deltanet.empty_pools(config.linear, rows, snapshots, xp=xp, dtype=dtype,
                                    device=device)

    return [states(*n) if i in recurrent else pair(n) for i, n in enumerate(each)]


def quantized_layout(xp, kv_heads: int, head_dim: int, device=None) -> str:
    """The memory order the library's attention path prefers for a quantized pool of
    ``kv_heads`` heads of ``head_dim`` on ``device`` (:mod:`cacheidx.attention.layout`, as
    ``layout=None`` resolves it for a float pool): asked of its empty codes."""
    where = {} if device is None else {"device": device}
    return pool_layout.preferred(xp.zeros((0, int(kv_heads), int(head_dim)), dtype=xp.int8,
                                          **where))


def _device(x):
    from array_api_compat import device

    return device(x)


def matmul(a, b, mantissa: int | None = None):
    """``a @ b``, its inputs first rounded to ``mantissa`` bits when given (as TF32 keeps 10).

    The rounding is Veltkamp's split, ``c - (c - x)`` with ``c = x * (2**(p - mantissa) + 1)``
    for a dtype of ``p`` mantissa bits: arithmetic alone, so it runs in any namespace and under
    any compiler."""
    if mantissa is None:
        return a @ b
    p = int(-math.log2(array_namespace(a).finfo(a.dtype).eps))
    if mantissa >= p:
        return a @ b
    k = float(2 ** (p - mantissa) + 1)
    ca, cb = a * k, b * k
    return (ca - (ca - a)) @ (cb - (cb - b))


def rms_norm(x, weight, eps, *, xp=None):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis."""
    xp = xp or array_namespace(x, weight)
    scale = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)
    return weight * (x * scale)


def _silu(x, xp):
    # x / (1 + exp(-x)), as torch's own SiLU computes it; the clip keeps exp finite (no
    # overflow warning), where SiLU is below 1e-36 anyway. No ``where``: on torch's CPU a
    # select is unvectorised, and it made this 7x slower (279 us against 37 at [32, 1536])
    return x / (1.0 + xp.exp(-xp.clip(x, min=-88.0)))


def rotary(positions, head_dim, base, dtype, *, xp=None):
    """``(cos, sin)`` of shape ``[batch, seq, 1, head_dim]`` for the half-split rotary layout.

    The frequencies are Python floats (rounded to float32 as transformers computes them), so
    nothing here names a device: one product per frequency, stacked.
    """
    xp = xp or array_namespace(positions)
    inv = 1.0 / (np.float32(base) ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim))
    p = xp.astype(positions, dtype)
    angles = xp.stack([p * float(f) for f in inv.astype(np.float32)], axis=-1)
    angles = xp.concat([angles, angles], axis=-1)[:, :, None, :]
    return xp.cos(angles), xp.sin(angles)


def rotate(x, cos, sin, *, xp=None):
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by the angles ``(cos, sin)`` (half-split)."""
    xp = xp or array_namespace(x)
    h = x.shape[-1] // 2
    turned = xp.concat([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + turned * sin


def attend(q, seen_k, seen_v, mask, *, xp=None, mantissa=None):
    """Grouped-query attention of ``q`` over ``seen`` keys and values under ``mask``, as
    ``[batch, seq, heads * head_dim]``: :func:`cacheidx.attention.reference`, the spec's path.

    ``q`` is ``[batch, seq, heads, head_dim]``. Without a selection ``seen_*`` are
    ``[batch, context, kv_heads, head_dim]`` and ``mask`` is ``[batch, seq, context]``; under a
    selection they are ``[batch, seq, k, kv_heads, head_dim]`` and ``[batch, seq, k]``. The mask is
    the same for every head. A query that sees no column gets an output of exactly zero.
    ``mantissa`` is :func:`matmul`'s.
    """
    xp = xp or array_namespace(q, seen_k, seen_v, mask)
    out = reference(q, seen_k, seen_v, mask, xp=xp,
                    product=lambda a, b: matmul(a, b, mantissa))
    b, s = q.shape[:2]
    return xp.reshape(out, (b, s, -1))


def _at(a, b):
    return a @ b


def _products(product, mantissa):
    """The linear layers' product: ``product`` (a backend's fast one), or ``@``; with inputs
    rounded to ``mantissa`` bits when given (:func:`matmul`)."""
    if mantissa is None:
        return product or _at
    return lambda a, b: matmul(a, b, mantissa)


def layer(p, config: Config, x, cos, sin, index, pools, *, donate=False, xp=None, reduce=None,
          product=None):
    """One decoder layer over ``x`` ``[batch * seq, dim]`` (tokens flattened, so every linear is
    one matrix product, ``product(x, w)``, ``x @ w`` by default): returns
    ``(x, (k_pool, v_pool))``. ``reduce``, when given, is applied to the attention's and the
    MLP's output projections before each joins the residual: under tensor parallelism it sums
    every rank's part (``cacheidx.parallel``)."""
    # the index's namespace where it has one: array_namespace, traced by torch.compile, costs
    # more than the rest of a layer's trace (it walks sys.modules)
    xp = xp or getattr(index, "xp", None) or array_namespace(x)
    c = config
    m = c.matmul_mantissa
    q, k, v = _whole(index, x, reduce, _projected, c, product, xp)(p, x, cos, sin)
    kpool, vpool = pools
    if c.attention == "attend":
        o, kpool, vpool = index.attend(q, k, v, kpool, vpool, donate=donate)
    else:
        seen_k, kpool = index.extend(k, kpool, donate=donate)
        seen_v, vpool = index.extend(v, vpool, donate=donate)
        if seen_k.dtype == q.dtype:
            o = attend(q, seen_k, seen_v, index.mask(), xp=xp, mantissa=m)
        else:  # a quantized pool's seen is float32: attend in it, then back to the model's
            o = attend(xp.astype(q, seen_k.dtype), seen_k, xp.astype(seen_v, seen_k.dtype),
                       index.mask(), xp=xp, mantissa=m)
            o = xp.astype(o, q.dtype)
    x = _whole(index, x, reduce, _mixed, c, product, xp, reduce)(p, x, o)
    return x, (kpool, vpool)


def _projected(c, product, xp, p, x, cos, sin):
    """A layer's queries, keys and values of ``x``, rotated."""
    mm = _products(product, c.matmul_mantissa)
    b, s = cos.shape[0], cos.shape[1]
    h = rms_norm(x, p["attn_norm"], c.eps, xp=xp)
    q = xp.reshape(mm(h, p["wq"]), (b, s, c.heads, c.head_dim))
    k = xp.reshape(mm(h, p["wk"]), (b, s, c.kv_heads, c.head_dim))
    v = xp.reshape(mm(h, p["wv"]), (b, s, c.kv_heads, c.head_dim))
    return rotate(q, cos, sin, xp=xp), rotate(k, cos, sin, xp=xp), v


def _mixed(c, product, xp, reduce, p, x, o):
    """``x`` after a layer's attention output ``o`` and its MLP join the residual."""
    mm = _products(product, c.matmul_mantissa)
    reduce = reduce or _same
    x = x + reduce(mm(xp.reshape(o, (x.shape[0], c.heads * c.head_dim)), p["wo"]))
    h = rms_norm(x, p["ffn_norm"], c.eps, xp=xp)
    return x + reduce(mm(_silu(mm(h, p["w_gate"]), xp) * mm(h, p["w_up"]), p["w_down"]))


def _whole(index, x, reduce, fn, *static):
    """``fn`` with its leading arguments ``static`` bound: as the index's backend runs an eager
    call (one program per shape on JAX, which would compile each operation apart:
    :meth:`Arrays.one_program <cacheidx.backends.Arrays.one_program>`), ``fn`` itself where
    ``x`` is traced, the index is none of the library's, or ``reduce`` sums across ranks."""
    backend = getattr(index, "backend", None)
    if backend is None or reduce is not None or backend.tracing(x):
        return lambda *arrays: fn(*static, *arrays)
    run = backend.one_program(fn, static_argnums=tuple(range(len(static))))
    return lambda *arrays: run(*static, *arrays)


def _same(x):
    return x


@functools.cache
def _rounded(mantissa: int):
    """:func:`matmul` rounding to ``mantissa`` bits, one function a width (a compiled
    program's static argument, so equal from call to call)."""
    return lambda a, b: matmul(a, b, mantissa)


def linear_layer(p, config: Config, x, index, pools, *, donate=False, xp=None, product=None):
    """One decoder layer whose token mixer is a Gated DeltaNet (:mod:`cacheidx.models.deltanet`):
    ``x`` ``[batch * seq, dim]`` after the norm, the mixer and the MLP join the residual, and
    its ``(conv, recurrent)`` pools after the call (:mod:`cacheidx.state`'s laws). ``index``
    must be a :class:`cacheidx.CacheIndex` (its states' start and stores are its)."""
    c = config
    xp = xp or index.backend.xp
    mm = (product or _at) if c.matmul_mantissa is None else _rounded(c.matmul_mantissa)
    h = _whole(index, x, None, _normed, c, xp)(p["attn_norm"], x)
    o, pools = deltanet.mix(p["linear"], c.linear, h, index, pools, mm=mm, donate=donate)
    x = _whole(index, x, None, _fed, c, mm, xp)(p, x, o)
    return x, pools


def _normed(c, xp, weight, x):
    return rms_norm(x, weight, c.eps, xp=xp)


def _fed(c, mm, xp, p, x, o):
    """``x`` after a token mixer's output ``o`` and the MLP join the residual."""
    x = x + o
    h = rms_norm(x, p["ffn_norm"], c.eps, xp=xp)
    return x + mm(_silu(mm(h, p["w_gate"]), xp) * mm(h, p["w_up"]), p["w_down"])


def forward(params, config: Config, tokens, index, pools, *, donate=False, last=False,
            reduce=None, each=None):
    """Logits of ``tokens`` ``[batch, seq]`` placed by ``index``, and the pools after their stores.

    ``index`` is the index every layer reads, or a list of one per layer (layers whose tables
    differ: ``cacheidx.serve.groups``); a layer of window ``w`` (``config.windows``) reads
    its index's ``window(w)``. ``pools`` holds one ``(k_pool, v_pool)`` per layer, each
    ``[slots, kv_heads, head_dim]`` (:func:`empty_pools`); on an index that keeps nothing
    (``cacheidx.whole``) pass any pools, they come back as they were. With ``donate=True`` the
    pools are given up to ``index.extend``, which may write into their memory. With
    ``last=True`` only the last token's logits are computed (``[batch, 1, vocab]``): under
    ``cacheidx.rows`` and left padding that is every lane's last.
    ``reduce`` sums the ranks' parts of every layer's two output projections under tensor
    parallelism (:func:`layer`; ``cacheidx.parallel`` shards ``params`` and ``config``).
    ``each(p, x, cos, sin, index, pools) -> (x, pools)`` runs one layer in place of
    :func:`layer` (binding the config and options itself): a compiled one is traced once and
    serves every layer, which is regional compilation.

    A linear-attention layer (``config.layer_types``) runs :func:`linear_layer` (``each`` is
    for attention layers alone) over its ``(conv, recurrent)`` state pools
    (:func:`empty_pools`): it starts each lane from :func:`cacheidx.state.start` and stores
    through :func:`cacheidx.state.store`, under the same index. Raises ``ValueError`` for
    such a layer under ``reduce`` (tensor parallelism shards attention heads alone).
    """
    c = config
    recurrent = set(c.recurrent_layers)
    if recurrent and reduce is not None:
        raise ValueError("cacheidx.models.llama.forward: linear-attention layers "
                         f"{sorted(recurrent)} cannot be sharded (reduce is given)")
    indices = _layer_indices(index, c)
    first = indices[0]
    # the index's namespace where it names one (resolved once, outside any compiled step), and
    # its backend's product for the linear layers
    xp = getattr(first, "xp", None) or array_namespace(tokens, params["embed"])
    product = getattr(getattr(first, "backend", None), "matmul", None)
    b, s = tokens.shape
    embed = params["embed"]
    x, cos, sin = _whole(first, tokens, reduce, _embedded, c, xp)(embed, tokens,
                                                                 first.positions())
    out = []
    for i, (p, pool, ix) in enumerate(zip(params["layers"], pools, indices, strict=True)):
        if i in recurrent:
            x, pool = linear_layer(p, c, x, ix, pool, donate=donate, xp=xp, product=product)
        elif each is None:
            x, pool = layer(p, c, x, cos, sin, ix, pool, donate=donate, xp=xp, reduce=reduce,
                            product=product)
        else:
            x, pool = each(p, x, cos, sin, ix, pool)
        out.append(pool)
    head = embed if c.tied else params["out"]
    logits = _whole(first, x, reduce, _logits, c, product, xp, last, b, s)(params["norm"], head, x)
    return logits, out


def _embedded(c, xp, embed, tokens, positions):
    """The tokens' embeddings ``[batch * seq, dim]``, and the rotary angles of their
    positions."""
    x = xp.take(embed, xp.reshape(tokens, (-1,)), axis=0)
    return (x, *rotary(positions, c.head_dim, c.rope_base, x.dtype, xp=xp))


def _logits(c, product, xp, last, b, s, norm, head, x):
    """The logits ``[b, s, vocab]`` (``[b, 1, vocab]`` of each lane's last token where
    ``last``) of the last layer's ``x``: the final norm, then the head (the embedding's
    transpose where tied)."""
    if last:
        x = xp.reshape(x, (b, s, c.dim))[:, -1, :]
        s = 1
    x = rms_norm(x, norm, c.eps, xp=xp)
    logits = _products(product, c.matmul_mantissa)(x, xp.matrix_transpose(head) if c.tied
                                                      else head)
    return xp.reshape(logits, (b, s, logits.shape[-1]))


def _layer_indices(index, config: Config) -> list:
    """Each layer's index: the one given, or its own of a list, under ``window(w)`` for a
    sliding layer (one derived index per distinct index and window)."""
    if isinstance(index, list | tuple):
        if len(index) != config.layers:
            raise ValueError(f"cacheidx.models.llama.forward: {len(index)} indices for "
                             f"{config.layers} layers")
        indices = list(index)
    else:
        indices = [index] * config.layers
    if config.windows is None:
        return indices
    # one derived index per distinct (index, window), found by identity within this call
    # alone (``is``, never ``id()``: a compiler would guard on the number and compile again
    # for every new index)
    made = []  # (index, window, its derived index)
    for i, w in enumerate(config.windows):
        if w is not None:
            found = [d for ix, v, d in made if ix is indices[i] and v == w]
            if not found:
                found = [indices[i].window(w)]
                made.append((indices[i], w, found[0]))
            indices[i] = found[0]
    return indices
