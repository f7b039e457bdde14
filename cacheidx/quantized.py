"""Quantized pools: keys and values kept as 8-bit or 4-bit codes, one scale per token and kv head.

A quantized pool is a pair of pools under one index (:class:`Quantized`): ``codes``
``[slots, kv_heads, d]`` of int8 (8 bits), or ``[slots, kv_heads, d // 2]`` of uint8 (4 bits,
two codes a byte), and ``scales`` ``[slots, kv_heads]`` of a real float dtype (float32 by
default). Both have slot axis 0, so every law of the index holds of each unchanged: a call
stores its tokens' codes and scales where it would store their rows, through the same plan
(drop, donation, O(tokens) writes); a hole or an unseen column reads as codes and scale zero,
so as zero; a page's scales sit at its slots, so they travel with its codes wherever a table
names them (prefix hits, forks, sliding groups).

The laws, each kept once, here:

- **Q1, the quantizer** (:func:`quantize`). A row ``x`` (one token at one kv head, ``d``
  elements, any real float dtype, worked in float32) is stored as::

      a = max_i |x_i|
      s = a * (1 / Q), rounded to the scales' dtype
      c_i = clip(round(x_i * (1 / s)), -Q, Q)

  with ``Q = 127`` (8 bits) or ``7`` (4 bits) and ``round`` the standard's (half to even).
  A scale is rounded to a narrower dtype (float16, bfloat16) to nearest, half to even, but up
  where it falls below that dtype's smallest normal (float16 scales under ``2**-14``: rows
  of ``a`` below about ``7.8e-3`` at 8 bits), so that Q3 holds there too; :func:`narrowed`
  rounds it by exact float32 arithmetic, never by a cast a compiler may drop, so the codes
  follow the stored scale under ``torch.compile`` and ``jax.jit`` as eagerly.
  ``1 / Q`` is rounded to float32 once and ``1 / s`` once per row: products, which every
  library rounds alike, where a division is one a compiler may turn into a product by a
  reciprocal (XLA does, for a constant and for a scale broadcast over its row, eagerly and in
  ``jit``: it moved half of the halfway codes). An all-zero row has ``s = 0`` and codes zero,
  never NaN, and so has a row whose scale would fall below float32's smallest normal number
  (``a`` below ``127 * 2**-126``, about 1.5e-36, at 8 bits: XLA flushes such a scale to zero
  on the CPU, and its reciprocal would overflow); a row holding a NaN or an
  infinity has ``s = NaN`` and codes zero, so it reads as NaN across the row, and attention's
  laws for values that are not finite then hold over it as over a float pool (nothing is
  refused: a compiled step cannot look at its values). A scale past its dtype's largest
  (float16 scales of rows beyond ``65504 * Q``) is infinite: the row reads as not finite.
  ``x`` must hold real floats (a ``TypeError`` otherwise: complex, integer and boolean rows
  are refused, never cast) and its rows at least one element (a ``ValueError``).

  Bit for bit on every backend, but one: XLA's CPU reads a subnormal float32 as zero (DAZ),
  so JAX quantizes an element below float32's smallest normal (``|x_i| < 2**-126``) as zero
  where another library may give it ``±1``, which happens only in rows whose scale is under
  ``2**-125`` (``a`` under ``254 * 2**-126`` at 8 bits). No array operation can see such an
  element on XLA's CPU, so this is stated rather than mended; such an element errs by less
  than ``2**-126`` (:func:`bound`, ``flushed=True``).
- **Q2, the values** (:func:`dequantize`). Element ``i`` of a stored row is ``c_i * s`` in
  float32 (codes int8 or uint8, scales real floats of the codes' shape but their last axis:
  anything else is refused, never broadcast). A call through a quantized pool is the call
  through a float pool holding its rows' values, :func:`roundtrip` of its own: ``extend``'s
  seen is the codes times their scales, read as ``extend`` reads a float pool (its zeroing
  law unchanged), and ``attend`` equals softmax attention over that seen.
- **Q3, the error** (:func:`bound`). ``|x_i - c_i s| <= s / 2``, beyond the float32
  roundings of ``1 / s``, ``x_i * (1 / s)`` and ``c_i * s`` (``2**-22`` of ``|x_i| + s``
  bounds them), for both widths, ``s`` the stored scale, and every row whose scale is a
  normal float32 before its rounding to the scales' dtype: ``s / 2`` is ``a / 254`` at 8 bits
  and ``a / 14`` at 4 bits in float32 (a row flushed to zero errs by its own size, below
  ``Q`` times the smallest normal). The scale's own rounding to a narrower dtype moves ``s``,
  never the bound, for every scale the dtype can hold, float16's subnormal ones included: the
  codes are computed from the rounded scale, clipped at ``Q``; rounded to nearest, a normal
  scale loses at most a relative ``2**-8`` (bfloat16), so the clip errs by at most
  ``127 * 2**-8 s < s / 2``, and a subnormal one is rounded up, so nothing is clipped.
- **4-bit codes, packed.** Byte ``i`` of a row holds code ``i`` in its low four bits and code
  ``i + d/2`` in its high four, each as ``c + 8`` (so a row is two halves; a product over a
  row is one over each half, never an interleave to undo).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _arguments as arguments
from . import pools

__all__ = ["Quantized", "bound", "dequantize", "floats", "narrowed", "parts", "quantize",
           "roundtrip", "zeros"]

#: the largest code of each width
LARGEST = {8: 127, 4: 7}
#: ``1 / Q`` of each width, rounded to float32
_INVERSE = {bits: float(np.float32(1 / q)) for bits, q in LARGEST.items()}


class Quantized(NamedTuple):
    """A quantized pool: ``codes`` and ``scales``, both with slot axis 0 (see the module).

    A named tuple, so it is a pytree to JAX and PyTorch as it is (two leaves, its width in
    their dtypes): ``jax.jit``, ``torch.compile`` and ``tree_map`` take it as they take a
    pair of arrays."""

    codes: Any  #: int8 ``[slots, kv, d]``, or uint8 ``[slots, kv, d // 2]`` (4 bits packed)
    scales: Any  #: ``[slots, kv]``, a real float dtype

    @property
    def bits(self) -> int:
        """8 (int8 codes) or 4 (uint8 bytes, two codes each)."""
        return 4 if _packed(self.codes) else 8

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(slots, kv_heads, d)``: the shape of the float pool it stands for."""
        n, kv, w = self.codes.shape
        return int(n), int(kv), int(w) * (2 if self.bits == 4 else 1)

    @property
    def ndim(self) -> int:
        return 3

    def map(self, fn: Any) -> Quantized:
        """``Quantized(fn(codes), fn(scales))``: what a law over slots does to each."""
        return Quantized(fn(self.codes), fn(self.scales))


