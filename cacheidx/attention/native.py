"""On the CPU, one lane's run of quantized slots read by a small C kernel: codes cast to floats in
registers, never in memory (attention's law 6 for quantized pools, where the bytes are the cost).

A decode step over quantized pools is the bytes of its codes: a quarter (8 bits) or an eighth
(4 bits) of a float pool's. The array libraries cannot read them so: a product takes floats, so
the core casts each chunk of codes to a float copy first, and that cast and the product over it
cost more than reading a float pool (docs/attention.md has the figures). This kernel computes
what :meth:`~cacheidx.attention.softmax.Online.add` computes over one run whose every column
every query of the block sees, its scales folded into the scores and weights: per kv head and
query row, the running maximum ``m``, the sum ``l`` of ``exp(z - m)`` and the weighted values
``acc``, which :meth:`~cacheidx.attention.softmax.Online.merge` folds into the lane's state.

Its exponential is a polynomial (:data:`SOURCE`'s ``fexp``: a few ulps of ``expf``, well inside
attention's tolerance, and exactly zero below ``-87``), so the compiler vectorises the loops;
NaN is never computed through it: the kernel refuses a run whose scales or queries are not all
finite (a row that held a NaN or an infinity), or one of whose scores is NaN or ``+inf``,
which the core then weighs carefully, as its laws say. A score of ``-inf`` (a product that
overflowed) weighs nothing, as :class:`~cacheidx.attention.softmax.Online` weighs it: a query
whose scores so far are all ``-inf`` weighs no column (``m = -inf``, ``l = 0``, ``acc = 0``),
never ``exp(-inf - -inf)``.

The kernel is a path of the law for values only, not gradients: it has no backward, so
:func:`states` declines (the core's products, which autograd follows, read the run) wherever
a gradient is asked: torch's grad mode on and the queries or a pool's scales requiring grad.

The kernel is built once per machine with the C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/cacheidx`` (``~/.cache/cacheidx``) and loaded with :mod:`ctypes`; NumPy
arrays and PyTorch CPU tensors hand it their memory by address and strides. Where no compiler
builds it, or ``CACHEIDX_NATIVE=0``, :func:`kernel` is ``None`` (said once, as a warning) and
the core's products read the runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SOURCE", "kernel", "off", "states"]

#: the most query rows (grouped heads x queries of a block, x lanes where they share a
#: prefix) the kernel keeps scores for
ROWS = 16
#: columns the kernel weighs at a time
BLOCK = 64

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { ROWS = @ROWS@, BLOCK = @BLOCK@ };

/* e^x for x <= 0: 2^n 2^f, n = round(x log2 e), |f| <= 1/2, 2^f by its Taylor series to degree
   7 (error below 4e-9); x below -87 (e^-87 is 1.6e-38, a weight of nothing) is exactly 0, so
   that a score of -inf weighs nothing, as the online softmax's exp(-inf) does */
static inline float fexp(float x) {
    float x0 = x;
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = rintf(t);
    float f = (t - n) * 0.69314718055994531f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666666666666667e-1f + f * (
        4.1666666666666667e-2f + f * (8.3333333333333333e-3f + f * (
        1.3888888888888889e-3f + f * 1.9841269841269841e-4f))))));
    union { int32_t i; float f; } u;
    u.i = ((int32_t)n + 127) << 23;
    return x0 < -87.0f ? 0.0f : p * u.f;
}

static inline int is_finite(float x) {
    union { float f; uint32_t i; } u = { x };
    return (u.i & 0x7f800000u) != 0x7f800000u;
}

/* codes of one row as floats c_i: 8 bits, or 4 bits packed (byte i: code i low, i + d/2 high) */
static inline void row(const uint8_t *restrict c, int d, int bits, float *restrict out) {
    if (bits == 8) {
        const int8_t *s = (const int8_t *)c;
        for (int i = 0; i < d; i++) out[i] = (float)s[i];
    } else {
        int h = d / 2;
        for (int i = 0; i < h; i++) out[i] = (float)(int)(c[i] & 15) - 8.0f;
        for (int i = 0; i < h; i++) out[i + h] = (float)(int)(c[i] >> 4) - 8.0f;
    }
}

/* One run of T columns of one lane, every kv head h < kv and query row r < m:
   q[(h m + r) d + i] the scaled queries; key codes of column t, head h at kc + t kst + h khs
   (bytes), their scale at ks[t kss + h khs2]; values alike. Out: mo, lo [kv m] and
   acc [kv m dv]: the online softmax's state over the run. Returns 1 (its outputs to be
   discarded) where a scale or a query is not finite, a score is NaN or +inf (a product that
   overflowed: the core weighs it as its laws say), or m > ROWS.
   A row whose scores so far are all -inf (products that overflowed) weighs no column: its
   state stays m = -inf, l = 0, acc = 0, and a block is weighed against a maximum of 0 while
   the row's maximum is -inf (the online softmax's rule: never exp(-inf - -inf)). */
static inline __attribute__((always_inline)) int run(
        int T, int kv, int m, int d, int dv, int kbits, int vbits, const float *q,
        const uint8_t *kc, long kst, long khs, const float *ks, long kss, long khs2,
        const uint8_t *vc, long vst, long vhs, const float *vs, long vss, long vhs2,
        float *mo, float *lo, float *acc) {
    if (m > ROWS || T <= 0) return 1;
    for (int i = 0; i < kv * m * d; i++) if (!is_finite(q[i])) return 1;
    for (int h = 0; h < kv; h++)
        for (int t = 0; t < T; t++)
            if (!is_finite(ks[t * kss + h * khs2]) || !is_finite(vs[t * vss + h * vhs2]))
                return 1;
    float z[ROWS][BLOCK], krow[1024], vrow[1024];
    if (d > 1024 || dv > 1024) return 1;
    for (int h = 0; h < kv; h++) {
        const float *qh = q + (long)h * m * d;
        float *M = mo + h * m, *L = lo + h * m, *A = acc + (long)h * m * dv;
        memset(A, 0, sizeof(float) * m * dv);
        for (int t0 = 0; t0 < T; t0 += BLOCK) {
            int nb = T - t0 < BLOCK ? T - t0 : BLOCK;
            for (int j = 0; j < nb; j++) {
                long t = t0 + j;
                row(kc + t * kst + h * khs, d, kbits, krow);
                float s = ks[t * kss + h * khs2];
                for (int r = 0; r < m; r++) {
                    const float *qr = qh + r * d;
                    float dot = 0.0f;
                    for (int i = 0; i < d; i++) dot += qr[i] * krow[i];
                    z[r][j] = dot * s;
                }
            }
            int bad = 0;
            for (int r = 0; r < m; r++)
                for (int j = 0; j < nb; j++) bad |= !(z[r][j] < INFINITY);
            if (bad) return 1;
            for (int r = 0; r < m; r++) {
                float top = z[r][0];
                for (int j = 0; j < nb; j++) top = fmaxf(top, z[r][j]);
                if (t0 > 0 && M[r] > top) top = M[r];
                float base = top == -INFINITY ? 0.0f : top;
                float fade = t0 > 0 ? fexp(M[r] - base) : 0.0f;
                float sum = 0.0f;
                for (int j = 0; j < nb; j++) { z[r][j] = fexp(z[r][j] - base); sum += z[r][j]; }
                L[r] = t0 > 0 ? L[r] * fade + sum : sum;
                if (t0 > 0) for (int e = 0; e < dv; e++) A[r * dv + e] *= fade;
                M[r] = top;
            }
            for (int j = 0; j < nb; j++) {
                long t = t0 + j;
                row(vc + t * vst + h * vhs, dv, vbits, vrow);
                float s = vs[t * vss + h * vhs2];
                for (int r = 0; r < m; r++) {
                    float w = z[r][j] * s;
                    float *a = A + r * dv;
                    for (int e = 0; e < dv; e++) a[e] += w * vrow[e];
                }
            }
        }
    }
    return 0;
}

/* the call, its widths and head dims made constants where they are the common ones, so that
   the compiler unrolls and vectorises each row's loops whole */
#define RUN(D, KB, VB) run(T, kv, m, D, D, KB, VB, q, kc, kst, khs, ks, kss, khs2, vc, vst, vhs, \
                           vs, vss, vhs2, mo, lo, acc)
int cacheidx_run(int T, int kv, int m, int d, int dv, int kbits, int vbits, const float *q,
                 const uint8_t *kc, long kst, long khs, const float *ks, long kss, long khs2,
                 const uint8_t *vc, long vst, long vhs, const float *vs, long vss, long vhs2,
                 float *mo, float *lo, float *acc) {
    if (d == dv && kbits == vbits) {
        if (d == 64) return kbits == 8 ? RUN(64, 8, 8) : RUN(64, 4, 4);
        if (d == 128) return kbits == 8 ? RUN(128, 8, 8) : RUN(128, 4, 4);
    }
    return run(T, kv, m, d, dv, kbits, vbits, q, kc, kst, khs, ks, kss, khs2, vc, vst, vhs, vs,
               vss, vhs2, mo, lo, acc);
}
""".replace("@ROWS@", str(ROWS)).replace("@BLOCK@", str(BLOCK))

