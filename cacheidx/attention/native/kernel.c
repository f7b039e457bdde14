/* cacheidx's CPU kernel: attention's online softmax over paged pools (float or quantized),
   read where they lie (codes cast to floats in registers). Built at install time as the
   extension module cacheidx.attention.native._kernel (setup.py);
   cacheidx/attention/native/__init__.py says what it computes and when the core computes
   instead.

   The same bits on every machine: every sum is written as partial sums in one order, and
   compiled without reassociation or contraction (-ffp-contract=off, never -ffast-math), so a
   vector of any width computes them as written. On x86-64 with GCC and glibc the entries are
   cloned for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and the baseline (target_clones: the
   dynamic loader picks one for the processor, as -march=native would without tying the build
   to it); every clone runs the same operations in the same order, so each gives the same
   bits. A compiler that keeps floats in wider registers (FLT_EVAL_METHOD 1 or 2: x87) would
   round differently, so it is refused. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if FLT_EVAL_METHOD == 1 || FLT_EVAL_METHOD == 2
#error "float arithmetic in wider registers: the kernel's sums would not be float32's"
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__) \
    && __GNUC__ >= 8 && !defined(CACHEIDX_ONE_TARGET)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* every helper inlined into its caller, and so compiled for the caller's clone */
#define INLINE static inline __attribute__((always_inline))

/* BLOCK: the columns a pass over keys takes before the pass over their values; 256 rather
   than 64 took one layer's float32 reads over shuffled pages at 8 x 16k from 41 to 30 ns a
   column and kv head (23 against 30.5 with pages in order), the passes' bookkeeping and their
   turns from one pool to the other a quarter as often */
enum { ROWS = 16, BLOCK = 256, LANES = 16, WIDEST = 1024, AHEAD = 64 };

INLINE float fexp(float x) {
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

INLINE int is_finite(float x) {
    union { float f; uint32_t i; } u = { x };
    return (u.i & 0x7f800000u) != 0x7f800000u;
}

/* Sums in one order on every machine: LANES partial sums, element i into sum i % LANES, then
   halved pairwise. Each partial sum is a chain of its own, so the compiler vectorises the
   loop as written, without reassociating it (no -fassociative-math, no -ffast-math). */
INLINE float halved(float *s) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) s[j] += s[j + w];
    return s[0];
}

INLINE float sum(const float *a, int n) {
    float s[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) s[j] += a[i + j];
    for (int j = 0; i + j < n; j++) s[j] += a[i + j];
    return halved(s);
}

/* the largest of a[0:n] (no NaN among them: the callers refuse those first) */
INLINE float largest(const float *a, int n) {
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

/* LANES floats as one value: GCC's generic vectors, lowered to whatever registers a clone has
   (one AVX-512 register, two AVX2 ones, four SSE ones) with the same operations lane by lane,
   so every clone computes the same bits */
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(float))));
typedef uint8_t vb __attribute__((vector_size(LANES)));

INLINE vf vload(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
INLINE void vstore(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* fexp lane by lane, in vector operations (the compiler does not vectorise fexp's loop):
   rintf(t) as (t + 1.5 2^23) - 1.5 2^23, the same integer for |t| < 2^22 under the default
   rounding, and t is within [-126, 1] here */
INLINE vf vexp(vf x) {
    const vi low = x < -87.0f;
    x = (vf)(((vi)x & ~low) | ((vi)((vf){0} - 87.0f) & low));
    vf t = x * 1.44269504088896341f;
    vf n = (t + 12582912.0f) - 12582912.0f;
    vf f = (t - n) * 0.69314718055994531f;
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666666666666667e-1f + f * (
        4.1666666666666667e-2f + f * (8.3333333333333333e-3f + f * (
        1.3888888888888889e-3f + f * 1.9841269841269841e-4f))))));
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)e) & ~low);
}

/* The dot products of one query row with LANES key rows, as `halved` sums each: p[c] holds
   column c's LANES partial sums (element i in sum i % LANES, left to right); the pairwise
   halving (lanes j and j + 8, then j + 4, j + 2, j + 1) runs for the LANES columns at once,
   two of them a vector at each level (a transpose as it goes), so column c's sum lands in
   lane c: the same additions as `halved` on each column, a fifth of the instructions. */
