"""Turned 4-bit pools: rows turned by the Hadamard matrix, then 4-bit codes above a zero point,
one scale and zero point a group of channels.

A turned pool (:class:`Turned`) is three parts under one index, each with slot axis 0, so every
law of the index holds of each unchanged, as of :class:`cacheidx.quantized.Quantized`: ``codes``
``[slots, kv_heads, d // 2]`` uint8 (two codes a byte), ``scales`` ``[slots, kv_heads, d // g]``
of a real float dtype (float16 by default) and ``zeros`` ``[slots, kv_heads, d // g]`` int8, for
groups of ``g`` channels (``g`` divides ``d``). A slot's parts are a function of its row alone:
a store writes them where it would write the row, a hole reads as all parts zero, so as zero.

Why: keys' outliers sit in a few channels, and a per-row scale (:mod:`cacheidx.quantized` at 4
bits) spends its 15 levels on them: 0.36 nats a token on SmolLM2-135M. Turned first, each
element of a row is a sum over all of them and the outliers spread; a zero point keeps the
offset many RoPE channels carry; a group of 16 (keys) or 64 (values) channels a scale, 44 and
35 bytes a row of 64, 0.154x float32's (``benchmarks/int4_layouts.py`` measures the layouts).

The laws, each kept once, here:

- **T1, the turn** (:func:`turn`). ``y = x H`` in float32, ``H`` the Sylvester Hadamard matrix
  (entries ±1, not normalised) on each block of ``b`` consecutive channels, ``b`` the largest
  power of two dividing ``d`` (the whole row for ``d`` = 64, 128, 256): ``log2 b`` stages, stage
  ``h = 1, 2, 4, ..`` taking each pair of elements ``h`` apart within a run of ``2h`` to
  ``(a + c, a - c)``. Each stage is elementwise sums in a fixed pairing, so every library
  rounds it alike. ``H H = b I``: the turn back is the turn again, times ``1 / b`` (exact).
- **T2, the quantizer** (:func:`quantize`). Over each group of ``g`` consecutive elements of
  ``y``, with ``lo`` and ``hi`` its least and greatest::

      s = max((hi - lo) * (1 / 15), |lo| * (1 / 126)), rounded to the scales' dtype
      z = round(-lo * (1 / s))                              (an int8, |z| <= 126)
      c_i = clip(round(y_i * (1 / s)) + z, 0, 15)

  ``1 / 15``, ``1 / 126`` rounded to float32 once and ``1 / s`` once a group (products, which
  every library rounds alike, as in Q1); the scale rounded as Q1 rounds one
  (:func:`cacheidx.quantized.narrowed`: to nearest, up below the dtype's smallest normal);
  ``|lo| / 126`` keeps ``z`` an int8 where a group's elements share a sign. A scale below
  float32's smallest normal is zero and its group's codes and zero point zero. A row holding
  a NaN or an infinity, or whose turn overflows, has its groups' scales NaN (infinite past the
  scales' dtype's largest) and codes and zero points zero: it reads as not finite, and
  attention's laws for such values hold over it. Codes pack as Q1's: byte ``i`` holds code
  ``i`` in its low four bits and code ``i + d/2`` in its high four.
- **T3, the values** (:func:`dequantize`). ``ŷ_i = (c_i - z) s`` in float32 (the difference an
  exact integer, one product), and the row is ``ŷ H / b`` (T1's turn): a call through a turned
  pool is the call through a float pool holding :func:`roundtrip` of its rows (``extend``'s
  seen bit for bit; ``attend``, whose law holds to a tolerance, turns a tile back by one
  matrix product by ``H / b``, a library's own sums).
- **T4, the error** (:func:`bound`). ``|y_i - ŷ_i| <= s (1/2 + 15 u) + 2**-22 (|y_i| + s)``, ``u``
  the scales' dtype's epsilon (``2**-10`` float16, ``2**-7`` bfloat16, ``2**-23`` float32): half a
  scale, but where ``s`` rounded down clips the greatest element. The row's error is the
  turned one's over ``sqrt(b)`` in the 2-norm of each block (``H / sqrt(b)`` is orthonormal),
  beyond the turns' float32 roundings.

Bit for bit on every backend, but as Q1 states for XLA's CPU: it reads a subnormal float32 as
zero, so only groups whose scale is under about ``2**-122`` may take other codes there.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from . import _arguments as arguments
from . import pools, quantized
from .static import constant

__all__ = ["Turned", "block", "bound", "dequantize", "half", "quantize", "roundtrip", "turn",
           "zeros"]

_FIFTEENTH = float(np.float32(1 / 15))
_HUNDRED_26TH = float(np.float32(1 / 126))


class Turned(NamedTuple):
    """A turned 4-bit pool: ``codes``, ``scales`` and ``zeros``, each with slot axis 0 (see the
    module). A named tuple, so a pytree to JAX and PyTorch as it is."""

    codes: Any  #: uint8 ``[slots, kv, d // 2]``, two codes a byte
    scales: Any  #: ``[slots, kv, d // g]``, a real float dtype
    zeros: Any  #: int8 ``[slots, kv, d // g]``

    bits = 4

    @property
    def group(self) -> int:
        """``g``: the channels sharing a scale and zero point."""
        return self.shape[2] // int(self.scales.shape[-1])

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(slots, kv_heads, d)``: the shape of the float pool it stands for."""
        n, kv, w = self.codes.shape
        return int(n), int(kv), 2 * int(w)

    @property
    def ndim(self) -> int:
        return 3

    def map(self, fn: Any) -> Turned:
        return Turned(fn(self.codes), fn(self.scales), fn(self.zeros))