#: the compiler's flags: vectorised sums (reassociated), NaN and infinities still IEEE's. Never
#: -ffast-math (nor -funsafe-math-optimizations): linked into a shared library it sets the
#: processor to flush subnormals to zero in the whole process, for every library, on load
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-shared", "-fPIC", "-lm"]

_LOCK = threading.Lock()
_FOUND: list[Any] = []


def kernel() -> Any:
    """The built kernel (a :mod:`ctypes` function), or ``None`` where it cannot be built or
    ``CACHEIDX_NATIVE=0``; built at the first call, then kept."""
    if _FOUND:
        return _FOUND[0]
    with _LOCK:
        if not _FOUND:
            _FOUND.append(_load())
    return _FOUND[0]


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Within it :func:`kernel` is ``None`` (in every thread): the libraries' products
    read quantized runs (what the figures compare the kernel with)."""
    with _LOCK:
        kept = list(_FOUND)
        _FOUND[:] = [None]
    try:
        yield
    finally:
        with _LOCK:
            _FOUND[:] = kept


def _load() -> Any:
    """Build (where no good file is kept) and load the kernel; ``None``, said once as a
    warning, where it cannot be built or loaded.

    The file is checked before it is loaded: a loader mapping a truncated or garbage library
    dies of SIGBUS, or refuses it, in every later process. Beside ``runs-<key>.so`` lies
    ``runs-<key>.so.sha256``, the SHA-256 of its bytes; a file whose bytes do not match it (or
    with none beside it) is rebuilt, once, in its place. A build goes to a temporary file
    renamed over the old one (atomic: a reader sees the old file or the new, whole), the
    checksum beside it first, under an exclusive ``fcntl.flock`` on ``runs-<key>.lock``, so
    that processes building at once build once and never read a half-written file."""
    if os.environ.get("CACHEIDX_NATIVE", "1") == "0":
        return None
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    # -march=native: a build is this CPU's own (a home folder shared by machines keeps one each)
    digest = hashlib.sha256((SOURCE + " ".join([cc, *FLAGS]) + sys.platform + _cpu()).encode())
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cacheidx"
    lib = home / f"runs-{digest.hexdigest()[:16]}.so"
    try:
        home.mkdir(parents=True, exist_ok=True)
        with _locked(lib.with_suffix(".lock")):
            fn = None
            if _intact(lib):
                with contextlib.suppress(OSError):
                    fn = ctypes.CDLL(str(lib)).cacheidx_run
            if fn is None:  # missing, truncated, garbage, or not loadable: rebuilt once
                _build(cc, lib)
                fn = ctypes.CDLL(str(lib)).cacheidx_run
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(f"cacheidx: the CPU kernel for quantized runs could not be built ({e}"
                      f"{': ' + detail.decode(errors='replace')[:300] if detail else ''}); "
                      "quantized pools are read through the libraries' products instead",
                      RuntimeWarning, stacklevel=3)
        return None
    p, i, ln = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    fn.argtypes = [i, i, i, i, i, i, i, p, p, ln, ln, p, ln, ln, p, ln, ln, p, ln, ln, p, p, p]
    fn.restype = i
    return fn


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created) while within; none where the platform has
    no ``fcntl`` (the atomic rename still keeps a reader from a half-written file)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _checksum(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _intact(lib: Path) -> bool:
    """Whether ``lib``'s bytes are those its checksum beside it records."""
    try:
        want = _checksum(lib).read_text().strip()
        return hashlib.sha256(lib.read_bytes()).hexdigest() == want
    except OSError:
        return False


