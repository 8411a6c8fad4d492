/* Variable-length attention on the CPU, straight from the flat token stream.
 *
 * Why: torch's CPU attention (the flash kernel behind scaled_dot_product_attention) costs a few
 * microseconds per (sequence, head) whatever the size, and at head sizes of 32-64 with short sequences
 * that fixed cost is most of an encoder's forward. Here one work item is one (sequence, head): its keys
 * and values are converted once to float32 in a scratch area (keys transposed), then queries go eight at
 * a time (four without AVX-512, and a sequence's last few) against 32 keys (two blocks of 16) with every
 * accumulator in registers. No padding, no masks, no copies of
 * the stream: q, k, v are read through their strides (views of the packed qkv projection) and the output
 * is written in place.
 *
 * Layout: q (T, Hq, D), k and v (T, Hkv, D), out (T, Hq, D); last dimension contiguous; strides in
 * elements. dtype 0 = float32, 1 = bfloat16 (converted exactly to float32; rounded to nearest even on
 * the way out). Softmax in float32. causal: a query sees keys at or before it. window >= 0: keys at most
 * `window` positions away (before it only, when causal).
 *
 * On CPUs with AMX (bfloat16, head sizes 32 and 64) both products run on the tile unit instead; see
 * attend_one_amx. On CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and later, Intel Cooper Lake), bfloat16
 * at head sizes that are multiples of 32 runs both products as bf16 pair products (vdpbf16ps); see
 * attend_one_dot.
 *
 * Built by embed_service.ops.cpu_kernels with the system C compiler; nothing here is required: without a
 * compiler the server falls back to torch.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#endif
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Queries per step: 8 where the CPU has 32 vector registers (AVX-512: 16 accumulators, two key or value
 * vectors and a broadcast stay in registers, two loads per 16 FMAs), else 4 (AVX2's 16 registers hold a
 * vf16 in two each). */
#if defined(__AVX512F__)
#define QB 8
#else
#define QB 4
#endif
#define KB 16 /* keys per block: one vector of 16 float32 (a 512-bit register where the CPU has them) */

/* Explicit vectors through the compiler's vector extension (GCC, Clang): one source for every target;
 * without 512-bit registers the compiler splits each into narrower ones. */
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4)));

static inline vf16 vload(const float *p) { return *(const vf16u *)p; }
static inline void vstore(float *p, vf16 x) { *(vf16u *)p = x; }
static inline vf16 vsplat(float a) { return (vf16){0} + a; }

/* n values of a row to float32 (bf16: exact). */
static inline __attribute__((always_inline)) void load_row(float *restrict dst, const void *src, int n, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        memcpy(dst, src, sizeof(float) * n);
    }
}

static inline __attribute__((always_inline)) void store_row(void *dst, const float *restrict src, float mul, int n,
                                                            int bf16) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst;
        for (int i = 0; i < n; i++) d[i] = float_to_bf16(src[i] * mul);
    } else {
        float *d = (float *)dst;
        for (int i = 0; i < n; i++) d[i] = src[i] * mul;
    }
}

/* The keys query i may see, [*lo, *hi), and the union over a block of queries, [*glo, *ghi). */
static inline void key_range(int i, int L, int causal, int window, int *lo, int *hi, int *glo, int *ghi) {
    int a = 0, b = L;
    if (causal) b = i + 1;
    if (window >= 0) {
        a = i - window > 0 ? i - window : 0;
        if (!causal) b = i + window + 1 < L ? i + window + 1 : L;
    }
    *lo = a;
    *hi = b;
    *glo = a < *glo ? a : *glo;
    *ghi = b > *ghi ? b : *ghi;
}

/* Scores of R <= QB queries against keys [jb, jb + 2 KB): s[r][jb + u] = sum_d qs[r][d] * kt[d][jb + u].
 * 2 R independent accumulators keep both FMA units busy. */
static inline __attribute__((always_inline)) void score_block(int R, int D, const float *restrict qs,
                                                              const float *restrict kt, int lp, int jb,
                                                              float *restrict s) {
    vf16 a0[QB], a1[QB];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = vsplat(0.f);
    for (int d = 0; d < D; d++) {
        const vf16 k0 = vload(kt + (int64_t)d * lp + jb), k1 = vload(kt + (int64_t)d * lp + jb + KB);
        for (int r = 0; r < R; r++) {
            const vf16 a = vsplat(qs[r * D + d]);
            a0[r] += a * k0;
            a1[r] += a * k1;
        }
    }
    for (int r = 0; r < R; r++) {
        vstore(s + (int64_t)r * lp + jb, a0[r]);
        vstore(s + (int64_t)r * lp + jb + KB, a1[r]);
    }
}

/* o[r][c..c+16) = sum_j p[r][j] * vf[j][c..c+16) over j in [j0, j1), for R <= QB queries. */
static inline __attribute__((always_inline)) void weigh_values(int R, int D, const float *restrict p, int lp,
                                                               const float *restrict vf, int j0, int j1,
                                                               float *restrict o) {
    for (int c = 0; c < D; c += 2 * KB) {
        const int two = c + KB < D; /* a second column block of 16 */
        vf16 a0[QB], a1[QB];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = vsplat(0.f);
        for (int j = j0; j < j1; j++) {
            const float *restrict vrow = vf + (int64_t)j * D + c;
            const vf16 v0 = vload(vrow), v1 = two ? vload(vrow + KB) : vsplat(0.f);
            for (int r = 0; r < R; r++) {
                const vf16 w = vsplat(p[(int64_t)r * lp + j]);
                a0[r] += w * v0;
                a1[r] += w * v1;
            }
        }
        for (int r = 0; r < R; r++) {
            vstore(o + r * D + c, a0[r]);
            if (two) vstore(o + r * D + c + KB, a1[r]);
        }
    }
}

