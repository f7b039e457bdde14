/* The kernel at one vector width: kernel.c includes this once for each width it builds, with
   W (floats a vector: 16, 8 or 4, the widest register of the target), N(name) (the name with
   the width's suffix) and TARGET (the instruction set its functions are compiled for).

   Every sum is LANES partial sums whatever W is (kernel.c's law): a row of LANES lanes is
   P = LANES / W vectors, and each operation runs on each of them, lane by lane, so every width
   computes the same bits. Only the registers differ: a GCC vector wider than the target's
   registers has no machine mode, lives in memory and is shuffled element by element (on AVX2,
   16-float vectors took the kernel 2.3 to 4.6 times as long as these of 8: a layer at 8 x 16k,
   float32 65 against 28 ms, int8 65 against 14). */

#define P (LANES / W)

typedef float N(vf) __attribute__((vector_size(W * sizeof(float))));
typedef int32_t N(vi) __attribute__((vector_size(W * sizeof(float))));
typedef uint8_t N(vb) __attribute__((vector_size(W)));
#define vf N(vf)
#define vi N(vi)
#define vb N(vb)

INLINE vf N(vload)(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
INLINE void N(vstore)(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* fexp lane by lane, in vector operations (the compiler does not vectorise fexp's loop):
   rintf(t) as (t + 1.5 2^23) - 1.5 2^23, the same integer for |t| < 2^22 under the default
   rounding, and t is within [-126, 1] here */
INLINE vf N(vexp)(vf x) {
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

/* lane by lane, a's lanes picked by i plus those picked by j (indices into a then b) */
INLINE vf N(pick)(vf a, vf b, vi i, vi j) {
    return __builtin_shuffle(a, b, i) + __builtin_shuffle(a, b, j);
}

/* The dot products of one query row with LANES key rows, as `halved` sums each: p[c P + j]
   holds lanes j W to j W + W - 1 of column c's LANES partial sums (element i in sum
   i % LANES). The pairwise halving (lanes j and j + 8, then j + 4, j + 2, j + 1) adds whole
   vectors while its distance is W or more, then runs for the columns together, two of them
   a vector at each level (a transpose as it goes), so column c's sum lands in lane c % W of
   out[c / W]: the same additions as `halved` on each column, a fifth of the instructions. */
INLINE void N(sums)(const vf *p, vf *out) {
#if W == 16
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = N(pick)(p[2 * i], p[2 * i + 1],
                       (vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                       (vi){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++)
        b[i] = N(pick)(a[2 * i], a[2 * i + 1],
                       (vi){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                       (vi){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++)
        c[i] = N(pick)(b[2 * i], b[2 * i + 1],
                       (vi){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                       (vi){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    out[0] = N(pick)(c[0], c[1], (vi){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
                     (vi){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
#elif W == 8
    vf u[LANES], v[8], w[4];
    for (int c = 0; c < LANES; c++) u[c] = p[2 * c] + p[2 * c + 1];  /* j + 8 */
    /* j + 4: columns c and c + 4 a vector (c = 0-3, then 8-11), so that the last level's
       lanes come out in the columns' order */
    for (int i = 0; i < 8; i++) {
        int c = i / 4 * 8 + i % 4;
        v[i] = N(pick)(u[c], u[c + 4], (vi){0, 1, 2, 3, 8, 9, 10, 11},
                       (vi){4, 5, 6, 7, 12, 13, 14, 15});
    }
    for (int i = 0; i < 4; i++)  /* j + 2, then j + 1: within each 128-bit half */
        w[i] = N(pick)(v[2 * i], v[2 * i + 1], (vi){0, 1, 8, 9, 4, 5, 12, 13},
                       (vi){2, 3, 10, 11, 6, 7, 14, 15});
    for (int i = 0; i < 2; i++)
        out[i] = N(pick)(w[2 * i], w[2 * i + 1], (vi){0, 2, 8, 10, 4, 6, 12, 14},
                         (vi){1, 3, 9, 11, 5, 7, 13, 15});
#elif W == 4
    vf u[LANES], v[8];
    for (int c = 0; c < LANES; c++)  /* j + 8, then j + 4 */
        u[c] = (p[4 * c] + p[4 * c + 2]) + (p[4 * c + 1] + p[4 * c + 3]);
    for (int i = 0; i < 8; i++)  /* j + 2: columns 2i and 2i + 1 a vector; then j + 1 */
        v[i] = N(pick)(u[2 * i], u[2 * i + 1], (vi){0, 1, 4, 5}, (vi){2, 3, 6, 7});
    for (int i = 0; i < 4; i++)
        out[i] = N(pick)(v[2 * i], v[2 * i + 1], (vi){0, 2, 4, 6}, (vi){1, 3, 5, 7});
#else
#error "lanes.h: W is 16, 8 or 4"
#endif
}

/* A turned row (G4) as floats, turned.py's law T3's first half: y_i = (c_i - z) s over each
   group of g channels, the difference an exact integer and one product, as the array path
   computes it (bit for bit); codes packed as I4's. Padded with zeros to dp. */
INLINE const float *N(turned_row)(const uint8_t *restrict c, const void *sc, long soff, int sk,
                                  const int8_t *restrict z, int d, int dp, int g,
                                  float *restrict buf) {
    const int h = d / 2;
    if (h % LANES == 0 && g % LANES == 0) {  /* whole vectors: W codes a byte vector */
        for (int i = 0; i < h; i += W) {
            vb x;
            memcpy(&x, c + i, sizeof x);
            N(vstore)(buf + i, __builtin_convertvector(__builtin_convertvector(x & 15, vi), vf));
            N(vstore)(buf + h + i,
                      __builtin_convertvector(__builtin_convertvector(x >> 4, vi), vf));
        }
        for (int i = 0; i < d; i += W) {
            const float s = scale_at(sc, soff + i / g, sk), zf = (float)z[soff + i / g];
            N(vstore)(buf + i, (N(vload)(buf + i) - zf) * s);
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

/* Column s's row of one pool of kind k as floats (padded with zeros to dp), and through `scale`
   its scale (1 where the pool has none): what each pass reads of a column. */
INLINE const float *N(row)(const void *pool, long st, const void *sc, long ss, int sk,
                           const int8_t *z, int k, int d, int dp, int grp, long s, float *buf,
                           float *scale) {
    const float *r = k == G4
        ? N(turned_row)((const uint8_t *)pool + s * st, sc, s * ss, sk, z, d, dp, grp, buf)
        : load(pool, s * st, k, d, dp, buf);
    *scale = scaled(k) ? scale_at(sc, s * ss, sk) : 1.0f;
    return r;
}

/* The online softmax's state (M, L, A: [g], [g], [g, dv]) of g query rows q [g, d] (scaled)
   over columns c0 to c1 - 1 of one kv head, each key and value row read once for all g rows.
   Scores are weighed in blocks of BLOCK columns, LANES columns at a time: each row's dot
   products as `sums` adds them, times the key's scale, then exp(z - the block's running
   maximum); values summed column by column in order, each weighed by its score times its
   scale. Returns 1 (the outputs to be discarded) where a query is not finite, a score is NaN
   or +inf, or the state is not finite at the end (a value or a scale that is not: the core
   weighs the call as its laws say). A score of -inf weighs nothing; a row whose scores are
   all -inf keeps M = -inf, L = 0, A = 0 (never exp(-inf - -inf)). */
INLINE int N(attend)(const source *src, long c0, long c1, const float *q, int g, int d, int dv,
                     int kk, int vk, int kg, int vg, float *M, float *L, float *A) {
    const int dp = (d + LANES - 1) / LANES * LANES, dvp = (dv + LANES - 1) / LANES * LANES;
    const int nd = dp / LANES, nv = dvp / W;
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
                /* the key rows of a column further on fetched now (ask_ahead): a
                   lane's pages lie anywhere, and the processor's prefetcher stops at each
                   page's end. Each pass asks for its own pool's rows (the value pass below
                   for values): asked for together here, both pools' requests came in one
                   burst the processor could not keep in flight (8 x 16k, pages in order:
                   30.5 ns a column and kv head against 24). Slight changes to this loop's
                   order (the slot read after the test of c, say) have cost 25 to 50% over
                   shuffled pages: time them with the pages shuffled. */
                ask_ahead(src->k, src->kst, src->ks, src->kz, src->kss, src->ksk, slots, t, c1,
                          d, kk);
                rows[c] = N(row)(src->k, src->kst, src->ks, src->kss, src->ksk, src->kz, kk, d,
                                 dp, kg, s, kbuf + c * dp, &ksc[c]);
            }
            for (int r = 0; r < g; r++) {
                const float *qq = qr + r * dp;
                vf p[LANES * P], got[P];
                for (int c = 0; c < LANES; c++)
                    for (int j = 0; j < P; j++) {
                        vf x = N(vload)(qq + j * W) * N(vload)(rows[c] + j * W);
                        for (int i = 1; i < nd; i++)
                            x += N(vload)(qq + i * LANES + j * W)
                               * N(vload)(rows[c] + i * LANES + j * W);
                        p[c * P + j] = x;
                    }
                N(sums)(p, got);
                for (int j = 0; j < P; j++) {
                    if (scaled(kk)) got[j] *= N(vload)(ksc + j * W);
                    N(vstore)(&z[r][j0 + j * W], got[j]);  /* past n: read twice, never weighed */
                }
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
            for (int j = 0; j < nb; j += W)  /* past nb: never summed or weighed */
                N(vstore)(&z[r][j], N(vexp)(N(vload)(&z[r][j]) - base));
            L[r] = L[r] * fade + sum(z[r], nb);
            if (fade != 1.0f) for (int e = 0; e < dvp; e++) acc[r * dvp + e] *= fade;
            M[r] = top;
        }
        for (int j0 = 0; j0 < nb; j0 += LANES) {
            int n = nb - j0 < LANES ? nb - j0 : LANES;
            for (int c = 0; c < n; c++) {
                long t = t0 + j0 + c, s = slots[t];
                ask_ahead(src->v, src->vst, src->vs, src->vz, src->vss, src->vsk, slots, t, c1,
                          dv, vk);
                rows[c] = N(row)(src->v, src->vst, src->vs, src->vss, src->vsk, src->vz, vk,
                                 dv, dvp, vg, s, vbuf + c * dvp, &vsc[c]);
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
                for (int e0 = 0; e0 < nv; e0 += 8) {
                    int ne = nv - e0 < 8 ? nv - e0 : 8;
                    float *o = acc + r * dvp + e0 * W;
                    vf a[8];
                    for (int e = 0; e < ne; e++) a[e] = N(vload)(o + e * W);
                    for (int c = 0; c < n; c++)
                        for (int e = 0; e < ne; e++)
                            a[e] += w[c] * N(vload)(rows[c] + (e0 + e) * W);
                    for (int e = 0; e < ne; e++) N(vstore)(o + e * W, a[e]);
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

/* lane b at kv head h: its g query rows over its seen columns, read through its row of the
   table (pages in any order, one slot a column), with attend's law */
INLINE int N(lane)(const cacheidx_paged_args *a, int b, int h, int d, int dv, int kk, int vk,
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
    return N(attend)(&s, a->start[b], a->stop[b], a->q + at * a->g * d, a->g, d, dv, kk, vk,
                     kg, vg, a->m + at * a->g, a->l + at * a->g, a->acc + at * a->g * dv);
}

/* one lane and kv head, its head dims and kinds (and a turned pool's groups) made constants
   where they are the common ones (the loops then unroll and vectorise whole) */
#define LANE(D, K) N(lane)(a, b, h, D, D, K, K, a->kgroup, a->vgroup)
#define TURNED(D) (a->kgroup == 16 && a->vgroup == 64 ? N(lane)(a, b, h, D, D, G4, G4, 16, 64) \
                   : LANE(D, G4))
TARGET static int N(one)(const cacheidx_paged_args *a, int b, int h) {
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
    return N(lane)(a, b, h, a->d, a->dv, a->kkind, a->vkind, a->kgroup, a->vgroup);
}

#undef LANE
#undef TURNED
#undef vf
#undef vi
#undef vb
#undef P