def _xp(x: Any) -> Any:
    from array_api_compat import array_namespace

    return array_namespace(x)


def half(xp: Any) -> Any:
    """The default scales' dtype: float16, or float32 in a library without it (the standard
    names no float16: array-api-strict has none)."""
    return getattr(xp, "float16", xp.float32)


def block(d: int) -> int:
    """``b``: the largest power of two dividing ``d`` (T1's blocks)."""
    return d & -d


def turn(x: Any, *, xp: Any = None) -> Any:
    """``x H`` (law T1) of float32 rows ``x`` ``[..., d]``: its own inverse up to ``b``."""
    xp = xp or _xp(x)
    d = constant(x.shape[-1])
    lead = tuple(x.shape[:-1])
    y, h = x, 1
    while h < block(d):
        y = xp.reshape(y, (*lead, d // (2 * h), 2, h))
        a, c = y[..., 0, :], y[..., 1, :]
        y = xp.stack([a + c, a - c], axis=-2)
        h *= 2
    return xp.reshape(y, (*lead, d))


def group_of(fn: str, d: int, group: Any) -> int:
    """``group`` checked: a positive whole number dividing ``d``."""
    group = arguments.integer(fn, "group", group, least=1)
    if d % group:
        raise arguments.fail(fn, f"group must divide the rows' length {d}, got {group}")
    return group


def quantize(x: Any, group: int = 16, *, scale_dtype: Any = None, xp: Any = None
             ) -> tuple[Any, Any, Any]:
    """``(codes, scales, zeros)`` of rows ``x`` ``[..., d]`` (laws T1, T2): codes
    ``[..., d // 2]`` uint8, scales ``[..., d // group]`` in ``scale_dtype`` (float16:
    :func:`half`), zeros of that shape int8.
    ``x`` must hold real floats (``TypeError``) in rows of an even length that ``group``
    divides (``ValueError``)."""
    fn = "turned.quantize"
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"cacheidx.{fn}: x must be an array of rows, got {type(x).__name__}")
    xp = xp or _xp(x)
    if not quantized.real_floats(xp, x.dtype):
        raise TypeError(f"cacheidx.{fn}: x must hold real floats, got dtype {x.dtype}")
    scale_dtype = half(xp) if scale_dtype is None else scale_dtype
    if not quantized.real_floats(xp, scale_dtype):
        raise TypeError(f"cacheidx.{fn}: scale_dtype must be a real float dtype, got "
                        f"{scale_dtype}")
    if x.ndim == 0 or int(x.shape[-1]) % 2 or int(x.shape[-1]) == 0:
        raise arguments.fail(fn, "x must be rows [..., d] of an even length d (two codes a "
                             f"byte), got shape {list(x.shape)}")
    d = constant(x.shape[-1])
    group = group_of(fn, d, group)
    f32 = xp.float32
    x = x if x.dtype == f32 else xp.astype(x, f32)
    lead = tuple(x.shape[:-1])
    y = xp.reshape(turn(x, xp=xp), (*lead, d // group, group))
    lo, hi = xp.min(y, axis=-1), xp.max(y, axis=-1)
    s = xp.maximum((hi - lo) * _FIFTEENTH, xp.abs(lo) * _HUNDRED_26TH)
    finite = xp.all(xp.isfinite(x), axis=-1)[..., None] & xp.isfinite(s)
    s = xp.where(finite, s, xp.asarray(xp.nan, dtype=f32))
    # below float32's smallest normal: zero (XLA flushes such a scale on the CPU, and its
    # reciprocal would overflow), as Q1
    s = xp.where(finite & (s < xp.finfo(f32).smallest_normal), xp.zeros((), dtype=f32), s)
    if scale_dtype != f32:
        s = quantized.narrowed(s, scale_dtype, xp=xp)  # the codes follow the stored scale
    ok = xp.isfinite(s) & (s > 0)
    zero = xp.zeros((), dtype=f32)
    inverse = 1.0 / xp.where(ok, s, xp.ones((), dtype=f32))
    z = xp.where(ok, xp.round(-lo * inverse), zero)
    c = xp.clip(xp.round(y * inverse[..., None]) + z[..., None], 0.0, 15.0)
    c = xp.reshape(xp.where(ok[..., None], c, zero), (*lead, d))
    u = xp.astype(c, xp.uint8)
    mid = d // 2
    codes = xp.bitwise_or(u[..., :mid], xp.bitwise_left_shift(u[..., mid:], 4))
    scales = s if scale_dtype == f32 else xp.astype(s, scale_dtype)
    return codes, scales, xp.astype(z, xp.int8)


def dequantize(pool: Any, *, xp: Any = None) -> Any:
    """The float32 rows a turned pool, or a read of one, stands for (law T3): ``[..., d]``."""
    fn = "turned.dequantize"
    codes, scales, zeros = pool
    xp = xp or _xp(codes)
    if codes.dtype != xp.uint8 or zeros.dtype != xp.int8:
        raise TypeError(f"cacheidx.{fn}: codes must be uint8 and zeros int8, got "
                        f"{codes.dtype} and {zeros.dtype}")
    if not quantized.real_floats(xp, scales.dtype):
        raise TypeError(f"cacheidx.{fn}: scales must hold real floats, got {scales.dtype}")
    d, n = 2 * constant(codes.shape[-1]), constant(scales.shape[-1])
    if (tuple(scales.shape) != tuple(zeros.shape) or n == 0 or d % n
            or tuple(scales.shape[:-1]) != tuple(codes.shape[:-1])):
        raise arguments.fail(fn, f"codes [..., d // 2] take scales and zeros [..., d // g] for "
                             f"g dividing d, got codes {list(codes.shape)}, scales "
                             f"{list(scales.shape)} and zeros {list(zeros.shape)}")
    return turn(turned_values(pool, xp), xp=xp) * (1.0 / block(d))


def turned_values(pool: Any, xp: Any) -> Any:
    """``ŷ = (c - z) s`` of a turned pool or a read of one (T3's first half), float32."""
    codes, scales, zeros = pool
    f32 = xp.float32
    d, n = 2 * constant(codes.shape[-1]), constant(scales.shape[-1])
    lead = tuple(codes.shape[:-1])
    c = xp.concat([xp.bitwise_and(codes, 15), xp.bitwise_right_shift(codes, 4)], axis=-1)
    c = xp.reshape(xp.astype(c, f32), (*lead, n, d // n))
    s = scales if scales.dtype == f32 else xp.astype(scales, f32)
    return xp.reshape((c - xp.astype(zeros, f32)[..., None]) * s[..., None], (*lead, d))


def roundtrip(x: Any, group: int = 16, *, scale_dtype: Any = None, xp: Any = None) -> Any:
    """``x`` as a turned pool would give it back: :func:`dequantize` of :func:`quantize`."""
    xp = xp or _xp(x)
    return dequantize(quantize(x, group, scale_dtype=scale_dtype, xp=xp), xp=xp)


def bound(y: Any, s: Any) -> np.ndarray:
    """Law T4's bound on ``|y_i - ŷ_i|``, float64 NumPy: turned elements ``y`` ``[..., n, g]``
    of groups whose stored scales are ``s`` ``[..., n]`` (a NumPy array of their dtype)."""
    s = np.asarray(s)
    u = float(np.finfo(s.dtype).eps)
    y = np.abs(np.asarray(y, dtype=np.float64))
    s = s.astype(np.float64)[..., None]
    return s * (0.5 + 15 * u) + 2.0**-22 * (y + s)


def zeros(slots: int, kv_heads: int, dim: int, *, group: int = 16, xp: Any = None,
          device: Any = None, scale_dtype: Any = None, layout: str = "token") -> Turned:
    """An empty turned pool standing for ``[slots, kv_heads, dim]``: every part zero. ``xp`` a
    namespace or backend name (NumPy by default), ``scale_dtype`` a real float dtype of it
    (float16), ``layout`` the parts' memory order (``"token"`` or ``"head"``, as
    :func:`cacheidx.quantized.zeros`)."""
    from . import backends

    fn = "turned.zeros"
    slots = arguments.integer(fn, "slots", slots, least=0)
    kv_heads = arguments.integer(fn, "kv_heads", kv_heads, least=1)
    dim = arguments.integer(fn, "dim", dim, least=1)
    if dim % 2:
        raise arguments.fail(fn, f"4-bit codes pack two to a byte: dim must be even, got {dim}")
    group = group_of(fn, dim, group)
    if layout not in ("token", "head"):
        raise arguments.fail(fn, f"layout must be 'token' or 'head', got {layout!r}")
    backend = backends.get(xp)
    xp, made = backend.xp, backend.zeros
    scale_dtype = half(xp) if scale_dtype is None else scale_dtype
    if not xp.isdtype(scale_dtype, "real floating"):
        raise TypeError(f"cacheidx.{fn}: scale_dtype must be a real float dtype, got "
                        f"{scale_dtype}")
    n = dim // group
    parts = ((dim // 2, xp.uint8), (n, scale_dtype), (n, xp.int8))
    if layout == "token":
        return Turned(*(made((slots, kv_heads, w), t, device) for w, t in parts))
    return Turned(*(xp.permute_dims(made((kv_heads, slots, w), t, device), (1, 0, 2))
                    for w, t in parts))


def check(fn: str, name: str, pool: Turned, backend: Any) -> None:
    """A turned pool's own obligations, each failure naming ``cacheidx.{fn}``."""
    quantized.of_library(fn, name, pool, backend)
    xp = backend.xp
    codes, scales, zero = pool
    if codes.dtype != xp.uint8 or zero.dtype != xp.int8:
        raise TypeError(f"cacheidx.{fn}: {name}.codes must be uint8 and {name}.zeros int8, got "
                        f"{codes.dtype} and {zero.dtype}")
    if not xp.isdtype(scales.dtype, "real floating"):
        raise TypeError(f"cacheidx.{fn}: {name}.scales must hold real floats, got "
                        f"{scales.dtype}")
    n = int(scales.shape[-1]) if scales.ndim == 3 else 0
    if (codes.ndim != 3 or scales.ndim != 3 or tuple(zero.shape) != tuple(scales.shape)
            or tuple(scales.shape[:2]) != tuple(codes.shape[:2]) or n == 0
            or (2 * int(codes.shape[2])) % n):
        raise arguments.fail(fn, f"{name} must hold codes [slots, kv_heads, dim // 2] and "
                             f"scales and zeros [slots, kv_heads, dim // group], got codes "
                             f"{list(codes.shape)}, scales {list(scales.shape)} and zeros "
                             f"{list(zero.shape)}")


class _Turned:
    """The kind of a :class:`Turned` pool (:class:`cacheidx.pools.Kind`): it stores each row's
    codes, scales and zero points (T1, T2); a read stands for their turned-back values (T3),
    decoded a chunk at a time. The CPU kernel reads it, a decode step's query and output
    turned around the call: through each lane's row of the table, and a run of slots every
    query sees whole (by the same paged entry, over the run's slots in order)."""

    name = "turned"
    cast = True
    kernel = frozenset({"paged", "run"})

    def parts(self, pool: Any) -> tuple[Any, ...]:
        return tuple(pool)

    def remade(self, parts: Any) -> Any:
        return Turned(*parts)

    def check(self, fn: str, name: str, pool: Any, backend: Any) -> None:
        check(fn, name, pool, backend)

    def takes(self, fn: str, name: str, values: Any, pool: Any, xp: Any) -> None:
        quantized.values_for(fn, name, values, xp)

    def encode(self, pool: Any, values: Any, xp: Any) -> tuple[Any, ...]:
        return quantize(values, pool.group, scale_dtype=pool.scales.dtype, xp=xp)

    def decode(self, read: Any, xp: Any) -> Any:
        return dequantize(read, xp=xp)

    def factors(self, read: Any, dtype: Any, xp: Any) -> tuple[Any, Any]:
        # attention's law holds to a tolerance, not bit for bit: the turn back as one product
        # by H / b (a library's matrix product) rather than T3's stages of sums, which cost a
        # decode step 8x its float pools' time in small operations
        y = turned_values(read, xp)
        back = _back(xp, constant(y.shape[-1]), y.dtype, _device(y))
        if y.ndim != 4:
            x = y @ back
        else:  # a tile [batch, T, kv, d]: made head by head, each head's rows contiguous, as
            # a head-major pool's (a lane's product per head streams them; token-major rows
            # read head by head cost oneDNN a copy each, 100x the product)
            x = xp.permute_dims(xp.permute_dims(y, (0, 2, 1, 3)) @ back, (0, 2, 1, 3))
        return (x if x.dtype == dtype else xp.astype(x, dtype)), None


def _device(x: Any) -> Any:
    from array_api_compat import device

    return device(x)


def _back(xp: Any, d: int, dtype: Any, device: Any) -> Any:
    """``H / b`` as a ``[d, d]`` matrix in ``xp`` on ``device`` (a copy: the cached one is
    never an array a caller could write)."""
    return xp.asarray(back_host(d), dtype=dtype, device=device, copy=True)


@functools.cache
def back_host(d: int) -> np.ndarray:
    """``H / b`` as a ``[d, d]`` NumPy matrix (block-diagonal, ``b`` = :func:`block` of ``d``),
    each entry ``±1 / b``, exact; cached, so read-only (``writeable`` off)."""
    b = block(d)
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    out = np.kron(np.eye(d // b, dtype=np.float32), h) * np.float32(1 / b)
    out.flags.writeable = False
    return out


pools.register(Turned, _Turned())