/* Queries [i0, i0 + nq) of one (sequence, head), as R >= nq rows (the last one repeated to fill them):
 * scores, softmax, weighted values, output rows. */
static inline __attribute__((always_inline)) void query_block(int R, int D, int Dp, int bf16, int L, int i0,
                                                              int nq, const char *q, int64_t qt, char *out,
                                                              int64_t ot, float scale, int causal, int window,
                                                              const float *kt, const float *vf, int lp,
                                                              float *s, float *qs, float *o) {
    const size_t esz = bf16 ? 2 : 4;
    int lo[QB], hi[QB];
    int glo = L, ghi = 0;
    for (int r = 0; r < R; r++) {
        const int i = i0 + (r < nq ? r : nq - 1);
        key_range(i, L, causal, window, &lo[r], &hi[r], &glo, &ghi);
        load_row(qs + r * Dp, q + (int64_t)i * qt * esz, D, bf16);
        for (int d = D; d < Dp; d++) qs[r * Dp + d] = 0.f;
        for (int d = 0; d < Dp; d++) qs[r * Dp + d] *= scale;
    }
    for (int jb = glo / (2 * KB) * (2 * KB); jb < ghi; jb += 2 * KB) score_block(R, Dp, qs, kt, lp, jb, s);
    float inv[QB];
    for (int r = 0; r < R; r++) {
        float *sr = s + (int64_t)r * lp;
        float m = sr[lo[r]];
        for (int j = lo[r] + 1; j < hi[r]; j++) m = sr[j] > m ? sr[j] : m;
        for (int j = lo[r]; j < hi[r]; j++) sr[j] = expf(sr[j] - m);
        float sum = 0.f;
        for (int j = lo[r]; j < hi[r]; j++) sum += sr[j];
        for (int j = glo; j < lo[r]; j++) sr[j] = 0.f;
        for (int j = hi[r]; j < ghi; j++) sr[j] = 0.f;
        inv[r] = 1.f / sum;
    }
    weigh_values(R, Dp, s, lp, vf, glo, ghi, o);
    for (int r = 0; r < nq; r++) store_row(out + (int64_t)(i0 + r) * ot * esz, o + r * Dp, inv[r], D, bf16);
}

/* One (sequence, head). D values per row are read and written; the arithmetic runs on Dp, D rounded up
 * to 16, with zeros in between. Scratch: kt (Dp x lp), vf (lp x Dp), s (QB x lp), qs and o (QB x Dp),
 * row (Dp). */
static inline __attribute__((always_inline)) void attend_one(int D, int Dp, int bf16, int L, const char *q, int64_t qt,
                                                             const char *k, int64_t kt_stride, const char *v,
                                                             int64_t vt, char *out, int64_t ot, float scale,
                                                             int causal, int window, float *kt, float *vf,
                                                             float *s, float *qs, float *o, float *row) {
    const int lp = (L + 2 * KB - 1) / (2 * KB) * (2 * KB);
    const size_t esz = bf16 ? 2 : 4;
    for (int d = D; d < Dp; d++) row[d] = 0.f;
    for (int j = 0; j < L; j++) { /* keys, transposed: kt[d][j] */
        load_row(row, k + (int64_t)j * kt_stride * esz, D, bf16);
        for (int d = 0; d < Dp; d++) kt[(int64_t)d * lp + j] = row[d];
    }
    for (int d = 0; d < Dp; d++)
        for (int j = L; j < lp; j++) kt[(int64_t)d * lp + j] = 0.f;
    for (int j = 0; j < L; j++) {
        load_row(vf + (int64_t)j * Dp, v + (int64_t)j * vt * esz, D, bf16);
        for (int d = D; d < Dp; d++) vf[(int64_t)j * Dp + d] = 0.f;
    }

    for (int i0 = 0; i0 < L; i0 += QB) {
        const int nq = L - i0 < QB ? L - i0 : QB;
        /* A short last block (short sequences end in one) in half the rows: less work thrown away. */
        if (QB > 4 && nq <= QB / 2)
            query_block(QB / 2, D, Dp, bf16, L, i0, nq, q, qt, out, ot, scale, causal, window, kt, vf, lp, s, qs, o);
        else
            query_block(QB, D, Dp, bf16, L, i0, nq, q, qt, out, ot, scale, causal, window, kt, vf, lp, s, qs, o);
    }
}

#if defined(HAVE_AMX) || defined(HAVE_BF16_DOT)
/* r[i]: row i of a 16 x 16 matrix of 32-bit values; afterwards r[i] is its column i. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* The bfloat16 pair paths (AMX tiles, AVX512-BF16 dot products): both multiply pairs of bf16 values into
 * float32 sums, so both stage keys as pairs over the head dimension, kp[d/2][j] (zeros from L up to lp),
 * and values as pairs over keys, vp[j/2][d] (a zero partner past L). Softmax in float32, weights rounded to
 * bf16 as torch's own bf16 attention does (their sum, the normalizer, stays float32). */
