/* cacheidx's CPU kernel: attention's online softmax over paged pools (float or quantized),
   read where they lie (codes cast to floats in registers). Built at install time as the
   extension module cacheidx.attention.native._kernel (setup.py);
   cacheidx/attention/native/__init__.py says what it computes and when the core computes
   instead.

   The same bits on every machine: every sum is written as partial sums in one order, and
   compiled without reassociation or contraction (-ffp-contract=off, never -ffast-math), so a
   vector of any width computes them as written. Its vector code (lanes.h) is built at each
   width a processor may offer, from one source: on x86-64 with GCC 11 or later, 16 floats a
   vector for x86-64-v4 (AVX-512), 8 for x86-64-v3 (AVX2) and 4 for the baseline (SSE2), the
   widest the processor runs picked at the first call (as -march=native would, without tying
   the build to the machine); elsewhere, or built with CACHEIDX_ONE_TARGET, one width
   (CACHEIDX_WIDTH, 4 unless said). Every width runs the same operations in the same order, so each gives the
   same bits. A compiler that keeps floats in wider registers (FLT_EVAL_METHOD 1 or 2: x87)
   would round differently, so it is refused. */
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

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 \
    && !defined(CACHEIDX_ONE_TARGET)
#define WIDTHS 1  /* a body for each of x86-64-v4, v3 and the baseline, picked at run time */
#if __GNUC__ >= 12
#define HAS_V4 __builtin_cpu_supports("x86-64-v4")
#define HAS_V3 __builtin_cpu_supports("x86-64-v3")
#else  /* GCC 11 compiles for the levels but cannot name them at run time: their features */
#define HAS_V3 (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") \
                && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2"))
#define HAS_V4 (HAS_V3 && __builtin_cpu_supports("avx512f") \
                && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") \
                && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512cd"))
#endif
#endif

/* every helper inlined into its caller, and so compiled for the target of the caller's body */
#define INLINE static inline __attribute__((always_inline))

/* BLOCK: the columns a pass over keys takes before the pass over their values; 256 rather
   than 64 took one layer's float32 reads over shuffled pages at 8 x 16k from 41 to 30 ns a
   column and kv head (23 against 30.5 with pages in order), the passes' bookkeeping and their
   turns from one pool to the other a quarter as often */
enum { ROWS = 16, BLOCK = 256, LANES = 16, WIDEST = 1024, RUN = 16, STREAMS = 8, AHEAD = 64 };

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

/* asks the processor for the d elements of kind k at p, one cache line at a time, into its
   second-level cache (into the first, they would hold the line fill buffers demand reads need) */
INLINE void ahead(const char *p, int d, int k) {
    long bytes = k == I4 || k == G4 ? d / 2 : d * width(k);
    for (long x = 0; x < bytes; x += 64) __builtin_prefetch(p + x, 0, 2);
}

/* The column whose rows of kind k a pass asks for at column t. Float rows: one in the next
   group of STREAMS runs of RUN columns, the runs taken in turn, a row of each (column t of a
   group asks for row t / STREAMS of run t % STREAMS of the next group), so that every column
   of a group is asked for once while the group before it is read. A run is a page as
   servers' allocators hand them out (16 slots: vLLM's default block, the engine's), and a
   lane's pages lie anywhere in the pool: a core follows several runs of memory at once only
   where it is asked for them together. Asked for one run after another, shuffled pages of
   4 KB (a kv head's 16 rows of 64 floats) came at 8 to 10 GB/s on a Zen 3 core, in order 17
   to 18; the lines of four pages asked for in turn, 12 to 14 (a C loop over 512 MB). One
   layer at 8 x 16k float32 over shuffled pages: 24 to 32 ms a row AHEAD columns on, 18 to 22
   ms with 8 runs in turn (4: 19 to 23, 16: 18 to 25); 32 x 16k: 129 against 88 ms. Other
   pages than 16 slots are asked for alike, every column once. Codes (8 and 4 bits, a page of
   1 KB or less, their passes bound by arithmetic): the row AHEAD columns on, as before,
   which took 2 to 8% less than runs in turn over shuffled pages (int8, 8 and 32 lanes x 16k,
   most of 9 runs). */