#: the arrays a pool is: itself, or a quantized pool's codes and scales
parts = pools.parts


def _packed(codes: Any) -> bool:
    # by the dtype's name, the same in every library (no namespace to find under a tracer)
    return str(codes.dtype).endswith("uint8")


def _xp(x: Any) -> Any:
    from array_api_compat import array_namespace

    return array_namespace(x)


def zeros(slots: int, kv_heads: int, dim: int, *, bits: int = 8, xp: Any = None,
          device: Any = None, scale_dtype: Any = None, layout: str = "token") -> Quantized:
    """An empty quantized pool standing for ``[slots, kv_heads, dim]``: codes and scales zero.
    ``xp`` a namespace or backend name (as the constructors take it; NumPy by default),
    ``scale_dtype`` a real float dtype of it (float32 by default), ``layout`` the codes' and
    scales' memory order (:mod:`cacheidx.attention.layout`: ``"token"`` or ``"head"``, each
    head's slots one after another)."""
    from . import backends

    fn = "quantized.zeros"
    bits = width(fn, bits)
    slots = arguments.integer(fn, "slots", slots, least=0)
    kv_heads = arguments.integer(fn, "kv_heads", kv_heads, least=1)
    dim = arguments.integer(fn, "dim", dim, least=1)
    if bits == 4 and dim % 2:
        raise arguments.fail(fn, f"4-bit codes pack two to a byte: dim must be even, got {dim}")
    if layout not in ("token", "head"):
        raise arguments.fail(fn, f"layout must be 'token' or 'head', got {layout!r}")
    backend = backends.get(xp)
    xp, zeros = backend.xp, backend.zeros  # page-aligned on the host
    scale_dtype = xp.float32 if scale_dtype is None else scale_dtype
    if not xp.isdtype(scale_dtype, "real floating"):
        raise TypeError(f"cacheidx.{fn}: scale_dtype must be a real float dtype, got "
                        f"{scale_dtype}")
    code = xp.int8 if bits == 8 else xp.uint8
    w = dim if bits == 8 else dim // 2
    if layout == "token":
        return Quantized(zeros((slots, kv_heads, w), code, device),
                         zeros((slots, kv_heads), scale_dtype, device))
    return Quantized(
        xp.permute_dims(zeros((kv_heads, slots, w), code, device), (1, 0, 2)),
        xp.permute_dims(zeros((kv_heads, slots), scale_dtype, device), (1, 0)))