static inline __attribute__((always_inline)) void stage_pairs(int D, int L, int lp, const char *k, int64_t kts,
                                                              const char *v, int64_t vt, uint32_t *kp,
                                                              uint32_t *vp) {
    /* Keys 16 at a time, 16 pairs (32 head dimensions) at a time, through a 16 x 16 transpose; D % 32 == 0. */
    for (int j0 = 0; j0 < lp; j0 += 16) {
        for (int c = 0; c < D / 2; c += 16) {
            __m512i r[16];
            for (int u = 0; u < 16; u++)
                r[u] = j0 + u < L ? _mm512_loadu_si512((const uint32_t *)(k + (int64_t)(j0 + u) * kts * 2) + c)
                                  : _mm512_setzero_si512();
            transpose16(r);
            for (int u = 0; u < 16; u++) _mm512_storeu_si512(kp + (int64_t)(c + u) * lp + j0, r[u]);
        }
    }
    for (int j = 0; j < lp; j += 2) {
        uint32_t *dst = vp + (int64_t)(j / 2) * D;
        if (j + 1 < L) {
            const uint16_t *r0 = (const uint16_t *)(v + (int64_t)j * vt * 2);
            const uint16_t *r1 = (const uint16_t *)(v + (int64_t)(j + 1) * vt * 2);
            for (int d = 0; d < D; d++) dst[d] = r0[d] | ((uint32_t)r1[d] << 16);
        } else if (j < L) {
            const uint16_t *r0 = (const uint16_t *)(v + (int64_t)j * vt * 2);
            for (int d = 0; d < D; d++) dst[d] = r0[d];
        } else {
            for (int d = 0; d < D; d++) dst[d] = 0;
        }
    }
}

/* R query rows from i0 (nq of them real, the rest zero) into qbuf (R x D bf16), with each one's key range
 * [lo, hi) and their union [*glo, *ghi). */
static inline __attribute__((always_inline)) void gather_queries(int R, int D, int L, int i0, int nq, const char *q,
                                                                 int64_t qt, int causal, int window, uint16_t *qbuf,
                                                                 int *lo, int *hi, int *glo, int *ghi) {
    for (int r = 0; r < R; r++) {
        if (r < nq) {
            const int i = i0 + r;
            key_range(i, L, causal, window, &lo[r], &hi[r], glo, ghi);
            memcpy(qbuf + r * D, q + (int64_t)i * qt * 2, (size_t)D * 2);
        } else {
            memset(qbuf + r * D, 0, (size_t)D * 2);
        }
    }
}

/* e^x, 16 at a time, for x <= 0 (the softmax's shifted scores): x = n ln 2 + f with |f| <= ln 2 / 2, e^f by
 * its Taylor polynomial to f^5 (relative error under 3e-6 there, far below the bf16 rounding of the
 * weights), times 2^n (vscalefps). Below -87.3 the result is clamped to e^-87.3 ~ 1e-38, nothing next to
 * the row's largest weight, 1. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln 2 in two parts: exact n * hi */
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.f / 120);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* 2^t, 16 at a time, for t <= 0 (the softmax's shifted scores, in base 2): t = n + f with |f| <= 1/2, 2^f by a
 * degree-4 polynomial fitted for least maximum relative error there (under 3e-6 in float32, far below the bf16
 * rounding of the weights), times 2^n (vscalefps; 0 below 2^-149). */
static inline __m512 exp2_16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.5828529e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5906426e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024099e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312418e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* Rows of scores s (R x lp, keys [jlo, jhi)) to bf16 weights pp (zero outside each row's [lo, hi), whole
 * rows of zeros from nq on) and each real row's 1 / sum in inv; `scale` applied inside the exponent. */
static inline __attribute__((always_inline)) void softmax_pairs(int R, int nq, const int *lo, const int *hi, int jlo,
                                                                int jhi, const float *s, int lp, float scale,
                                                                uint16_t *pp, float *inv) {
    const float scale2 = scale * 1.44269504088896341f; /* e^(x scale) = 2^(x scale log2 e) */
    const __m512 sc = _mm512_set1_ps(scale2);
    for (int r = 0; r < R; r++) {
        uint16_t *pr = pp + (int64_t)r * lp;
        if (r >= nq) {
            memset(pr + jlo, 0, (size_t)(jhi - jlo) * 2);
            continue;
        }
        const float *sr = s + (int64_t)r * lp;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int j = lo[r]; j < hi[r]; j += 16) /* masked loads: nothing past the row's keys is read */
            mv = _mm512_mask_max_ps(mv, first(hi[r] - j), mv, _mm512_maskz_loadu_ps(first(hi[r] - j), sr + j));
        const __m512 msc = _mm512_set1_ps(_mm512_reduce_max_ps(mv) * scale2);
        __m512 sum = _mm512_setzero_ps();
        for (int j = lo[r]; j < hi[r]; j += 16) {
            const __mmask16 k = first(hi[r] - j);
            const __m512 e = _mm512_maskz_mov_ps(k, exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, sr + j), sc, msc)));
            sum = _mm512_add_ps(sum, e);
            /* rounded to nearest even (vcvtneps2bf16), as float_to_bf16 */
            _mm256_mask_storeu_epi16(pr + j, k, (__m256i)_mm512_cvtneps_pbh(e));
        }
        inv[r] = 1.f / _mm512_reduce_add_ps(sum);
        for (int j = jlo; j < lo[r]; j++) pr[j] = 0;
        for (int j = hi[r]; j < jhi; j++) pr[j] = 0;
    }
}
#endif

