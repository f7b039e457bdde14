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

Its second entry, ``cacheidx_paged`` (:func:`paged`, called by :mod:`.paged`), computes the same
state for a whole decode step over paged pools: every lane and kv head in one call, split over
the threads it is given, each lane's seen columns read through its row of the table (pages in
any order, their rows fetched ahead), for float32, float16, bfloat16, int8 and int4 pools. Its
sums, and the quantized runs', are partial sums in one order, the same on every machine.

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
from typing import Any, NamedTuple

import numpy as np

__all__ = ["SOURCE", "kernel", "off", "paged", "states", "threads"]

#: the most query rows (grouped heads x queries of a block, x lanes where they share a
#: prefix) the kernel keeps scores for
ROWS = 16
#: columns the kernel weighs at a time
BLOCK = 64

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { ROWS = @ROWS@, BLOCK = @BLOCK@, LANES = 16, WIDEST = 1024, AHEAD = 64 };

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

/* Sums in one order on every machine: LANES partial sums, element i into sum i % LANES, then
   halved pairwise. Each partial sum is a chain of its own, so the compiler vectorises the
   loop as written, without reassociating it (no -fassociative-math, no -ffast-math). */
static inline float halved(float *s) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) s[j] += s[j + w];
    return s[0];
}

static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float s[LANES] = {0};
    int i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) s[j] += a[i + j] * b[i + j];
    for (int j = 0; i + j < d; j++) s[j] += a[i + j] * b[i + j];
    return halved(s);
}

static inline float sum(const float *a, int n) {
    float s[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) s[j] += a[i + j];
    for (int j = 0; i + j < n; j++) s[j] += a[i + j];
    return halved(s);
}

/* the largest of a[0:n] (no NaN among them: the callers refuse those first) */
static inline float largest(const float *a, int n) {
    float s[LANES];
    for (int j = 0; j < LANES; j++) s[j] = -INFINITY;
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) s[j] = a[i + j] > s[j] ? a[i + j] : s[j];
    for (int j = 0; i + j < n; j++) s[j] = a[i + j] > s[j] ? a[i + j] : s[j];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) s[j] = s[j + w] > s[j] ? s[j + w] : s[j];
    return s[0];
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
    float z[ROWS][BLOCK], krow[WIDEST], vrow[WIDEST];
    if (d > WIDEST || dv > WIDEST) return 1;
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
                for (int r = 0; r < m; r++) z[r][j] = dot(qh + r * d, krow, d) * s;
            }
            int bad = 0;
            for (int r = 0; r < m; r++)
                for (int j = 0; j < nb; j++) bad |= !(z[r][j] < INFINITY);
            if (bad) return 1;
            for (int r = 0; r < m; r++) {
                float top = largest(z[r], nb);
                if (t0 > 0 && M[r] > top) top = M[r];
                float base = top == -INFINITY ? 0.0f : top;
                float fade = t0 > 0 ? fexp(M[r] - base) : 0.0f;
                for (int j = 0; j < nb; j++) z[r][j] = fexp(z[r][j] - base);
                float total = sum(z[r], nb);
                L[r] = t0 > 0 ? L[r] * fade + total : total;
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

/* ---- paged decode: every lane's seen columns through its row of the table, in one call ---- */

/* the kinds of element a pool (or its scales) holds */
enum { F32 = 0, F16 = 1, BF16 = 2, I8 = 3, I4 = 4 };

static inline float from_bf16(uint16_t h) {
    union { uint32_t i; float f; } u = { (uint32_t)h << 16 };
    return u.f;
}

static inline float from_f16(uint16_t h) {
#if defined(__FLT16_MAX__)
    union { uint16_t i; _Float16 f; } u = { h };
    return (float)u.f;
#else
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t i; float f; } u;
    if (e == 0) { u.f = (float)m * 5.9604644775390625e-8f; u.i |= s; }
    else if (e == 31) u.i = s | 0x7f800000u | (m << 13);
    else u.i = s | ((e + 112u) << 23) | (m << 13);
    return u.f;
#endif
}

/* one row of d elements of kind k at base + off (off in elements; in bytes for codes), as
   floats: the row itself where it is float32, else cast into buf */