def width(fn: str, bits: Any) -> int:
    """``bits`` checked: 8 or 4."""
    if isinstance(bits, bool) or bits not in LARGEST:
        raise arguments.fail(fn, f"bits must be 8 or 4, got {bits!r}")
    return int(bits)


def quantize(x: Any, bits: int = 8, *, scale_dtype: Any = None, xp: Any = None
             ) -> tuple[Any, Any]:
    """``(codes, scales)`` of rows ``x`` ``[..., d]`` (law Q1): codes ``[..., d]`` int8, or
    ``[..., d // 2]`` uint8 at 4 bits; scales ``[...]`` in ``scale_dtype`` (float32). ``xp``
    is ``x``'s namespace (found from ``x`` without it; a compiler traces faster with it).
    ``x`` must hold real floats (``TypeError``) in rows of at least one element
    (``ValueError``), ``scale_dtype`` be a real float dtype (``TypeError``); a float16 or
    bfloat16 ``scale_dtype`` keeps Q1 and Q3 as the module states them, eagerly and compiled
    (:func:`narrowed`)."""
    fn = "quantized.quantize"
    bits = width(fn, bits)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"cacheidx.{fn}: x must be an array of rows, got {type(x).__name__}")
    xp = xp or _xp(x)
    if not real_floats(xp, x.dtype):
        raise TypeError(f"cacheidx.{fn}: x must hold real floats, got dtype {x.dtype}")
    if scale_dtype is not None and not real_floats(xp, scale_dtype):
        raise TypeError(f"cacheidx.{fn}: scale_dtype must be a real float dtype, got "
                        f"{scale_dtype}")
    if x.ndim == 0 or int(x.shape[-1]) == 0:
        raise arguments.fail(fn, "x must be rows [..., d] of at least one element each, got "
                             f"shape {list(x.shape)}")
    if bits == 4 and int(x.shape[-1]) % 2:
        raise arguments.fail(fn, "4-bit codes pack two to a byte: the rows' length must be "
                             f"even, got {int(x.shape[-1])}")
    q = LARGEST[bits]
    f32 = xp.float32
    x = x if x.dtype == f32 else xp.astype(x, f32)
    top = xp.max(xp.abs(x), axis=-1)
    finite = xp.isfinite(top)
    scale_dtype = f32 if scale_dtype is None else scale_dtype
    s = xp.where(finite, top * _INVERSE[bits], xp.asarray(xp.nan, dtype=f32))
    # a scale below float32's smallest normal is zero (XLA flushes it so on the CPU; kept, its
    # reciprocal would overflow)
    s = xp.where(finite & (s < xp.finfo(f32).smallest_normal), xp.zeros((), dtype=f32), s)
    if scale_dtype != f32:
        s = narrowed(s, scale_dtype, xp=xp)  # the codes follow the stored scale
    ok = finite & (s > 0)
    # an all-zero row, or one that is not finite, divides by one and keeps codes zero; times
    # the scale's reciprocal, not divided by the scale: XLA divides by a broadcast row so
    # (eagerly and in jit), which moves half of the halfway codes; a product rounds alike
    # everywhere
    c = xp.round(x * (1.0 / xp.where(ok, s, xp.ones((), dtype=f32)))[..., None])
    c = xp.where(ok[..., None], xp.clip(c, -float(q), float(q)), xp.zeros((), dtype=f32))
    scales = s if scale_dtype == f32 else xp.astype(s, scale_dtype)
    if bits == 8:
        return xp.astype(c, xp.int8), scales
    half = int(x.shape[-1]) // 2
    u = xp.astype(c + 8, xp.uint8)
    return xp.bitwise_or(u[..., :half], xp.bitwise_left_shift(u[..., half:], 4)), scales