#ifdef HAVE_AMX
/* bfloat16 at head sizes 32 and 64 on CPUs with AMX: both products run on the tile unit, 16 queries at a
 * time. Scores: Q (16 x 32 bf16) x K^T (keys staged as pairs over the head dimension, kp[d/2][j]) into a
 * 16 x 16 float32 tile per 16 keys. Softmax (softmax_pairs) in float32 with AVX-512 (written by the
 * compiler). Values: P (16 x 32 keys bf16) x V (staged as pairs over keys, vp[j/2][d]) into 16 x 16 float32
 * tiles. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 yes, -1 no; a race only repeats the same request */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* EMBED_CPU_AMX=0 keeps the float32 path (tests compare both; read per call, it is one getenv). */
static int amx_disabled(void) {
    const char *flag = getenv("EMBED_CPU_AMX");
    return flag != NULL && flag[0] == '0';
}

static void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline __attribute__((always_inline)) void attend_one_amx(int D, int L, const char *q, int64_t qt,
                                                                 const char *k, int64_t kts, const char *v,
                                                                 int64_t vt, char *out, int64_t ot, float scale,
                                                                 int causal, int window, uint32_t *kp,
                                                                 uint32_t *vp, float *s, uint16_t *pp,
                                                                 uint16_t *qbuf, float *o) {
    const int lp = (L + 2 * KB - 1) / (2 * KB) * (2 * KB);
    stage_pairs(D, L, lp, k, kts, v, vt, kp, vp);
    for (int i0 = 0; i0 < L; i0 += 16) {
        const int nq = L - i0 < 16 ? L - i0 : 16;
        int lo[16], hi[16];
        int glo = L, ghi = 0;
        gather_queries(16, D, L, i0, nq, q, qt, causal, window, qbuf, lo, hi, &glo, &ghi);
        const int jlo = glo / (2 * KB) * (2 * KB), jhi = (ghi + 2 * KB - 1) / (2 * KB) * (2 * KB);
        for (int jb = jlo; jb < jhi; jb += KB) {
            _tile_zero(0);
            _tile_loadd(1, qbuf, D * 2);
            _tile_loadd(2, kp + jb, lp * 4);
            _tile_dpbf16ps(0, 1, 2);
            if (D == 64) {
                _tile_loadd(1, qbuf + 32, D * 2);
                _tile_loadd(2, kp + (int64_t)16 * lp + jb, lp * 4);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, s + jb, lp * 4);
        }
        float inv[16];
        softmax_pairs(16, nq, lo, hi, jlo, jhi, s, lp, scale, pp, inv);
        _tile_zero(4);
        _tile_zero(5);
        if (D == 64) {
            _tile_zero(6);
            _tile_zero(7);
        }
        for (int jb = jlo; jb < jhi; jb += 2 * KB) {
            _tile_loadd(0, pp + jb, lp * 2);
            const uint32_t *vb = vp + (int64_t)(jb / 2) * D;
            _tile_loadd(1, vb, D * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_loadd(2, vb + 16, D * 4);
            _tile_dpbf16ps(5, 0, 2);
            if (D == 64) {
                _tile_loadd(1, vb + 32, D * 4);
                _tile_dpbf16ps(6, 0, 1);
                _tile_loadd(2, vb + 48, D * 4);
                _tile_dpbf16ps(7, 0, 2);
            }
        }
        _tile_stored(4, o, D * 4);
        _tile_stored(5, o + 16, D * 4);
        if (D == 64) {
            _tile_stored(6, o + 32, D * 4);
            _tile_stored(7, o + 48, D * 4);
        }
        for (int r = 0; r < nq; r++) store_row(out + (int64_t)(i0 + r) * ot * 2, o + r * D, inv[r], D, 1);
    }
}
#endif

#ifdef HAVE_BF16_DOT
/* bfloat16 at head sizes that are multiples of 32 on CPUs with AVX512-BF16: the same staging, weights and
 * rounding as the tile path, with both products as vdpbf16ps (16 float32 sums of bf16 pairs per
 * instruction, twice the multiply-adds of a float32 FMA): R <= QB queries at a time, each a 32-bit pair of
 * its elements broadcast against 32 keys (scores, 2 R accumulators) or 32 output columns (values). */
typedef __m512bh bf16x32;

static inline bf16x32 pairs_at(const uint32_t *p) { return (bf16x32)_mm512_loadu_si512(p); }
static inline bf16x32 pair_splat(uint32_t x) { return (bf16x32)_mm512_set1_epi32((int)x); }

/* s[r][jb .. jb + 16 NB) = sum_d q[r][d] k[jb + u][d], unscaled; NB (1 or 2) blocks of 16 keys. */
static inline __attribute__((always_inline)) void scores_dot(int R, int NB, int D, const uint16_t *qbuf,
                                                             const uint32_t *kp, int lp, int jb, float *s) {
    const uint32_t *q32 = (const uint32_t *)qbuf;
    __m512 a[2][QB];
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < R; r++) a[b][r] = _mm512_setzero_ps();
    for (int d = 0; d < D / 2; d++) {
        bf16x32 kk[2];
        for (int b = 0; b < NB; b++) kk[b] = pairs_at(kp + (int64_t)d * lp + jb + b * KB);
        for (int r = 0; r < R; r++) {
            const bf16x32 qq = pair_splat(q32[r * (D / 2) + d]);
            for (int b = 0; b < NB; b++) a[b][r] = _mm512_dpbf16_ps(a[b][r], kk[b], qq);
        }
    }
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(s + (int64_t)r * lp + jb + b * KB, a[b][r]);
}

