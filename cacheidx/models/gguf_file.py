"""A GGUF file read quickly: its metadata's scalars, where each tensor lies, and the tensors
dequantised to float32 in a few whole-array NumPy passes.

The ``gguf`` package's reader builds a Python object for every element of every metadata array
(some 100,000 strings of a tokenizer's vocabulary and merges), which takes seconds; here an
array of strings is stepped over, and the tensors are views of one memory map. Dequantisation
follows the ``gguf`` package's reference formulas operation for operation (float32, no fused
multiply-add), so the weights are the same bits; a type not written here is handed to it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["GGUFFile", "Tensor", "dequantize", "dequantize_transposed", "open_gguf"]

# metadata value types: (struct format, size) of the scalars
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9

# tensor types: (elements per block, bytes per block)
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34),
           BF16: (1, 2)}


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  #: NumPy order: the outermost first (ggml lists the innermost first)
    type: int  #: ggml's type number
    data: np.ndarray  #: the raw bytes (uint8), a view of the file's memory map

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class GGUFFile:
    path: str
    version: int
    fields: dict[str, Any]  #: scalars and strings; an array is its length, under ``#key``
    tensors: dict[str, Tensor]
    data_offset: int  #: where the tensors' data starts: everything before is metadata
    _map: Any = field(default=None, repr=False)


class _Cursor:
    def __init__(self, buf: Any):
        self.buf, self.at = buf, 0

    def scalar(self, fmt: str, size: int) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return v

    def string(self) -> str:
        n = self.scalar("<Q", 8)
        s = bytes(self.buf[self.at:self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return s

    def skip_strings(self, count: int) -> None:
        buf, at = self.buf, self.at
        unpack = struct.unpack_from
        for _ in range(count):
            at += 8 + unpack("<Q", buf, at)[0]
        self.at = at

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(*_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        raise ValueError(f"cacheidx.models.gguf_file: unknown metadata type {kind}")


def open_gguf(path: str) -> GGUFFile:
    """The metadata and the tensors' places of the GGUF file at ``path`` (versions 2 and 3).
    Arrays in the metadata are stepped over: ``fields["#key"]`` is an array's length."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(mapped)
    if bytes(mapped[:4]) != b"GGUF":
        raise ValueError(f"cacheidx.models.gguf_file: {path} is not a GGUF file")
    c.at = 4
    version = c.scalar("<I", 4)
    if version not in (2, 3):
        raise ValueError(f"cacheidx.models.gguf_file: GGUF version {version} is not read "
                         "(2 and 3 are)")
    n_tensors, n_fields = c.scalar("<Q", 8), c.scalar("<Q", 8)
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = c.string()
        kind = c.scalar("<I", 4)
        if kind != _ARRAY:
            fields[key] = c.value(kind)
            continue
        item, count = c.scalar("<I", 4), c.scalar("<Q", 8)
        fields["#" + key] = count
        if item == _STRING:
            c.skip_strings(count)
        elif item in _SCALARS:
            c.at += count * _SCALARS[item][1]
        else:
            raise ValueError(f"cacheidx.models.gguf_file: {key} is an array of type {item}")
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.scalar("<Q", 8) for _ in range(c.scalar("<I", 4))]
        kind, offset = c.scalar("<I", 4), c.scalar("<Q", 8)
        infos.append((name, tuple(int(d) for d in dims[::-1]), kind, offset))
    align = int(fields.get("general.alignment", 32))
    data_offset = -(-c.at // align) * align
    whole = np.frombuffer(mapped, dtype=np.uint8)
    tensors = {}
    for name, shape, kind, offset in infos:
        start = data_offset + offset
        tensors[name] = Tensor(name, shape, kind,
                               whole[start:start + _nbytes(kind, shape)])
    return GGUFFile(path, version, fields, tensors, data_offset, mapped)


def _nbytes(kind: int, shape: tuple[int, ...]) -> int:
    if kind in _BLOCKS:
        per, size = _BLOCKS[kind]
    else:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        per, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    n = int(np.prod(shape, dtype=np.int64))
    return n // per * size


def dequantize(t: Tensor, out: np.ndarray | None = None) -> np.ndarray:
    """``t`` as float32 of its shape, into ``out`` where given (a writable float32 array of
    ``t.size`` elements: passes write into it, so no second buffer is made)."""
    n = t.size
    if out is None:
        out = np.empty(n, dtype=np.float32)
    flat = out.reshape(-1)
    if t.type == F32:
        flat[...] = t.data.view(np.float32)
    elif t.type == F16:
        flat[...] = t.data.view(np.float16)
    elif t.type == BF16:
        flat.view(np.uint32)[...] = t.data.view(np.uint16).astype(np.uint32) << 16
    elif t.type in (Q4_0, Q4_1, Q8_0):
        per = _BLOCKS[t.type][1]
        blocks = t.data.reshape(-1, per)
        rows = flat.reshape(-1, 32)
        for at in range(0, blocks.shape[0], _CHUNK):  # chunks whose temporaries stay in cache
            _blocks(t.type, blocks[at:at + _CHUNK], rows[at:at + _CHUNK])
    else:
        from gguf import quants
        from gguf.constants import GGMLQuantizationType

        flat[...] = quants.dequantize(t.data, GGMLQuantizationType(t.type)).reshape(-1)
    return out.reshape(t.shape)


_CHUNK = 1 << 14  # blocks: 2 MiB of float32


def dequantize_transposed(t: Tensor, order: np.ndarray | None = None) -> np.ndarray:
    """The matrix ``t`` ``[out, in]`` as float32 ``[in, out]`` (its rows reordered by ``order``
    first, where given), in one pass over the result: rows are dequantised a few at a time into
    a buffer that stays in cache and written out transposed from there."""
    n_out, n_in = t.shape
    raw = t.data.reshape(n_out, -1)
    if order is not None:
        raw = raw[order]  # quantised bytes: a fifth of the floats' size for Q4_1
    out = np.empty((n_in, n_out), dtype=np.float32)
    step = max(1, (1 << 16) // n_in)
    scratch = np.empty(step * n_in, dtype=np.float32)
    for at in range(0, n_out, step):
        part = raw[at:at + step]
        rows = part.shape[0]
        piece = Tensor(t.name, (rows, n_in), t.type, part.reshape(-1))
        out[:, at:at + rows] = dequantize(piece, scratch[:rows * n_in]).T
    return out


def _blocks(kind: int, blocks: np.ndarray, rows: np.ndarray) -> None:
    """Blocks of 32 weights into ``rows`` [blocks, 32] float32, as the ``gguf`` package
    computes them: Q4_0 ``d * (q - 8)``, Q4_1 ``(d * q) + m``, Q8_0 ``x * d``."""
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    if kind == Q8_0:
        np.multiply(blocks[:, 2:].view(np.int8), d, out=rows)
        return
    qs = blocks[:, -16:]
    q = np.empty(rows.shape, dtype=np.uint8)  # 16 low nibbles, then the 16 high ones
    np.bitwise_and(qs, np.uint8(0x0F), out=q[:, :16])
    np.right_shift(qs, np.uint8(4), out=q[:, 16:])
    if kind == Q4_0:
        q = q.view(np.int8)
        q -= np.int8(8)
    np.multiply(d, q, out=rows)
    if kind == Q4_1:
        rows += blocks[:, 2:4].view(np.float16).astype(np.float32)