def real_floats(xp: Any, dtype: Any) -> bool:
    """Whether ``dtype`` is a real float dtype of ``xp``'s library, NumPy's ``bfloat16``
    (ml_dtypes': a JAX array of bfloat16 comes to NumPy as one) included."""
    try:
        return bool(xp.isdtype(dtype, "real floating"))
    except (TypeError, AttributeError):  # the standard's NumPy knows no ml_dtypes dtype
        try:
            return np.dtype(dtype).name == "bfloat16"
        except TypeError:
            return False


def narrowed(s: Any, dtype: Any, *, xp: Any) -> Any:
    """Scales ``s`` (float32, each zero, NaN, or a normal float32 below ``2**127``: a scale is at
    most float32's largest over 7) rounded to the narrower real
    float ``dtype`` as Q1 says, still float32: to nearest (half to even) where the result is a
    normal number of ``dtype``, up where it is below ``dtype``'s smallest normal (Q3's bound:
    a scale rounded down there could lose half its size, and the codes clipped at ``Q`` would
    err by many scales), infinite past its largest.

    By arithmetic on exact float32 values, never a cast to ``dtype`` and back: torch's inductor
    keeps a value cast to a narrow dtype in float32 within a kernel (it rounds only where it
    stores one), and XLA may drop such a pair of casts (excess precision), so that codes
    computed from the cast scale come from the unrounded one. Each step is exact, or one
    rounding a compiler keeps: ``P``, the largest power of two not above ``s`` (a float32
    constant, found from ``floor(log2 s)`` and corrected by a step either way), ``m = s / P``
    in ``[1, 2)``, ``round(m 2^(p-1)) 2^(1-p) P`` for ``p`` significand bits; under
    ``dtype``'s smallest normal, ``ceil(s / q) q`` for its quantum ``q``. The result is
    exactly representable in ``dtype``: casting it is exact."""
    f32 = xp.float32
    info = xp.finfo(dtype)
    half = 1.0 / float(info.eps)  # 2^(p - 1)
    tiny = float(info.smallest_normal)
    where = {"device": s.device} if hasattr(s, "device") else {}
    one = xp.ones((), dtype=f32)
    ok = xp.isfinite(s) & (s >= xp.finfo(f32).smallest_normal)
    safe = xp.where(ok, s, one)
    # powers of two 2^-126 .. 2^127, each exact in float32: P by its exponent, never xp.pow
    # (which a library may compute as exp(y log x), not exactly)
    powers = xp.asarray([2.0**e for e in range(-126, 128)], dtype=f32, **where)
    e = xp.clip(xp.floor(xp.log2(safe)), -126.0, 127.0)
    # the standard's take is of 1-d indices (torch's index_select refuses others): flattened
    at = xp.reshape(xp.astype(e, xp.int32) + 126, (-1,))
    p = xp.reshape(xp.take(powers, at), tuple(e.shape))
    p = xp.where(p > safe, p * 0.5, p)
    p = xp.where(p <= safe * 0.5, p * 2.0, p)
    r = xp.round((safe / p) * half) * (1.0 / half) * p
    if tiny > float(xp.finfo(f32).smallest_normal):  # float16: subnormal scales, rounded up
        quantum = tiny * float(info.eps)
        r = xp.where(safe < tiny, xp.ceil(xp.clip(safe, None, tiny) * (1.0 / quantum)) * quantum,
                     r)
    r = xp.where(r > float(info.max), xp.asarray(xp.inf, dtype=f32), r)
    return xp.where(ok, r, s)  # zero and NaN are their own rounding