/* o[r][c] = sum_j p[r][j] v[j][c] over keys [jlo, jhi) (even bounds), unnormalized. */
static inline __attribute__((always_inline)) void values_dot(int R, int D, const uint16_t *pp, int lp,
                                                             const uint32_t *vp, int jlo, int jhi, float *o) {
    for (int c = 0; c < D; c += 2 * KB) {
        __m512 a0[QB], a1[QB];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
        for (int j = jlo; j < jhi; j += 2) {
            const uint32_t *vrow = vp + (int64_t)(j / 2) * D + c;
            const bf16x32 v0 = pairs_at(vrow), v1 = pairs_at(vrow + KB);
            for (int r = 0; r < R; r++) {
                uint32_t w;
                memcpy(&w, pp + (int64_t)r * lp + j, 4);
                const bf16x32 ww = pair_splat(w);
                a0[r] = _mm512_dpbf16_ps(a0[r], v0, ww);
                a1[r] = _mm512_dpbf16_ps(a1[r], v1, ww);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm512_storeu_ps(o + r * D + c, a0[r]);
            _mm512_storeu_ps(o + r * D + c + KB, a1[r]);
        }
    }
}

static inline __attribute__((always_inline)) void query_block_dot(int R, int D, int L, int i0, int nq, const char *q,
                                                                  int64_t qt, char *out, int64_t ot, float scale,
                                                                  int causal, int window, const uint32_t *kp,
                                                                  const uint32_t *vp, int lp, float *s, uint16_t *pp,
                                                                  uint16_t *qbuf, float *o) {
    int lo[QB], hi[QB];
    int glo = L, ghi = 0;
    gather_queries(R, D, L, i0, nq, q, qt, causal, window, qbuf, lo, hi, &glo, &ghi);
    /* Scores over 32 keys at a time from a multiple of 32, the last 16 alone where the keys end there; the
     * weights to an even end (a short sequence's padding is neither scored nor weighed). */
    const int jlo = glo / (2 * KB) * (2 * KB), jend = (ghi + 1) / 2 * 2;
    for (int jb = jlo; jb < ghi; jb += 2 * KB) {
        if (jb + KB < ghi)
            scores_dot(R, 2, D, qbuf, kp, lp, jb, s);
        else
            scores_dot(R, 1, D, qbuf, kp, lp, jb, s);
    }
    float inv[QB];
    softmax_pairs(R, nq, lo, hi, jlo, jend, s, lp, scale, pp, inv);
    values_dot(R, D, pp, lp, vp, jlo, jend, o);
    for (int r = 0; r < nq; r++) store_row(out + (int64_t)(i0 + r) * ot * 2, o + r * D, inv[r], D, 1);
}

static inline __attribute__((always_inline)) void attend_one_dot(int D, int L, const char *q, int64_t qt,
                                                                 const char *k, int64_t kts, const char *v,
                                                                 int64_t vt, char *out, int64_t ot, float scale,
                                                                 int causal, int window, uint32_t *kp,
                                                                 uint32_t *vp, float *s, uint16_t *pp,
                                                                 uint16_t *qbuf, float *o) {
    const int lp = (L + 2 * KB - 1) / (2 * KB) * (2 * KB);
    stage_pairs(D, L, lp, k, kts, v, vt, kp, vp);
    for (int i0 = 0; i0 < L; i0 += QB) {
        const int nq = L - i0 < QB ? L - i0 : QB;
        /* A short last block (short sequences end in one) in half the rows: less work thrown away. */
        if (nq <= QB / 2)
            query_block_dot(QB / 2, D, L, i0, nq, q, qt, out, ot, scale, causal, window, kp, vp, lp, s, pp, qbuf, o);
        else
            query_block_dot(QB, D, L, i0, nq, q, qt, out, ot, scale, causal, window, kp, vp, lp, s, pp, qbuf, o);
    }
}

/* EMBED_CPU_BF16_DOT=0 keeps the float32 path (tests compare both; read per call, it is one getenv). */
static int bf16_dot_disabled(void) {
    const char *flag = getenv("EMBED_CPU_BF16_DOT");
    return flag != NULL && flag[0] == '0';
}
#endif

/* Which path a call with this dtype and head size takes: 2 the AMX tiles, 1 the AVX512-BF16 dot products,
 * 0 float32 FMAs. */
int attention_path(int bf16, int D) {
#ifdef HAVE_AMX
    if (bf16 && (D == 32 || D == 64) && amx_permitted() && !amx_disabled()) return 2;
#endif
#ifdef HAVE_BF16_DOT
    if (bf16 && D % 32 == 0 && D <= 256 && !bf16_dot_disabled()) return 1;
#endif
    (void)bf16;
    (void)D;
    return 0;
}

/* Returns 0, or -1 when scratch memory could not be had. */
int varlen_attention(const void *q, const void *k, const void *v, void *out, int bf16, const int32_t *cu_seqlens,
                     int num_seqs, int max_len, int hq, int hkv, int D, int64_t q_t, int64_t q_h, int64_t k_t,
                     int64_t k_h, int64_t v_t, int64_t v_h, int64_t o_t, int64_t o_h, float scale, int causal,
                     int window, int num_threads) {
    const int group = hq / hkv;
    const int64_t items = (int64_t)num_seqs * hq;
    const int lp = (max_len + 2 * KB - 1) / (2 * KB) * (2 * KB);
    const size_t esz = bf16 ? 2 : 4;
    const int dp = (D + KB - 1) / KB * KB;
    const int path = attention_path(bf16, D);
    const int use_amx = path == 2, use_dot = path == 1;
    (void)use_amx;
    (void)use_dot; /* each used only where the CPU has its instructions */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* Room for either path: kt/kp (dp x lp), vf/vp (lp x dp), s (16 x lp), pp (16 x lp bf16), qs/o/qbuf/row. */
        float *scratch = malloc(sizeof(float) * (2 * (size_t)dp * lp + 24 * (size_t)lp + 48 * (size_t)dp));
        if (!scratch) {
            failed = 1;
        } else {
            float *kt = scratch, *vf = kt + (size_t)dp * lp, *s = vf + (size_t)lp * dp, *qs = s + 16 * (size_t)lp;
            float *o = qs + 16 * (size_t)dp, *row = o + 16 * (size_t)dp;
            float *pp = row + dp, *qbuf = pp + 8 * (size_t)lp;
#ifdef HAVE_AMX
            if (use_amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                const int b = (int)(it / hq), h = (int)(it % hq), hk = h / group;
                const int64_t t0 = cu_seqlens[b];
                const int L = cu_seqlens[b + 1] - cu_seqlens[b];
                if (L <= 0) continue;
                const char *qb = (const char *)q + (t0 * q_t + h * q_h) * esz;
                const char *kb = (const char *)k + (t0 * k_t + hk * k_h) * esz;
                const char *vb = (const char *)v + (t0 * v_t + hk * v_h) * esz;
                char *ob = (char *)out + (t0 * o_t + h * o_h) * esz;
                /* The common head sizes and dtypes as constants, so the compiler unrolls and keeps rows in
                 * registers; anything else through the general path. */
#define ATTEND(DD, BF) attend_one(DD, DD, BF, L, qb, q_t, kb, k_t, vb, v_t, ob, o_t, scale, causal, window, kt, vf, s, qs, o, row)
#ifdef HAVE_AMX
#define ATTEND_AMX(DD) attend_one_amx(DD, L, qb, q_t, kb, k_t, vb, v_t, ob, o_t, scale, causal, window, (uint32_t *)kt, (uint32_t *)vf, s, (uint16_t *)pp, (uint16_t *)qbuf, o)
                if (use_amx && D == 32) ATTEND_AMX(32);
                else if (use_amx && D == 64) ATTEND_AMX(64);
                else
#undef ATTEND_AMX
#endif
#ifdef HAVE_BF16_DOT
#define ATTEND_DOT(DD) attend_one_dot(DD, L, qb, q_t, kb, k_t, vb, v_t, ob, o_t, scale, causal, window, (uint32_t *)kt, (uint32_t *)vf, s, (uint16_t *)pp, (uint16_t *)qbuf, o)
                if (use_dot && D == 32) ATTEND_DOT(32);
                else if (use_dot && D == 64) ATTEND_DOT(64);
                else if (use_dot) ATTEND_DOT(D);
                else
#undef ATTEND_DOT
#endif
                if (D == 32 && bf16) ATTEND(32, 1);
                else if (D == 32) ATTEND(32, 0);
                else if (D == 64 && bf16) ATTEND(64, 1);
                else if (D == 64) ATTEND(64, 0);
                else if (D == 128 && bf16) ATTEND(128, 1);
                else if (D == 128) ATTEND(128, 0);
                else attend_one(D, dp, bf16, L, qb, q_t, kb, k_t, vb, v_t, ob, o_t, scale, causal, window, kt, vf, s, qs, o, row);
#undef ATTEND
            }
#ifdef HAVE_AMX
            if (use_amx) _tile_release();
#endif
            free(scratch);
        }
    }
    return failed ? -1 : 0;
}