INLINE long ahead_of(long t, int k) {
    if (k >= I8) return t + AHEAD;
    const unsigned long group = STREAMS * RUN, u = (unsigned long)t, at = u % group;
    return (long)((u / group + 1) * group + at % STREAMS * RUN + at / STREAMS);
}

/* asks for the scales of a row of codes at off (in elements), and a turned row's zero points
   where z is not NULL: they lie in arrays of their own, and unasked, each page's first read
   of them waits on memory (8 lanes x 16k of int8: 14 ms a layer unasked, 7.5 ms asked for) */
INLINE void ahead_scales(const void *scales, const int8_t *z, long off, int sk) {
    __builtin_prefetch((const char *)scales + off * width(sk), 0, 2);
    if (z) __builtin_prefetch(z + off, 0, 2);
}

/* asks for the row of column ahead_of(t) (before c1) of a lane's pool of kind k, whose rows
   lie st elements apart from rows (bytes for codes), and for codes their scales (ss apart,
   of kind sk) and a turned row's zero points (z, laid out as the scales; NULL otherwise) */
INLINE void ask_ahead(const void *rows, long st, const void *scales, const int8_t *z, long ss,
                      int sk, const int64_t *slots, long t, long c1, int d, int k) {
    const long ta = ahead_of(t, k);
    if (ta >= c1) return;
    const long f = slots[ta];
    ahead((const char *)rows + f * st * width(k), d, k);
    if (k >= I8) ahead_scales(scales, z, f * ss, sk);
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

/* ---- the vector code at each width (lanes.h), and the widest this processor runs ---- */

#define N_(name, w) name##_##w
#define N__(name, w) N_(name, w)
#define N(name) N__(name, W)

typedef int (*one_fn)(const cacheidx_paged_args *, int, int);

/* a body of the kernel and its width (floats a vector) */
typedef struct { one_fn one; int width; } body;

#ifdef WIDTHS
#define W 16
#define TARGET __attribute__((target("arch=x86-64-v4")))
#include "lanes.h"
#undef W
#undef TARGET
#define W 8
#define TARGET __attribute__((target("arch=x86-64-v3")))
#include "lanes.h"
#undef W
#undef TARGET
#define W 4
#define TARGET
#include "lanes.h"
#undef W
#undef TARGET

/* the widest body this processor runs */
static body widest(void) {
    __builtin_cpu_init();
    if (HAS_V4) return (body){one_16, 16};
    if (HAS_V3) return (body){one_8, 8};
    return (body){one_4, 4};
}
#else
#ifdef CACHEIDX_WIDTH
#define W CACHEIDX_WIDTH
#else
#define W 4
#endif
#define TARGET
#include "lanes.h"
static body widest(void) { return (body){N(one), W}; }
#undef W
#undef TARGET
#endif

typedef struct { const cacheidx_paged_args *a; one_fn one; int next, bad; } work;

/* takes lanes x kv heads one at a time until none is left (or one was refused) */
static void *worker(void *p) {
    work *w = (work *)p;
    const int n = w->a->lanes * w->a->kv;
    for (;;) {
        int i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (i >= n || __atomic_load_n(&w->bad, __ATOMIC_RELAXED)) break;
        if (w->one(w->a, i / w->a->kv, i % w->a->kv)) __atomic_store_n(&w->bad, 1, __ATOMIC_RELAXED);
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
    work w = { a, widest().one, 0, 0 };
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
    return Py_BuildValue("{sNsisisisi}", "paged", paged, "rows", (int)ROWS, "widest",
                         (int)WIDEST, "abi", 4, "width", widest().width);
}

static PyMethodDef methods[] = {
    {"paged", py_paged, METH_O, "paged(args) -> 0, or 1 where the call is refused"},
    {"layout", py_layout, METH_NOARGS, "each struct's size and its fields' offsets"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel",
                                    "cacheidx's CPU kernel (see cacheidx.attention.native)", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
