/* bfloat16 <-> float32 for the project's CPU kernels (varlen_attention.c, decoder_ops.c). */
#ifndef EMBED_BF16_H
#define EMBED_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) { /* exact */
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even (finite inputs) */
    return (uint16_t)(u >> 16);
}
#endif