/* A bfloat16 linear layer at few rows (a short sequence's tokens, a batch of short queries), on the tile unit
 * where the CPU has AMX (1 to 16 rows), else as AVX512-BF16 dot products where it has those (1 to 256):
 * out (M, N) = x (M, K) @ W^T + bias, x row-major with row stride K, W packed as wp[N/16][K/32][16][16][2]
 * (for 16 output columns and 32 inputs: 16 pairs of inputs, each pair's two weights side by side per column,
 * the layout the tile unit multiplies; read as 32-bit pairs, wp[N/16][K/2][16], the layout vdpbf16ps
 * multiplies too). oneDNN's matmul at these rows reads its packed weights at a quarter to a half of what one
 * thread can read (docs/performance.md, "Small batches"); here each weight is loaded once per call (per 6
 * rows on the dot path, from the core's cache after the first), into four blocks of 16 columns at a time.
 * Accumulation in float32 in the order of K; bias added in float32; with `gelu`, exact (erf) GELU on the
 * float32 sum (erf to ~1e-7, Abramowitz and Stegun 7.1.26, as oneDNN's gelu_erf post-op); out bfloat16,
 * rounded to nearest even. Returns 0, or -2 where neither can be used (not built with them, AMX not
 * permitted, EMBED_CPU_AMX=0 and EMBED_CPU_BF16_DOT=0, or a shape it does not take: more rows than
 * small_linear_rows(), N % 16, K % 32). Where the CPU has AMX the dot products are not used (the tiles'
 * matmul, oneDNN's past 16 rows, is several times faster). */