def bound(x: Any, s: Any, *, flushed: bool = False) -> np.ndarray:
    """Law Q3's bound on ``|x_i - c_i s|``, in float64 NumPy: elements ``x`` ``[..., d]``
    (float32 values) of rows whose stored scales are ``s`` (``[..., 1]`` or ``[...]``, any
    real float dtype). ``s / 2``, and ``2**-22`` of ``|x_i| + s`` for float32's roundings of
    ``1 / s``, ``x_i (1 / s)`` and ``c_i s``. ``flushed``: the bound XLA's CPU keeps, an
    element below float32's smallest normal read as zero, so erring by less than
    ``2**-126`` at most (see the module)."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    s = np.asarray(s).astype(np.float64)
    if s.ndim == x.ndim - 1:
        s = s[..., None]
    out = s / 2 + 2.0**-22 * (x + s)
    if flushed:
        out = np.where(x < 2.0**-126, np.maximum(out, 2.0**-126), out)
    return out


def floats(codes: Any, dtype: Any = None, *, xp: Any = None) -> Any:
    """The codes ``c`` of ``codes`` (unpacked at 4 bits) as floats of ``dtype`` (float32):
    ``[..., d]``, exactly the integers they hold."""
    xp = xp or _xp(codes)
    dtype = xp.float32 if dtype is None else dtype
    if not _packed(codes):
        return xp.astype(codes, dtype)
    low = xp.astype(xp.bitwise_and(codes, 15), dtype)
    high = xp.astype(xp.bitwise_right_shift(codes, 4), dtype)
    return xp.concat([low, high], axis=-1) - 8


def dequantize(pool: Any, *, xp: Any = None) -> Any:
    """The float32 values ``c * s`` of a quantized pool, or of any ``(codes, scales)`` read from
    one (law Q2): ``[..., d]``. Codes must be int8 or uint8 and scales real floats
    (``TypeError``), the scales of the codes' shape but their last axis (``ValueError``):
    never broadcast, never another integer read as codes."""
    fn = "quantized.dequantize"
    codes, scales = pool
    xp = xp or _xp(codes)
    if codes.dtype not in (xp.int8, xp.uint8):
        raise TypeError(f"cacheidx.{fn}: codes must be int8 (8 bits) or uint8 (4 bits, two a "
                        f"byte), got {codes.dtype}")
    if not real_floats(xp, scales.dtype):
        raise TypeError(f"cacheidx.{fn}: scales must hold real floats, got {scales.dtype}")
    if codes.ndim == 0 or tuple(scales.shape) != tuple(codes.shape[:-1]):
        raise arguments.fail(fn, f"scales must have the codes' shape but their last axis: "
                             f"codes {list(codes.shape)} take scales "
                             f"{list(codes.shape[:-1])}, got {list(scales.shape)}")
    f32 = xp.float32
    s = scales if scales.dtype == f32 else xp.astype(scales, f32)
    return floats(codes, f32, xp=xp) * s[..., None]


def roundtrip(x: Any, bits: int = 8, *, scale_dtype: Any = None, xp: Any = None) -> Any:
    """``x`` as a quantized pool would give it back: :func:`dequantize` of :func:`quantize`."""
    bits = width("quantized.roundtrip", bits)
    xp = xp or _xp(x)
    return dequantize(quantize(x, bits, scale_dtype=scale_dtype, xp=xp), xp=xp)


def check(fn: str, name: str, pool: Quantized, backend: Any) -> None:
    """A quantized pool's own obligations, each failure naming ``cacheidx.{fn}``: its codes
    ``[slots, kv, w]`` int8 or uint8, its scales ``[slots, kv]`` of real floats, both of the
    index's library (``backend``'s)."""
    of_library(fn, name, pool, backend)
    codes, scales = pool
    xp = backend.xp
    if codes.dtype not in (xp.int8, xp.uint8):
        raise TypeError(f"cacheidx.{fn}: {name}.codes must be int8 (8 bits) or uint8 (4 bits, "
                        f"two a byte), got {codes.dtype}")
    if not xp.isdtype(scales.dtype, "real floating"):
        raise TypeError(f"cacheidx.{fn}: {name}.scales must hold real floats, got "
                        f"{scales.dtype}")
    if codes.ndim != 3 or scales.ndim != 2 or tuple(scales.shape) != tuple(codes.shape[:2]):
        raise arguments.fail(fn, f"{name} must hold codes [slots, kv_heads, dim] and scales "
                             f"[slots, kv_heads], got codes {list(codes.shape)} and scales "
                             f"{list(scales.shape)}")


def of_library(fn: str, name: str, pool: Any, backend: Any) -> None:
    """Each part of a pool of codes (a named tuple: :class:`Quantized`, a turned pool) is an
    array of the index's library, else a ``TypeError`` naming ``cacheidx.{fn}`` and the part."""
    for part, x in zip(pool._fields, pool):
        if not backend.same_library(x):
            raise TypeError(f"cacheidx.{fn}: {name}.{part} must be an array of the index's "
                            f"library ({backend.name}), got {type(x).__name__}")