static inline __attribute__((always_inline)) const float *load(
        const void *base, long off, int k, int d, float *restrict buf) {
    if (k == F32) return (const float *)base + off;
    if (k == F16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < d; i++) buf[i] = from_f16(p[i]);
    } else if (k == BF16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < d; i++) buf[i] = from_bf16(p[i]);
    } else {
        row((const uint8_t *)base + off, d, k == I8 ? 8 : 4, buf);
    }
    return buf;
}

/* bytes an element of kind k takes (codes: a byte, two 4-bit codes) */
static inline long width(int k) { return k == F32 ? 4 : k <= BF16 ? 2 : 1; }

/* asks the processor for the d elements of kind k at p, one cache line at a time */
static inline void ahead(const char *p, int d, int k) {
    long bytes = k == I4 ? d / 2 : d * width(k);
    for (long x = 0; x < bytes; x += 64) __builtin_prefetch(p + x);
}

static inline float scale_at(const void *base, long off, int k) {
    if (k == F32) return ((const float *)base)[off];
    uint16_t h = ((const uint16_t *)base)[off];
    return k == F16 ? from_f16(h) : from_bf16(h);
}

/* The arguments of one paged call, by name (cacheidx.attention.native.Paged mirrors them). */
typedef struct {
    int lanes, kv, g, d, dv;    /* g: query rows a kv head (grouped heads of one token) */
    int kkind, vkind;           /* F32, F16, BF16, I8 or I4 */
    int kskind, vskind;         /* the scales' kind (F32, F16, BF16), for I8 and I4 pools */
    int threads;
    const float *q;             /* [lanes, kv, g, d], scaled */
    const int64_t *table;       /* lane b's slot of column c: table[b * table_stride + c] */
    long table_stride;
    const int64_t *start, *stop; /* [lanes]: lane b sees columns start[b] to stop[b] - 1 */
    const void *k; long kst, khs; /* element (codes: byte) strides of a slot and a head */
    const void *ks; long kss, kshs;
    const void *v; long vst, vhs;
    const void *vs; long vss, vshs;
    float *m, *l, *acc;         /* [lanes, kv, g] twice, [lanes, kv, g, dv] */
} cacheidx_paged_args;

/* Lane b at kv head h: the online softmax's state (m, l, acc) of its g query rows over its
   seen columns, read through its row of the table (pages in any order, one slot a column).
   Returns 1 (the call's outputs to be discarded) where a query is not finite, a score is NaN
   or +inf, or the state is not finite at the end (a value or scale not finite: the core then
   weighs the call as its laws say). A score of -inf weighs nothing; a row whose scores are
   all -inf keeps m = -inf, l = 0, acc = 0. */
static inline __attribute__((always_inline)) int lane(
        const cacheidx_paged_args *a, int b, int h, int d, int dv, int kk, int vk) {
    const int g = a->g;
    const long at = (long)b * a->kv + h;
    const float *q = a->q + at * g * d;
    float *M = a->m + at * g, *L = a->l + at * g, *A = a->acc + at * g * dv;
    const int64_t *slots = a->table + (long)b * a->table_stride;
    const long c0 = a->start[b], c1 = a->stop[b];
    for (int i = 0; i < g * d; i++) if (!is_finite(q[i])) return 1;
    for (int r = 0; r < g; r++) { M[r] = -INFINITY; L[r] = 0.0f; }
    memset(A, 0, sizeof(float) * g * dv);
    float z[ROWS][BLOCK], kbuf[WIDEST], vbuf[WIDEST];
    for (long t0 = c0; t0 < c1; t0 += BLOCK) {
        int nb = c1 - t0 < BLOCK ? (int)(c1 - t0) : BLOCK;
        for (int j = 0; j < nb; j++) {
            long s = slots[t0 + j];
            /* the rows AHEAD columns on fetched now: a lane's pages lie anywhere, and the
               processor's prefetcher stops at each page's end */
            if (t0 + j + AHEAD < c1) {
                long f = slots[t0 + j + AHEAD];
                ahead((const char *)a->k + (f * a->kst + h * a->khs) * width(kk), d, kk);
                ahead((const char *)a->v + (f * a->vst + h * a->vhs) * width(vk), dv, vk);
            }
            const float *k = load(a->k, s * a->kst + h * a->khs, kk, d, kbuf);
            if (kk >= I8) {
                float sc = scale_at(a->ks, s * a->kss + h * a->kshs, a->kskind);
                for (int r = 0; r < g; r++) z[r][j] = dot(q + r * d, k, d) * sc;
            } else {
                for (int r = 0; r < g; r++) z[r][j] = dot(q + r * d, k, d);
            }
        }
        int bad = 0;
        for (int r = 0; r < g; r++)
            for (int j = 0; j < nb; j++) bad |= !(z[r][j] < INFINITY);
        if (bad) return 1;
        for (int r = 0; r < g; r++) {
            float top = largest(z[r], nb);
            top = M[r] > top ? M[r] : top;
            float base = top == -INFINITY ? 0.0f : top;
            float fade = fexp(M[r] - base);  /* 0 where M is -inf: L and acc are 0 there */
            for (int j = 0; j < nb; j++) z[r][j] = fexp(z[r][j] - base);
            L[r] = L[r] * fade + sum(z[r], nb);
            if (fade != 1.0f) for (int e = 0; e < dv; e++) A[r * dv + e] *= fade;
            M[r] = top;
        }
        for (int j = 0; j < nb; j++) {
            long s = slots[t0 + j];
            const float *v = load(a->v, s * a->vst + h * a->vhs, vk, dv, vbuf);
            float sc = vk >= I8 ? scale_at(a->vs, s * a->vss + h * a->vshs, a->vskind) : 1.0f;
            for (int r = 0; r < g; r++) {
                float w = z[r][j] * sc;
                float *o = A + r * dv;
                for (int e = 0; e < dv; e++) o[e] += w * v[e];
            }
        }
    }
    int bad = 0;
    for (int i = 0; i < g * dv; i++) bad |= !is_finite(A[i]);
    for (int r = 0; r < g; r++) bad |= !is_finite(L[r]);
    return bad;
}