#define SMALL_TILE_ROWS 16 /* one tile: a short query's tokens */
/* As dot products: as fast as oneDNN's matmul or faster at every count measured up to 4,096 rows (one and
 * two threads), and a batch it serves needs no padding to one of oneDNN's shapes (docs/performance.md). */
#define SMALL_DOT_ROWS 4096

/* The most rows small_linear takes here: 16 on the tile unit, 4,096 as dot products, 0 where neither runs. */
int small_linear_rows(void) {
#ifdef HAVE_AMX
    if (amx_permitted() && !amx_disabled()) return SMALL_TILE_ROWS;
#endif
#ifdef HAVE_BF16_DOT
    if (!bf16_dot_disabled()) return SMALL_DOT_ROWS;
#endif
    return 0;
}

static inline float gelu_erf(float v) {
    const float z = fabsf(v) * 0.70710678118654752f;
    const float t = 1.0f / (1.0f + 0.3275911f * z);
    const float poly =
        t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    const float q = poly * expf(-z * z); /* erfc(|v| / sqrt 2), without 1 - erf's cancellation */
    return v >= 0.0f ? v * (1.0f - 0.5f * q) : 0.5f * v * q;
}

#if defined(HAVE_AMX) || defined(HAVE_BF16_DOT)
/* gelu_erf, 16 at a time (the same approximation; its e^-z^2 by exp16). */
static inline __m512 gelu16(__m512 v) {
    const __m512 z = _mm512_mul_ps(_mm512_abs_ps(v), _mm512_set1_ps(0.70710678118654752f));
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.0f)));
    __m512 poly = _mm512_set1_ps(1.061405429f);
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-1.453152027f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(1.421413741f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-0.284496736f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(0.254829592f));
    poly = _mm512_mul_ps(poly, t);
    const __m512 q = _mm512_mul_ps(poly, exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), z)));
    const __m512 half_vq = _mm512_mul_ps(_mm512_mul_ps(v, q), _mm512_set1_ps(0.5f));
    const __mmask16 positive = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);
    return _mm512_mask_sub_ps(half_vq, positive, v, half_vq); /* v (1 - q / 2) where v >= 0, v q / 2 elsewhere */
}

/* The float32 sums c[j][r * 16 + i] of column blocks n0 .. n0 + cnt, rows 0 .. M: bias, GELU with `gelu`,
 * rounded to bf16 (nearest even) into out (row stride N). */