INLINE vf sums(const vf *p) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1],
                                 (vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23})
             + __builtin_shuffle(p[2 * i], p[2 * i + 1],
                                 (vi){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1],
                                 (vi){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27})
             + __builtin_shuffle(a[2 * i], a[2 * i + 1],
                                 (vi){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1],
                                 (vi){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29})
             + __builtin_shuffle(b[2 * i], b[2 * i + 1],
                                 (vi){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    return __builtin_shuffle(c[0], c[1],
                             (vi){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30})
         + __builtin_shuffle(c[0], c[1],
                             (vi){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

/* codes of one row as floats c_i: 8 bits, or 4 bits packed (byte i: code i low, i + d/2 high) */
INLINE void row(const uint8_t *restrict c, int d, int bits, float *restrict out) {
    if (bits == 8) {
        const int8_t *s = (const int8_t *)c;
        for (int i = 0; i < d; i++) out[i] = (float)s[i];
    } else {
        int h = d / 2;
        for (int i = 0; i < h; i++) out[i] = (float)(int)(c[i] & 15) - 8.0f;
        for (int i = 0; i < h; i++) out[i + h] = (float)(int)(c[i] >> 4) - 8.0f;
    }
}

/* the kinds of element a pool (or its scales) holds: G4 turned 4-bit codes, unsigned, above
   a zero point, a scale and zero point a group of channels (cacheidx/turned.py) */
enum { F32 = 0, F16 = 1, BF16 = 2, I8 = 3, I4 = 4, G4 = 5 };

/* whether a kind's rows take one scale a row (folded into a score, or a value's weight) */
INLINE int scaled(int k) { return k == I8 || k == I4; }

INLINE float from_bf16(uint16_t h) {
    union { uint32_t i; float f; } u = { (uint32_t)h << 16 };
    return u.f;
}

INLINE float from_f16(uint16_t h) {
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

/* One row of d elements of kind k at base + off (off in elements; in bytes for codes) as
   floats, padded with zeros to dp (a multiple of LANES): the row itself where it is float32
   and needs no padding, else cast into buf (a zero adds nothing to a sum). */
INLINE const float *load(
        const void *base, long off, int k, int d, int dp, float *restrict buf) {
    if (k == F32 && d == dp) return (const float *)base + off;
    if (k == F32) {
        memcpy(buf, (const float *)base + off, sizeof(float) * d);
    } else if (k == F16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < d; i++) buf[i] = from_f16(p[i]);
    } else if (k == BF16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < d; i++) buf[i] = from_bf16(p[i]);
    } else {
        row((const uint8_t *)base + off, d, k == I8 ? 8 : 4, buf);
    }
    for (int i = d; i < dp; i++) buf[i] = 0.0f;
    return buf;
}

/* bytes an element of kind k takes (codes: a byte, two 4-bit codes) */
INLINE long width(int k) { return k == F32 ? 4 : k <= BF16 ? 2 : 1; }

INLINE float scale_at(const void *base, long off, int k) {
    if (k == F32) return ((const float *)base)[off];
    uint16_t h = ((const uint16_t *)base)[off];
    return k == F16 ? from_f16(h) : from_bf16(h);
}

/* A turned row (G4) as floats, turned.py's law T3's first half: y_i = (c_i - z) s over each
   group of g channels, the difference an exact integer and one product, as the array path
   computes it (bit for bit); codes packed as I4's. Padded with zeros to dp. */
INLINE const float *turned_row(const uint8_t *restrict c, const void *sc, long soff, int sk,
                               const int8_t *restrict z, int d, int dp, int g,
                               float *restrict buf) {
    const int h = d / 2;
    if (h % LANES == 0 && g % LANES == 0) {  /* whole vectors: LANES codes a byte vector */
        for (int i = 0; i < h; i += LANES) {
            vb x;
            memcpy(&x, c + i, sizeof x);
            vstore(buf + i, __builtin_convertvector(__builtin_convertvector(x & 15, vi), vf));
            vstore(buf + h + i, __builtin_convertvector(__builtin_convertvector(x >> 4, vi), vf));
        }
        for (int i = 0; i < d; i += LANES) {
            const float s = scale_at(sc, soff + i / g, sk), zf = (float)z[soff + i / g];
            vstore(buf + i, (vload(buf + i) - zf) * s);
        }
    } else {
        for (int i = 0; i < h; i++) buf[i] = (float)(int)(c[i] & 15);
        for (int i = 0; i < h; i++) buf[i + h] = (float)(int)(c[i] >> 4);
        for (int j = 0; j < d / g; j++) {
            const float s = scale_at(sc, soff + j, sk), zf = (float)z[soff + j];
            for (int i = j * g; i < (j + 1) * g; i++) buf[i] = (buf[i] - zf) * s;
        }
    }
    for (int i = d; i < dp; i++) buf[i] = 0.0f;
    return buf;
}

/* asks the processor for the d elements of kind k at p, one cache line at a time, into its
   second-level cache (into the first, they would hold the line fill buffers demand reads need) */
INLINE void ahead(const char *p, int d, int k) {
    long bytes = k == I4 || k == G4 ? d / 2 : d * width(k);
    for (long x = 0; x < bytes; x += 64) __builtin_prefetch(p + x, 0, 2);
}

/* asks for the scales of a row of codes at off (in elements), and a turned row's zero points
   where z is not NULL: they lie in arrays of their own, and unasked, each page's first read
   of them waits on memory (8 lanes x 16k of int8: 14 ms a layer unasked, 7.5 ms asked for) */
INLINE void ahead_scales(const void *scales, const int8_t *z, long off, int sk) {
    __builtin_prefetch((const char *)scales + off * width(sk), 0, 2);
    if (z) __builtin_prefetch(z + off, 0, 2);
}

/* Where one kv head's key and value rows lie: the rows of column t at slot s = slots[t] start
   at k + s kst elements (bytes for codes), their scales (I8 and I4 pools: one a row; G4: one
   a group) at ks + s kss, a G4 row's zero points at kz + s kss (int8, laid out as its
   scales); values alike. */
typedef struct {
    const void *k, *ks, *v, *vs;
    long kst, kss, vst, vss;
    int kk, vk, ksk, vsk;          /* the rows' kinds and their scales' */
    const int64_t *slots;
    const int8_t *kz, *vz;         /* G4's zero points (NULL for other kinds) */
} source;

/* The online softmax's state (M, L, A: [g], [g], [g, dv]) of g query rows q [g, d] (scaled)
   over columns c0 to c1 - 1 of one kv head, each key and value row read once for all g rows.
   Scores are weighed in blocks of BLOCK columns, LANES columns at a time: each row's dot
   products as `sums` adds them, times the key's scale, then exp(z - the block's running
   maximum); values summed column by column in order, each weighed by its score times its
   scale. Returns 1 (the outputs to be discarded) where a query is not finite, a score is NaN
   or +inf, or the state is not finite at the end (a value or a scale that is not: the core
   weighs the call as its laws say). A score of -inf weighs nothing; a row whose scores are
   all -inf keeps M = -inf, L = 0, A = 0 (never exp(-inf - -inf)). */
INLINE int attend(const source *src, long c0, long c1, const float *q, int g, int d, int dv,
                  int kk, int vk, int kg, int vg, float *M, float *L, float *A) {
    const int dp = (d + LANES - 1) / LANES * LANES, dvp = (dv + LANES - 1) / LANES * LANES;
    const int nd = dp / LANES, ndv = dvp / LANES;
    for (int i = 0; i < g * d; i++) if (!is_finite(q[i])) return 1;
    float qp[ROWS * WIDEST], acc[ROWS * WIDEST];
    const float *qr = q;
    if (d != dp) {
        for (int r = 0; r < g; r++)
            for (int i = 0; i < dp; i++) qp[r * dp + i] = i < d ? q[r * d + i] : 0.0f;
        qr = qp;
    }
    for (int r = 0; r < g; r++) { M[r] = -INFINITY; L[r] = 0.0f; }
    memset(acc, 0, sizeof(float) * g * dvp);
    float z[ROWS][BLOCK], kbuf[LANES * WIDEST], vbuf[LANES * WIDEST], ksc[LANES], vsc[LANES];
    const float *rows[LANES];
    const int64_t *slots = src->slots;
    for (long t0 = c0; t0 < c1; t0 += BLOCK) {
        int nb = c1 - t0 < BLOCK ? (int)(c1 - t0) : BLOCK;
        for (int j0 = 0; j0 < nb; j0 += LANES) {
            int n = nb - j0 < LANES ? nb - j0 : LANES;
            /* the last few columns' slots padded with the first's: read past the lane's
               last column, its slots could lie past the table's end */
            const int64_t *at = slots + t0 + j0;
            int64_t pad[LANES];
            if (n < LANES) {
                for (int c = 0; c < LANES; c++) pad[c] = at[c < n ? c : 0];
                at = pad;
            }
            for (int c = 0; c < LANES; c++) {
                long t = t0 + j0 + c, s = at[c];
                if (c >= n) { rows[c] = rows[0]; ksc[c] = 1.0f; continue; }
                /* the key rows AHEAD columns on fetched now: a lane's pages lie anywhere,
                   and the processor's prefetcher stops at each page's end. Each pass asks
                   for its own pool's rows (the value pass below for values): asked for
                   together here, both pools' requests came in one burst the processor
                   could not keep in flight (8 x 16k, pages in order: 30.5 ns a column and
                   kv head against 24). Slight changes to this loop's order (the slot read
                   after the test of c, say) have cost 25 to 50% over shuffled pages: time
                   them with the pages shuffled. */
                if (t + AHEAD < c1) {
                    long f = slots[t + AHEAD];
                    ahead((const char *)src->k + f * src->kst * width(kk), d, kk);
                    if (kk >= I8) ahead_scales(src->ks, src->kz, f * src->kss, src->ksk);
                }
                rows[c] = kk == G4
                    ? turned_row((const uint8_t *)src->k + s * src->kst, src->ks, s * src->kss,
                                 src->ksk, src->kz, d, dp, kg, kbuf + c * dp)
                    : load(src->k, s * src->kst, kk, d, dp, kbuf + c * dp);
                ksc[c] = scaled(kk) ? scale_at(src->ks, s * src->kss, src->ksk) : 1.0f;
            }
            for (int r = 0; r < g; r++) {
                const float *qq = qr + r * dp;
                vf p[LANES];
                for (int c = 0; c < LANES; c++) {
                    vf x = vload(qq) * vload(rows[c]);
                    for (int i = 1; i < nd; i++)
                        x += vload(qq + i * LANES) * vload(rows[c] + i * LANES);
                    p[c] = x;
                }
                vf got = sums(p);
                if (scaled(kk)) got *= vload(ksc);
                vstore(&z[r][j0], got);  /* past n: columns read twice, never weighed */
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
            for (int j = 0; j < nb; j += LANES)  /* past nb: never summed or weighed */
                vstore(&z[r][j], vexp(vload(&z[r][j]) - base));
            L[r] = L[r] * fade + sum(z[r], nb);
            if (fade != 1.0f) for (int e = 0; e < dvp; e++) acc[r * dvp + e] *= fade;
            M[r] = top;
        }
        for (int j0 = 0; j0 < nb; j0 += LANES) {
            int n = nb - j0 < LANES ? nb - j0 : LANES;
            for (int c = 0; c < n; c++) {
                long t = t0 + j0 + c, s = slots[t];
                if (t + AHEAD < c1) {
                    long f = slots[t + AHEAD];
                    ahead((const char *)src->v + f * src->vst * width(vk), dv, vk);
                    if (vk >= I8) ahead_scales(src->vs, src->vz, f * src->vss, src->vsk);
                }
                rows[c] = vk == G4
                    ? turned_row((const uint8_t *)src->v + s * src->vst, src->vs, s * src->vss,
                                 src->vsk, src->vz, dv, dvp, vg, vbuf + c * dvp)
                    : load(src->v, s * src->vst, vk, dv, dvp, vbuf + c * dvp);
                vsc[c] = scaled(vk) ? scale_at(src->vs, s * src->vss, src->vsk) : 1.0f;
            }
            for (int r = 0; r < g; r++) {
                float ws[LANES];
                const float *w = &z[r][j0];  /* unscaled values: the weights are the scores */
                if (scaled(vk)) {
                    for (int c = 0; c < n; c++) ws[c] = z[r][j0 + c] * vsc[c];
                    w = ws;
                }
                /* eight accumulators at a time, each a chain of its own: one chain would
                   wait out each addition's latency */
                for (int e0 = 0; e0 < ndv; e0 += 8) {
                    int ne = ndv - e0 < 8 ? ndv - e0 : 8;
                    float *o = acc + r * dvp + e0 * LANES;
                    vf a[8];
                    for (int e = 0; e < ne; e++) a[e] = vload(o + e * LANES);
                    for (int c = 0; c < n; c++)
                        for (int e = 0; e < ne; e++)
                            a[e] += w[c] * vload(rows[c] + (e0 + e) * LANES);
                    for (int e = 0; e < ne; e++) vstore(o + e * LANES, a[e]);
                }
            }
        }
    }
    int bad = 0;
    for (int r = 0; r < g; r++) {
        for (int e = 0; e < dv; e++) bad |= !is_finite(A[r * dv + e] = acc[r * dvp + e]);
        bad |= !is_finite(L[r]);
    }
    return bad;
}

/* ---- paged decode: every lane's seen columns through its row of the table, in one call ---- */

/* The arguments of one paged call, by name (native/found.py's Paged mirrors them). */
typedef struct {
    int lanes, kv, g, d, dv;    /* g: query rows a kv head (grouped heads of one token) */
    int kkind, vkind;           /* F32, F16, BF16, I8, I4 or G4 */
    int kskind, vskind;         /* the scales' kind (F32, F16, BF16), for I8, I4 and G4 pools */
    int kgroup, vgroup;         /* G4: channels a scale and zero point (0 for other kinds) */
    int threads;
    const float *q;             /* [lanes, kv, g, d], scaled */
    const int64_t *table;       /* lane b's slot of column c: table[b * table_stride + c] */
    long table_stride;
    const int64_t *start, *stop; /* [lanes]: lane b sees columns start[b] to stop[b] - 1 */
    const void *k; long kst, khs; /* element (codes: byte) strides of a slot and a head */
    const void *ks; long kss, kshs;
    const void *v; long vst, vhs;
    const void *vs; long vss, vshs;
    const int8_t *kz, *vz;      /* G4: zero points, laid out as the scales (NULL otherwise) */
    float *m, *l, *acc;         /* [lanes, kv, g] twice, [lanes, kv, g, dv] */
} cacheidx_paged_args;

/* lane b at kv head h: its g query rows over its seen columns, read through its row of the
   table (pages in any order, one slot a column), with attend's law */
INLINE int lane(const cacheidx_paged_args *a, int b, int h, int d, int dv, int kk, int vk,
                int kg, int vg) {
    const long at = (long)b * a->kv + h;
    const source s = {  /* kv head h's rows and scales (a float pool's scale strides are 0) */
        (const char *)a->k + h * a->khs * width(kk),
        (const char *)a->ks + h * a->kshs * width(a->kskind),
        (const char *)a->v + h * a->vhs * width(vk),
        (const char *)a->vs + h * a->vshs * width(a->vskind),
        a->kst, a->kss, a->vst, a->vss, kk, vk, a->kskind, a->vskind,
        a->table + (long)b * a->table_stride,
        a->kz ? a->kz + h * a->kshs : NULL, a->vz ? a->vz + h * a->vshs : NULL };
    return attend(&s, a->start[b], a->stop[b], a->q + at * a->g * d, a->g, d, dv, kk, vk, kg,
                  vg, a->m + at * a->g, a->l + at * a->g, a->acc + at * a->g * dv);
}

/* one lane and kv head, its head dims and kinds (and a turned pool's groups) made constants
   where they are the common ones (the loops then unroll and vectorise whole) */
#define LANE(D, K) lane(a, b, h, D, D, K, K, a->kgroup, a->vgroup)
#define TURNED(D) (a->kgroup == 16 && a->vgroup == 64 ? lane(a, b, h, D, D, G4, G4, 16, 64) \
                   : LANE(D, G4))
CLONES static int one(const cacheidx_paged_args *a, int b, int h) {
    int d = a->d, kk = a->kkind;
    if (d == a->dv && kk == a->vkind) {
        if (d == 64) switch (kk) {
            case F32: return LANE(64, F32); case F16: return LANE(64, F16);
            case BF16: return LANE(64, BF16); case I8: return LANE(64, I8);
            case I4: return LANE(64, I4); case G4: return TURNED(64);
            default: break;
        }
        if (d == 128) switch (kk) {
            case F32: return LANE(128, F32); case F16: return LANE(128, F16);
            case BF16: return LANE(128, BF16); case I8: return LANE(128, I8);
            case I4: return LANE(128, I4); case G4: return TURNED(128);
            default: break;
        }
    }
    return lane(a, b, h, a->d, a->dv, a->kkind, a->vkind, a->kgroup, a->vgroup);
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
static int cacheidx_paged(const cacheidx_paged_args *a) {
    if (a->g < 1 || a->g > ROWS || a->d < 1 || a->dv < 1 || a->d > WIDEST || a->dv > WIDEST
        || a->kkind < F32 || a->kkind > G4 || a->vkind < F32 || a->vkind > G4
        || (a->kkind >= I4 && a->d % 2) || (a->vkind >= I4 && a->dv % 2)
        || (a->kkind == G4 && (a->kz == NULL || a->kgroup < 1 || a->d % a->kgroup))
        || (a->vkind == G4 && (a->vz == NULL || a->vgroup < 1 || a->dv % a->vgroup)))
        return 1;
    work w = { a, 0, 0 };
    int n = a->lanes * a->kv, threads = a->threads < n ? a->threads : n;
    if (threads > MOST_THREADS) threads = MOST_THREADS;
#ifdef _OPENMP
    /* on the process's OpenMP threads, torch's intra-op pool where torch is loaded (one
       libgomp.so.1 a process): after each of its operators those threads spin a while before
       they sleep, so a thread of the kernel's own would share a core with a spinning one
       (8 lanes x 16k, 2 threads: 21.9 ms a step against 16.4 on the pool's threads) */
    #pragma omp parallel num_threads(threads) if (threads > 1)
    worker(&w);
#else
    pthread_t t[MOST_THREADS];
    int made = 0;
    for (; made < threads - 1; made++)
        if (pthread_create(&t[made], NULL, worker, &w)) break;  /* fewer threads, same work */
    worker(&w);
    for (int i = 0; i < made; i++) pthread_join(t[i], NULL);
#endif
    return w.bad;
}

/* ---- the module: each entry takes its arguments' struct as a buffer of exactly its size,
   and runs without the GIL; layout() says each struct's size and its fields' offsets, which
   the loader checks against its ctypes mirrors before it calls anything ---- */

static int taken(PyObject *arg, void *into, size_t size, const char *what) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return -1;
    if ((size_t)view.len != size) {
        PyErr_Format(PyExc_TypeError, "cacheidx.attention.native._kernel.%s: takes the %zu bytes "
                     "of its arguments' struct, got %zd", what, size, view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    memcpy(into, view.buf, size);
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *py_paged(PyObject *self, PyObject *arg) {
    cacheidx_paged_args a;
    int bad;
    if (taken(arg, &a, sizeof a, "paged") < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    bad = cacheidx_paged(&a);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(bad);
}

#define FIELD(S, F) Py_BuildValue("(sn)", #F, (Py_ssize_t)offsetof(S, F))
static PyObject *py_layout(PyObject *self, PyObject *unused) {
    PyObject *paged = Py_BuildValue(
        "(n[NNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNN])", (Py_ssize_t)sizeof(cacheidx_paged_args),
        FIELD(cacheidx_paged_args, lanes), FIELD(cacheidx_paged_args, kv),
        FIELD(cacheidx_paged_args, g), FIELD(cacheidx_paged_args, d),
        FIELD(cacheidx_paged_args, dv), FIELD(cacheidx_paged_args, kkind),
        FIELD(cacheidx_paged_args, vkind), FIELD(cacheidx_paged_args, kskind),
        FIELD(cacheidx_paged_args, vskind), FIELD(cacheidx_paged_args, kgroup),
        FIELD(cacheidx_paged_args, vgroup), FIELD(cacheidx_paged_args, threads),
        FIELD(cacheidx_paged_args, q), FIELD(cacheidx_paged_args, table),
        FIELD(cacheidx_paged_args, table_stride), FIELD(cacheidx_paged_args, start),
        FIELD(cacheidx_paged_args, stop), FIELD(cacheidx_paged_args, k),
        FIELD(cacheidx_paged_args, kst), FIELD(cacheidx_paged_args, khs),
        FIELD(cacheidx_paged_args, ks), FIELD(cacheidx_paged_args, kss),
        FIELD(cacheidx_paged_args, kshs), FIELD(cacheidx_paged_args, v),
        FIELD(cacheidx_paged_args, vst), FIELD(cacheidx_paged_args, vhs),
        FIELD(cacheidx_paged_args, vs), FIELD(cacheidx_paged_args, vss),
        FIELD(cacheidx_paged_args, vshs), FIELD(cacheidx_paged_args, kz),
        FIELD(cacheidx_paged_args, vz), FIELD(cacheidx_paged_args, m),
        FIELD(cacheidx_paged_args, l), FIELD(cacheidx_paged_args, acc));
    if (paged == NULL) return NULL;
    return Py_BuildValue("{sNsisisi}", "paged", paged, "rows", (int)ROWS, "widest",
                         (int)WIDEST, "abi", 4);
}

static PyMethodDef methods[] = {
    {"paged", py_paged, METH_O, "paged(args) -> 0, or 1 where the call is refused"},
    {"layout", py_layout, METH_NOARGS, "each struct's size and its fields' offsets"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel",
                                    "cacheidx's CPU kernel (see cacheidx.attention.native)", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
