/* The elementwise ops of a decoder block in bfloat16 on the CPU, each one pass over a row.
 *
 * Why: torch runs each of them as several kernels with a (T, n) intermediate each (a float32 copy, the
 * halves' concatenation, the products, the cast back), which at a small decoder's widths costs as much per
 * layer as a tenth of its matmuls. Here each row is read once and written once, in float32 between the bf16
 * loads and stores, rounded to bf16 where transformers' reference (torch in bf16) rounds:
 *
 * - silu_mul_rows: SwiGLU's act(gate) * up on the merged [gate | up] projection; silu rounded to bf16, then
 *   the product (torch's F.silu(gate) * up).
 * - rotary_rows: rotary position embeddings applied in place, x * cos + rotate_half(x) * sin in float32
 *   (transformers' apply_rotary_pos_emb on x.float()), through the strides of q or k in the qkv output.
 * - rms_norm_rows: Llama's RMSNorm after the residual add: the sum rounded to bf16 (torch's x + residual),
 *   normalized in float32, rounded, then scaled by the bf16 weight and rounded again.
 *
 * The results match the reference to the rounding of one float32 operation before each bf16 rounding (the
 * order of a row's sum of squares, a fused multiply-add, the exponential's last bit): an output differs by
 * one bf16 step at most, where the float32 value falls next to a rounding boundary.
 * Strides and sizes in elements; rows split between `threads` OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* e^x for x <= 88: 2^n e^f with |f| <= ln(2) / 2, the Taylor polynomial to f^6 (relative error ~2e-7), 2^n
 * built in the exponent bits. Written so that the compiler vectorizes the loops it is inlined into. */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float f = x - n * 0.693359375f;
    f = f - n * -2.12194440e-4f;
    float p = 1.f / 720;
    p = p * f + 1.f / 120;
    p = p * f + 1.f / 24;
    p = p * f + 1.f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* x / (1 + e^-x), as torch computes it. Below x = -88 the quotient is -0 (torch's is -0 past e^88.7 = inf,
 * and under 1e-36 between): from its bits, which -ffast-math's arithmetic would not keep. */
static inline float silu(float x) {
    const uint32_t minus_zero_bits = 0x80000000u;
    float minus_zero;
    memcpy(&minus_zero, &minus_zero_bits, 4);
    const float e = exp_f32(x < -88.f ? 88.f : -x);
    return x < -88.f ? minus_zero : x / (1.f + e);
}

/* x (rows, 2n) with row stride ldx: gate x[:, :n], up x[:, n:] -> out (rows, n) contiguous. */
void silu_mul_rows(const uint16_t *x, int64_t rows, int64_t n, int64_t ldx, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * ldx, *u = g + n;
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float a = bf16_to_float(float_to_bf16(silu(bf16_to_float(g[i]))));
            o[i] = float_to_bf16(a * bf16_to_float(u[i]));
        }
    }
}

/* x (T, H, D), strides st and sh (D contiguous), rotated in place by cos, sin (T, D) float32 contiguous. */
void rotary_rows(uint16_t *x, int64_t tokens, int heads, int dim, int64_t st, int64_t sh, const float *cos_,
                 const float *sin_, int threads) {
    const int half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_ + t * dim, *s = sin_ + t * dim;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + t * st + h * sh;
            for (int i = 0; i < half; i++) {
                const float a = bf16_to_float(v[i]), b = bf16_to_float(v[i + half]);
                v[i] = float_to_bf16(a * c[i] - b * s[i]);
                v[i + half] = float_to_bf16(b * c[i + half] + a * s[i + half]);
            }
        }
    }
}

/* x (rows, n) contiguous, plus residual (same shape) when not NULL, the sum into summed; then
 * out = weight * bf16(h / sqrt(mean(h^2) + eps)). */
void rms_norm_rows(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, float eps, int64_t rows,
                   int64_t n, uint16_t *out, uint16_t *summed, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *h = x + r * n;
        if (residual) {
            uint16_t *sr = summed + r * n;
            const uint16_t *res = residual + r * n;
            for (int64_t i = 0; i < n; i++) sr[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(res[i]));
            h = sr;
        }
        float ss = 0.f;
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_to_float(h[i]);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float y = bf16_to_float(float_to_bf16(bf16_to_float(h[i]) * inv));
            o[i] = float_to_bf16(bf16_to_float(weight[i]) * y);
        }
    }
}