def values_for(fn: str, name: str, values: Any, xp: Any) -> None:
    """What a call stores into a quantized pool must be real floats."""
    if not xp.isdtype(values.dtype, "real floating"):
        raise TypeError(f"cacheidx.{fn}: {name} stored into a quantized pool must hold real "
                        f"floats, got {values.dtype}")


class _Codes:
    """The kind of a :class:`Quantized` pool (:class:`cacheidx.pools.Kind`): it stores each
    row's codes and scale (Q1), a read stands for their product (Q2), folded as ``(floats of
    the codes, scales)``, and the CPU kernel reads it."""

    name = "quantized"
    cast = True
    kernel = frozenset({"paged", "run"})

    def parts(self, pool: Any) -> tuple[Any, ...]:
        return tuple(pool)

    def remade(self, parts: Any) -> Any:
        return Quantized(*parts)

    def check(self, fn: str, name: str, pool: Any, backend: Any) -> None:
        check(fn, name, pool, backend)

    def takes(self, fn: str, name: str, values: Any, pool: Any, xp: Any) -> None:
        values_for(fn, name, values, xp)

    def encode(self, pool: Any, values: Any, xp: Any) -> tuple[Any, ...]:
        return quantize(values, pool.bits, scale_dtype=pool.scales.dtype, xp=xp)

    def decode(self, read: Any, xp: Any) -> Any:
        return dequantize(read, xp=xp)

    def factors(self, read: Any, dtype: Any, xp: Any) -> tuple[Any, Any]:
        return floats(read.codes, dtype, xp=xp), read.scales


pools.register(Quantized, _Codes())