static void finish_rows(float c[4][256], int cnt, int n0, int M, const uint16_t *bias, int gelu, uint16_t *out,
                        int N) {
    for (int j = 0; j < cnt; j++) {
        const int col = (n0 + j) * 16;
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + col))), 16))
                              : _mm512_setzero_ps();
        for (int r = 0; r < M; r++) {
            __m512 v = _mm512_add_ps(_mm512_load_ps(c[j] + r * 16), b);
            if (gelu) v = gelu16(v);
            _mm256_storeu_si256((__m256i *)(out + (int64_t)r * N + col), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}
#endif

#ifdef HAVE_AMX
static void small_linear_amx(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, int gelu,
                             int M, int K, int N, int num_threads) {
    const int nb = N / 16, kb = K / 32;
    const int64_t step = (int64_t)kb * 512; /* elements between two column blocks' weights */
#pragma omp parallel num_threads(num_threads)
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        for (int t = 0; t < 5; t++) { /* 0-3: accumulators, 4: x; M rows each */
            cfg.rows[t] = (uint8_t)M;
            cfg.colsb[t] = 64;
        }
        for (int t = 5; t < 8; t++) { /* weights: 16 pairs of rows x 16 columns */
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int g = 0; g < (nb + 3) / 4; g++) {
            const int n0 = g * 4, cnt = nb - n0 < 4 ? nb - n0 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int k = 0; k < kb; k++) {
                const uint16_t *b = wp + ((int64_t)n0 * kb + k) * 512;
                _tile_loadd(4, x + k * 32, K * 2);
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (cnt > 1) {
                    _tile_loadd(6, b + step, 64);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (cnt > 2) {
                    _tile_loadd(7, b + 2 * step, 64);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (cnt > 3) {
                    _tile_loadd(5, b + 3 * step, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, c[0], 64);
            if (cnt > 1) _tile_stored(1, c[1], 64);
            if (cnt > 2) _tile_stored(2, c[2], 64);
            if (cnt > 3) _tile_stored(3, c[3], 64);
            finish_rows(c, cnt, n0, M, bias, gelu, out, N);
        }
        _tile_release();
    }
}
#endif

#ifdef HAVE_BF16_DOT
/* Rows [0, R) of x (R <= 6) against cnt <= 4 blocks of 16 columns (weights w, the next block `step` pairs
 * on): the float32 sums into c[j][(r0 + r) * 16 + i]. */
static inline __attribute__((always_inline)) void rows_dot(int R, int cnt, const uint16_t *x, int K,
                                                           const uint32_t *w, int64_t step, float c[4][256],
                                                           int r0) {
    const uint32_t *x32 = (const uint32_t *)x;
    __m512 a[4][6];
    for (int j = 0; j < cnt; j++)
        for (int r = 0; r < R; r++) a[j][r] = _mm512_setzero_ps();
    for (int k = 0; k < K / 2; k++) {
        bf16x32 wv[4];
        for (int j = 0; j < cnt; j++) wv[j] = pairs_at(w + j * step + (int64_t)k * 16);
        for (int r = 0; r < R; r++) {
            const bf16x32 xx = pair_splat(x32[(int64_t)r * (K / 2) + k]);
            for (int j = 0; j < cnt; j++) a[j][r] = _mm512_dpbf16_ps(a[j][r], wv[j], xx);
        }
    }
    for (int j = 0; j < cnt; j++)
        for (int r = 0; r < R; r++) _mm512_store_ps(c[j] + (r0 + r) * 16, a[j][r]);
}

static void small_linear_dot(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, int gelu,
                             int M, int K, int N, int num_threads) {
    const int nb = N / 16;
    const int64_t step = (int64_t)(K / 2) * 16; /* pairs between two column blocks' weights */
    const uint32_t *w32 = (const uint32_t *)wp;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int g = 0; g < (nb + 3) / 4; g++) {
        float c[4][256] __attribute__((aligned(64)));
        const int n0 = g * 4, cnt = nb - n0 < 4 ? nb - n0 : 4;
        const uint32_t *w = w32 + n0 * step;
        for (int m0 = 0; m0 < M; m0 += 16) { /* 16 rows at a time into c, the group's weights in cache */
            const int rows = M - m0 < 16 ? M - m0 : 16;
            for (int r0 = 0; r0 < rows; r0 += 6) {
                const uint16_t *xr = x + (int64_t)(m0 + r0) * K;
                const int R = rows - r0 < 6 ? rows - r0 : 6;
                /* the usual shapes with their counts as constants: every sum stays in a register */
                if (cnt == 4 && R == 6) rows_dot(6, 4, xr, K, w, step, c, r0);
                else if (cnt == 4 && R == 4) rows_dot(4, 4, xr, K, w, step, c, r0);
                else if (cnt == 4 && R == 2) rows_dot(2, 4, xr, K, w, step, c, r0);
                else if (cnt == 4 && R == 1) rows_dot(1, 4, xr, K, w, step, c, r0);
                else rows_dot(R, cnt, xr, K, w, step, c, r0);
            }
            finish_rows(c, cnt, n0, rows, bias, gelu, out + (int64_t)m0 * N, N);
        }
    }
}
#endif

int small_linear(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, int gelu, int M, int K,
                 int N, int num_threads) {
    const int rows = small_linear_rows();
    if (M < 1 || M > rows || N % 16 || K % 32) return -2;
#ifdef HAVE_AMX
    if (rows == SMALL_TILE_ROWS) {
        small_linear_amx(x, wp, bias, out, gelu, M, K, N, num_threads);
        return 0;
    }
#endif
#ifdef HAVE_BF16_DOT
    small_linear_dot(x, wp, bias, out, gelu, M, K, N, num_threads);
    return 0;
#endif
    (void)x, (void)wp, (void)bias, (void)out, (void)gelu, (void)num_threads;
    return -2;
}

int quantize_rows(const void *x, int bf16, int64_t M, int K, int8_t *q, float *scale, int32_t *zero,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < M; r++) {
        float row[K];
        load_row(row, bf16 ? (const void *)((const uint16_t *)x + r * K) : (const void *)((const float *)x + r * K),
                 K, bf16);
        float lo = 0.0f, hi = 0.0f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
        for (int k = 0; k < K; k++) {
            lo = fminf(lo, row[k]);
            hi = fmaxf(hi, row[k]);
        }
        const float s = (hi - lo) / 255.0f;
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        const float z = fminf(255.0f, fmaxf(0.0f, rintf(-lo * inv)));
        scale[r] = s;
        zero[r] = (int32_t)z - 128;
        int8_t *out = q + r * K;
#pragma omp simd
        for (int k = 0; k < K; k++) out[k] = (int8_t)(fmaxf(0.0f, fminf(255.0f, rintf(row[k] * inv) + z)) - 128.0f);
    }
    return 0;
}

int dequantize_rows(const int32_t *acc, int64_t M, int N, const float *row_scale, const int32_t *row_zero,
                    const float *col_scale, const int32_t *col_sum, const void *bias, int gelu, void *out,
                    int bf16, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *b = malloc(2 * (size_t)N * sizeof(float)), *v = b + N;
        if (b == NULL) failed = 1;
        for (int n = 0; b != NULL && n < N; n++)
            b[n] = bias == NULL ? 0.0f : bf16 ? bf16_to_float(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            if (b == NULL) continue;
            const int32_t *a = acc + r * N;
            const float s = row_scale[r];
            const int32_t z = row_zero[r];
#pragma omp simd
            for (int n = 0; n < N; n++) v[n] = (float)(a[n] - z * col_sum[n]) * s * col_scale[n] + b[n];
            if (gelu) {
#pragma omp simd
                for (int n = 0; n < N; n++) v[n] = gelu_erf(v[n]);
            }
            if (bf16) {
                uint16_t *o = (uint16_t *)out + r * N;
#pragma omp simd
                for (int n = 0; n < N; n++) o[n] = float_to_bf16(v[n]);
            } else {
                memcpy((float *)out + r * N, v, (size_t)N * sizeof(float));
            }
        }
        free(b);
    }
    return failed ? -1 : 0;
}