def _build(cc: str, lib: Path) -> None:
    """Compile :data:`SOURCE` into ``lib`` and record its checksum (the caller holds the
    lock)."""
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / "runs.c", Path(tmp) / "runs.so"
        src.write_text(SOURCE)
        subprocess.run([cc, *FLAGS, str(src), "-o", str(out)], check=True,
                       capture_output=True, timeout=120)
        sum_tmp = Path(tmp) / "runs.so.sha256"
        sum_tmp.write_text(hashlib.sha256(out.read_bytes()).hexdigest() + "\n")
        # the library first, then its checksum: a process that dies between the two leaves a
        # file without a matching checksum, which the next one rebuilds
        os.replace(out, lib)
        os.replace(sum_tmp, _checksum(lib))


def _cpu() -> str:
    """What names this machine's CPU: its model and feature flags where Linux says them."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    import platform

    return platform.machine() + platform.processor() + "".join(lines)


def _memory(x: Any) -> tuple[int, tuple[int, ...]] | None:
    """``x``'s address and strides in elements, where it is a NumPy array or a CPU tensor."""
    if isinstance(x, np.ndarray):
        return x.ctypes.data, tuple(s // x.itemsize for s in x.strides)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return x.data_ptr(), tuple(x.stride())
    return None


def states(q: Any, keys: Any, values: Any) -> tuple[Any, Any, Any] | None:
    """``(m, l, acc)`` of one run, or ``None`` where the kernel does not apply: no kernel, not
    NumPy or a CPU tensor, not float32 queries and scales, a row's elements not adjacent, too
    many query rows, a scale, a query or a score not finite but ``-inf``, or a gradient asked
    (torch's grad mode on and ``q`` or a pool's scales requiring grad: the kernel has no
    backward). A query row whose scores are all ``-inf`` has ``m = -inf``, ``l = 0`` and
    ``acc = 0``.

    ``q`` ``[kv, rows, d]`` (scaled); ``keys`` and ``values`` quantized views
    ``(codes [T, kv, w], scales [T, kv])``. ``m`` and ``l`` are ``[kv, rows]``, ``acc``
    ``[kv, rows, dv]``, float32 of ``q``'s library."""
    fn = kernel()
    if fn is None:
        return None
    kv, rows, d = (int(n) for n in q.shape)
    if rows > ROWS:
        return None
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(q, torch.Tensor)
    (kc, ks), (vc, vs) = keys, values
    if is_torch and torch.is_grad_enabled() and any(
            getattr(x, "requires_grad", False) for x in (q, kc, ks, vc, vs)):
        return None  # no backward of its own: autograd follows the core's products instead
    if is_torch:
        q = q.contiguous()
        if q.dtype != torch.float32:
            return None
    else:
        q = np.ascontiguousarray(q)
        if q.dtype != np.float32:
            return None
    parts = [_memory(a) for a in (kc, ks, vc, vs)]
    if any(p is None for p in parts) or str(ks.dtype)[-7:] != "float32" or str(
            vs.dtype)[-7:] != "float32":
        return None
    (ka, kst), (sa, sst), (va, vst), (ta, tst) = parts
    if kst[2] != 1 or vst[2] != 1:
        return None
    t = int(kc.shape[0])
    kbits = 4 if str(kc.dtype).endswith("uint8") else 8
    vbits = 4 if str(vc.dtype).endswith("uint8") else 8
    dv = int(vc.shape[2]) * (2 if vbits == 4 else 1)
    if is_torch:
        m, l, acc = (torch.empty((kv, rows), dtype=torch.float32),
                     torch.empty((kv, rows), dtype=torch.float32),
                     torch.empty((kv, rows, dv), dtype=torch.float32))
        out = [x.data_ptr() for x in (m, l, acc)]
    else:
        m, l, acc = (np.empty((kv, rows), np.float32), np.empty((kv, rows), np.float32),
                     np.empty((kv, rows, dv), np.float32))
        out = [x.ctypes.data for x in (m, l, acc)]
    qa = _memory(q)[0]
    bad = fn(t, kv, rows, d, dv, kbits, vbits, qa, ka, kst[0], kst[1], sa, sst[0], sst[1],
             va, vst[0], vst[1], ta, tst[0], tst[1], *out)
    return None if bad else (m, l, acc)