/* one lane and kv head, its head dims and kinds made constants where they are the common
   ones (the loops then unroll and vectorise whole) */
#define LANE(D, K) lane(a, b, h, D, D, K, K)
static int one(const cacheidx_paged_args *a, int b, int h) {
    int d = a->d, kk = a->kkind;
    if (d == a->dv && kk == a->vkind) {
        if (d == 64) switch (kk) {
            case F32: return LANE(64, F32); case F16: return LANE(64, F16);
            case BF16: return LANE(64, BF16); case I8: return LANE(64, I8);
            default: return LANE(64, I4);
        }
        if (d == 128) switch (kk) {
            case F32: return LANE(128, F32); case F16: return LANE(128, F16);
            case BF16: return LANE(128, BF16); case I8: return LANE(128, I8);
            default: return LANE(128, I4);
        }
    }
    return lane(a, b, h, a->d, a->dv, a->kkind, a->vkind);
}

typedef struct { const cacheidx_paged_args *a; int next, bad; } work;

/* takes lanes x kv heads one at a time until none is left (or one was refused) */
static void *worker(void *p) {
    work *w = (work *)p;
    const int n = w->a->lanes * w->a->kv;
    for (;;) {
        int i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (i >= n || __atomic_load_n(&w->bad, __ATOMIC_RELAXED)) break;
        if (one(w->a, i / w->a->kv, i % w->a->kv)) __atomic_store_n(&w->bad, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

enum { MOST_THREADS = 64 };

/* The paged call: 0, or 1 where it was refused (bad arguments, or a lane's, see lane()). */
int cacheidx_paged(const cacheidx_paged_args *a) {
    if (a->g < 1 || a->g > ROWS || a->d < 1 || a->dv < 1 || a->d > WIDEST || a->dv > WIDEST
        || a->kkind < F32 || a->kkind > I4 || a->vkind < F32 || a->vkind > I4
        || (a->kkind == I4 && a->d % 2) || (a->vkind == I4 && a->dv % 2)) return 1;
    work w = { a, 0, 0 };
    int n = a->lanes * a->kv, threads = a->threads < n ? a->threads : n;
    if (threads > MOST_THREADS) threads = MOST_THREADS;
    pthread_t t[MOST_THREADS];
    int made = 0;
    for (; made < threads - 1; made++)
        if (pthread_create(&t[made], NULL, worker, &w)) break;  /* fewer threads, same work */
    worker(&w);
    for (int i = 0; i < made; i++) pthread_join(t[i], NULL);
    return w.bad;
}
""".replace("@ROWS@", str(ROWS)).replace("@BLOCK@", str(BLOCK))

#: the compiler's flags. Sums are written as partial sums in one order (:data:`SOURCE`'s
#: ``dot``, ``sum``), vectorised as written: no reassociation and no fused multiply-adds
#: (``-ffp-contract=off``), so that a sum is the same on every machine, whatever its vector
#: width. Never -ffast-math (nor -funsafe-math-optimizations): linked into a shared library it
#: sets the processor to flush subnormals to zero in the whole process, for every library, on
#: load
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
         "-shared", "-fPIC", "-lm", "-lpthread"]


class Paged(ctypes.Structure):
    """The arguments of one paged call, by name: :data:`SOURCE`'s ``cacheidx_paged_args``
    field for field (``ctypes`` lays it out as the C compiler does)."""

    _p, _i, _l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    _fields_ = [("lanes", _i), ("kv", _i), ("g", _i), ("d", _i), ("dv", _i),
                ("kkind", _i), ("vkind", _i), ("kskind", _i), ("vskind", _i), ("threads", _i),
                ("q", _p), ("table", _p), ("table_stride", _l), ("start", _p), ("stop", _p),
                ("k", _p), ("kst", _l), ("khs", _l), ("ks", _p), ("kss", _l), ("kshs", _l),
                ("v", _p), ("vst", _l), ("vhs", _l), ("vs", _p), ("vss", _l), ("vshs", _l),
                ("m", _p), ("l", _p), ("acc", _p)]


#: the kinds of element the paged kernel reads (:data:`SOURCE`'s enum), by dtype name
KINDS = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "uint8": 4}


class _Library(NamedTuple):
    run: Any  #: ``cacheidx_run``: one run of quantized slots
    paged: Any  #: ``cacheidx_paged``: every lane's seen columns through the table


_LOCK = threading.Lock()
_FOUND: list[Any] = []


def kernel() -> Any:
    """The built kernel of quantized runs (a :mod:`ctypes` function), or ``None`` where it
    cannot be built or ``CACHEIDX_NATIVE=0``; built at the first call, then kept."""
    lib = _library()
    return None if lib is None else lib.run


def _library() -> _Library | None:
    """The built library's functions, or ``None`` (:func:`kernel`)."""
    if _FOUND:
        return _FOUND[0]
    with _LOCK:
        if not _FOUND:
            _FOUND.append(_load())
    return _FOUND[0]


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Within it :func:`kernel` is ``None`` (in every thread): the libraries' products
    read quantized runs and paged pools (what the figures compare the kernel with)."""
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
            found = None
            if _intact(lib):
                with contextlib.suppress(OSError, AttributeError):
                    found = _functions(ctypes.CDLL(str(lib)))
            if found is None:  # missing, truncated, garbage, or not loadable: rebuilt once
                _build(cc, lib)
                found = _functions(ctypes.CDLL(str(lib)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(f"cacheidx: the CPU kernel could not be built ({e}"
                      f"{': ' + detail.decode(errors='replace')[:300] if detail else ''}); "
                      "quantized and paged pools are read through the libraries' products "
                      "instead",
                      RuntimeWarning, stacklevel=3)
        return None
    return found


def _functions(lib: ctypes.CDLL) -> _Library:
    """The library's two functions, their signatures declared (``AttributeError`` where one
    is missing)."""
    p, i, ln = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    fn, paged_fn = lib.cacheidx_run, lib.cacheidx_paged
    fn.argtypes = [i, i, i, i, i, i, i, p, p, ln, ln, p, ln, ln, p, ln, ln, p, ln, ln, p, p, p]
    fn.restype = i
    paged_fn.argtypes = [ctypes.POINTER(Paged)]
    paged_fn.restype = i
    return _Library(fn, paged_fn)


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


def threads(q: Any) -> int:
    """The threads a paged call over ``q``'s library is given: torch's intra-op threads
    (``torch.get_num_threads()``) for a tensor; for a NumPy array ``CACHEIDX_THREADS``, else
    ``OMP_NUM_THREADS``, else the cores this process may run on."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(q, torch.Tensor):
        return max(1, int(torch.get_num_threads()))
    for name in ("CACHEIDX_THREADS", "OMP_NUM_THREADS"):
        with contextlib.suppress(ValueError):
            return max(1, int(os.environ.get(name, "")))
    with contextlib.suppress(AttributeError):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


#: the fewest elements (columns x kv heads x head dim, over the call) for which a second thread
#: pays for starting it
THREADED = 1 << 16


def _pool(pool: Any) -> tuple[int, int, int, int, int, int, int, int] | None:
    """A pool's ``(kind, address, slot stride, head stride, scales' kind, address, slot
    stride, head stride)`` for the paged kernel (strides in elements; a float pool's scales
    zero), or ``None`` where it cannot read it."""
    codes, scales = (pool.codes, pool.scales) if hasattr(pool, "codes") else (pool, None)
    got = _memory(codes)
    kind = KINDS.get(str(codes.dtype).rsplit(".", 1)[-1])
    if got is None or kind is None or got[1][2] != 1 and int(codes.shape[2]) > 1:
        return None
    if (scales is None) != (kind < KINDS["int8"]):
        return None  # codes without scales, or floats with them
    address, (sst, hst, _) = got
    if scales is None:
        return kind, address, sst, hst, 0, 0, 0, 0
    found = _memory(scales)
    skind = KINDS.get(str(scales.dtype).rsplit(".", 1)[-1])
    if found is None or skind is None or skind >= KINDS["int8"]:
        return None
    return kind, address, sst, hst, skind, found[0], *found[1][:2]


def paged(q: Any, table: np.ndarray, start: np.ndarray, stop: np.ndarray, kpool: Any,
          vpool: Any) -> tuple[Any, Any, Any] | None:
    """``(m, l, acc)`` of every lane and kv head over its seen columns, read through its row
    of the table by one call of the kernel (lanes x kv heads over :func:`threads`), or ``None``
    where it does not apply: no kernel, pools it cannot read (float32, float16, bfloat16, or
    quantized codes with scales of those; NumPy or CPU tensors, a row's elements adjacent),
    more than :data:`ROWS` query rows a kv head, a head dim past 1,024, a query not finite, a
    score NaN or ``+inf``, or a state not finite (a value that is not: the core's laws weigh
    it). A row that weighs no column (its lane sees none, or its scores are all ``-inf``) has
    ``m = -inf``, ``l = 0``, ``acc = 0``.

    ``q`` ``[lanes, kv, g, d]`` float32 (scaled); lane ``b`` sees columns ``start[b]`` to
    ``stop[b] - 1``, column ``c`` at slot ``table[b, c]`` (int64, inside both pools: the caller
    checked); pools ``[slots, kv, d]`` as :mod:`cacheidx.quantized` or plain. ``m`` and ``l``
    ``[lanes, kv, g]``, ``acc`` ``[lanes, kv, g, dv]``, float32 of ``q``'s library."""
    lib = _library()
    if lib is None:
        return None
    lanes, kv, g, d = (int(n) for n in q.shape)
    if g > ROWS:
        return None
    kp, vp = _pool(kpool), _pool(vpool)
    if kp is None or vp is None:
        return None
    if str(q.dtype).rsplit(".", 1)[-1] != "float32":
        return None
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(q, torch.Tensor)
    if is_torch:
        q = q.contiguous()
        m, l, acc = (torch.empty((lanes, kv, g), dtype=torch.float32),
                     torch.empty((lanes, kv, g), dtype=torch.float32),
                     torch.empty((lanes, kv, g, int(vpool.shape[2])), dtype=torch.float32))
    else:
        q = np.ascontiguousarray(q)
        m, l, acc = (np.empty((lanes, kv, g), np.float32), np.empty((lanes, kv, g), np.float32),
                     np.empty((lanes, kv, g, int(vpool.shape[2])), np.float32))
    table = np.ascontiguousarray(table, dtype=np.int64)
    start = np.ascontiguousarray(start, dtype=np.int64)
    stop = np.ascontiguousarray(stop, dtype=np.int64)
    work = int((stop - start).sum()) * kv * d
    args = Paged(lanes, kv, g, d, int(vpool.shape[2]), kp[0], vp[0], kp[4], vp[4],
                 threads(q) if work >= THREADED else 1, _memory(q)[0],
                 table.ctypes.data, int(table.shape[1]), start.ctypes.data, stop.ctypes.data,
                 *kp[1:4], *kp[5:], *vp[1:4], *vp[5:], *(_memory(x)[0] for x in (m, l, acc)))
    return None if lib.paged(ctypes.byref(args)) else (m, l, acc)
