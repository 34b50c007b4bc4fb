/* GGUF weight-only matmuls on CPU: float32 activations x packed Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K /
 * Q5_K / Q6_K weights.
 *
 * Built at first use by trillium/kernels/gguf_cpu.py (the system C compiler, -O3 -march=native,
 * -ffp-contract=fast, OpenMP; no torch headers, so it builds in about a second) and called through ctypes.
 *
 * Weights stay in llama.cpp's own block layout, one row per output channel:
 *
 *   row n: [block 0][block 1] ... [block K/32 - 1]      every block covers 32 inputs (K-quants: 256)
 *   Q8_0 block (34 B): fp16 d | int8 q[32]               w[j] = d * q[j]
 *   Q4_0 block (18 B): fp16 d | uint8 qs[16]             w[j] = d * ((qs[j] & 15) - 8), w[j+16] = d * ((qs[j] >> 4) - 8)
 *   Q4_1 block (20 B): fp16 d | fp16 m | uint8 qs[16]    w[j] = d * (qs[j] & 15) + m,    w[j+16] = d * (qs[j] >> 4) + m
 *   Q5_0 block (22 B): fp16 d | uint32 qh | qs[16]    as Q4_0, bit j of qh the 5th bit of q[j] (j < 32), minus 16
 *   Q5_1 block (24 B): fp16 d | fp16 m | uint32 qh | qs[16]   as Q4_1 with the same 5th bits (block_q5_0 / block_q5_1)
 *
 * K-quant super-blocks cover 256 inputs, as 8 sub-blocks of 32 (ggml/src/ggml-common.h block_q4_K,
 * block_q5_K, block_q6_K; values as ggml/src/ggml-quants.c dequantize_row_q{4,5,6}_K):
 *
 *   Q4_K (144 B): fp16 d | fp16 dmin | scales[12] | qs[128]
 *       sub-block s (0..7): 6-bit sc[s], m[s] from scales (get_scale_min_k4: s < 4: scales[s] & 63,
 *       scales[s+4] & 63; else the low / high nibble of scales[s+4] with the top 2 bits of scales[s-4] /
 *       scales[s]); q[l] = nibble (s & 1 ? high : low) of qs[32 * (s / 2) + l];
 *       w = (d * sc[s]) * q - dmin * m[s]
 *   Q5_K (176 B): fp16 d | fp16 dmin | scales[12] | qh[32] | qs[128]     as Q4_K, q[l] |= bit s of qh[l] << 4
 *   Q6_K (210 B): ql[128] | qh[64] | int8 scales[16] | fp16 d
 *       sub-block s: half h = s / 4, quarter t = s % 4; q[l] = ((ql[64h + 32(t & 1) + l] >> 4(t / 2)) & 15)
 *       | ((qh[32h + l] >> 2t) & 3) << 4, minus 32; w = (d * scales[8h + 2t + l / 16]) * q
 *
 * WHY exact: each block is widened to the float32 values gguf.quants.dequantize
 * produces (bit for bit: d * q is exact in float32, so Q4_1's fused d * q + m
 * rounds once, as numpy's; for the K-quants d * sc (11 + 6 or 7 bits) times q
 * (4-6 bits, at most 23 bits in all) is exact too, so the fused
 * (d * sc) * q - dmin * m rounds once), in registers, and multiplied there;
 * nothing is requantized (llama.cpp's CPU path quantizes the activations to
 * Q8_K blocks for its integer dot products; here they stay float32), so the result
 * is the dequantize-then-matmul result up to float32 summation order. Only the
 * weights' bytes cross the memory bus.
 *
 * AVX-512 and AVX2+FMA paths (intrinsics, picked by -march=native), else plain loops.
 * K-quants: a super-block's scales are unpacked once (kquant_scales), then the sub-blocks that share
 * bytes are decoded together (decode_unit), in a loop unrolled so every shift is a constant.
 *
 * Layout of the work: output channels are split across threads; each thread walks
 * its rows once per tile of TILE_M activation rows, keeping a 32-lane accumulator
 * per activation row (reduced once per output), so a decoded block serves the
 * whole tile.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q5_K = 13,
       TYPE_Q6_K = 14 };
#define IS_Q5(type) ((type) == TYPE_Q5_0 || (type) == TYPE_Q5_1)
/* Inputs per decoded block: a whole Q8_0 / Q4_0 / Q4_1 block, one sub-block of a K-quant super-block. */
#define QK 32
#define IS_KQUANT(type) ((type) == TYPE_Q4_K || (type) == TYPE_Q5_K || (type) == TYPE_Q6_K)
/* Activation rows per pass over the weights: their accumulators stay in registers. */
#if defined(__AVX512F__) || !defined(__AVX2__)
#define TILE_M 8
#else
#define TILE_M 4
#endif

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {  /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t read_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static long block_bytes(int type) {
    switch (type) {
        case TYPE_Q8_0: return 2 + QK;
        case TYPE_Q4_0: return 2 + QK / 2;
        case TYPE_Q4_1: return 4 + QK / 2;
        case TYPE_Q5_0: return 6 + QK / 2;
        case TYPE_Q5_1: return 8 + QK / 2;
        case TYPE_Q4_K: return 144;
        case TYPE_Q5_K: return 176;
        case TYPE_Q6_K: return 210;
        default: return 0;
    }
}

/* 32-input sub-blocks per stored block: 8 for the 256-input K-quant super-blocks, else 1. */
static inline int sub_blocks(int type) { return IS_KQUANT(type) ? 8 : 1; }

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block s (ggml-quants.c get_scale_min_k4). */
static inline void scale_min_k4(int s, const uint8_t *q, int *sc, int *m) {
    if (s < 4) {
        *sc = q[s] & 63;
        *m = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
        *m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

/* A K-quant super-block's multipliers and offsets per 16 inputs: w = mul[i / 16] * q + add[i / 16].
 * Q4_K / Q5_K: d * sc[s] and -(dmin * m[s]) for both halves of sub-block s; Q6_K: d * scales[g], add 0.
 * All exact in float32. WHY once per super-block: the scale unpacking is scalar work that would
 * otherwise repeat for every activation tile and sub-block. */
static inline void kquant_scales(int type, const uint8_t *blk, float *restrict mul, float *restrict add) {
    if (type == TYPE_Q6_K) {
        const float d = half_to_float(read_u16(blk + 208));
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int g = 0; g < 16; g++) {
            mul[g] = d * (float)sc[g];
            add[g] = 0.0f;
        }
        return;
    }
    const float d = half_to_float(read_u16(blk)), dmin = half_to_float(read_u16(blk + 2));
    for (int s = 0; s < 8; s++) {
        int sc, m;
        scale_min_k4(s, blk + 4, &sc, &m);
        mul[2 * s] = mul[2 * s + 1] = d * (float)sc;
        add[2 * s] = add[2 * s + 1] = -(dmin * (float)m);
    }
}

/* A block's 32 integer codes in input order (Q4 / Q5 unsigned, Q8_0 signed): the plain-C paths
 * (decode_block, qdot_block). */
static inline void block_codes_int(int type, const uint8_t *blk, int *c) {
    if (type == TYPE_Q8_0) {
        for (int j = 0; j < QK; j++) c[j] = ((const int8_t *)(blk + 2))[j];
        return;
    }
    const int off = type == TYPE_Q4_0 ? 2 : type == TYPE_Q4_1 ? 4 : type == TYPE_Q5_0 ? 6 : 8;
    const uint32_t qh = IS_Q5(type) ? read_u32(blk + off - 4) : 0;
    for (int j = 0; j < QK / 2; j++) {
        c[j] = (blk[off + j] & 15) | (int)((qh >> j) & 1) << 4;
        c[j + QK / 2] = (blk[off + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
    }
}

/* The 32 float32 weights of one block, or of sub-block s of a K-quant super-block (mul / add: its two
 * 16-input groups' entries from kquant_scales). */
static inline __attribute__((always_inline)) void decode_block(int type, const uint8_t *blk, int s,
                                                               const float *mul, const float *add,
                                                               float *restrict w) {
    if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
        const uint8_t *qs = blk + (type == TYPE_Q4_K ? 16 : 48) + 32 * (s >> 1), *qh = blk + 16;
        const int shift = 4 * (s & 1);
        for (int l = 0; l < QK; l++) {
            int q = (qs[l] >> shift) & 15;
            if (type == TYPE_Q5_K) q |= ((qh[l] >> s) & 1) << 4;
            w[l] = mul[l >> 4] * (float)q + add[l >> 4];
        }
    } else if (type == TYPE_Q6_K) {
        const int h = s >> 2, t = s & 3, lshift = 4 * (t >> 1), hshift = 2 * t;
        const uint8_t *ql = blk + 64 * h + 32 * (t & 1), *qh = blk + 128 + 32 * h;
        for (int l = 0; l < QK; l++) {
            const int q = (((ql[l] >> lshift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32;
            w[l] = mul[l >> 4] * (float)q;
        }
    } else {  /* the legacy formats' integer codes, then w = (c - bias) * d (exact) or d * c + m (one rounding,
               * as numpy) */
        int c[QK];
        block_codes_int(type, blk, c);
        const float d = half_to_float(read_u16(blk));
        if (type == TYPE_Q4_1 || type == TYPE_Q5_1) {
            const float m = half_to_float(read_u16(blk + 2));
            for (int j = 0; j < QK; j++) w[j] = d * (float)c[j] + m;
        } else {
            const int bias = type == TYPE_Q4_0 ? 8 : type == TYPE_Q5_0 ? 16 : 0;
            for (int j = 0; j < QK; j++) w[j] = d * (float)(c[j] - bias);
        }
    }
}

#if defined(__AVX2__) || defined(__AVX512F__)
/* Q5_0 / Q5_1: the 5-bit codes of a block as bytes, inputs 0..15 in *lo, 16..31 in *hi. Bit j of qh goes to
 * bit 4 of byte j (llama.cpp's bytes_from_bits habit: broadcast, test one bit per byte, keep 0x10). */
static inline void q5_bytes(const uint8_t *blk, int off, __m128i *lo, __m128i *hi) {
    const uint32_t qh = read_u32(blk + off);
    const __m128i pick = _mm_set_epi64x(0x0101010101010101LL, 0);
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    const __m128i m15 = _mm_set1_epi8(15), b4 = _mm_set1_epi8(0x10);
    const __m128i hl = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(qh & 0xffff)), pick);
    const __m128i hh = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(qh >> 16)), pick);
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + off + 4));
    *lo = _mm_or_si128(_mm_and_si128(raw, m15), _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hl, bit), bit), b4));
    *hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(raw, 4), m15),
                       _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hh, bit), bit), b4));
}
#endif

#if defined(__AVX512F__)
/* 16 float lanes: a block is 2 vectors. */
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline __m512i load16_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512i bits_at(__m512i v, int shift, int mask) {
    return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask));
}
/* K-quant sub-blocks decoded per call: those sharing the same bytes (Q4_K / Q5_K: the low and high
 * nibbles of 32 bytes; Q6_K: the four quarters of a 128-input half read ql / qh once). */
static inline int decode_unit(int type) { return type == TYPE_Q6_K ? 4 : IS_KQUANT(type) ? 2 : 1; }
/* Sub-blocks s .. s + decode_unit - 1 (2 vectors each; mul / add from their first group on). */
static inline __attribute__((always_inline)) void decode_vec(int type, const uint8_t *blk, int s,
                                                             const float *mul, const float *add, vf *w) {
    if (type == TYPE_Q4_K || type == TYPE_Q5_K) {  /* 16 lanes = one 16-input group */
        const uint8_t *qs = blk + (type == TYPE_Q4_K ? 16 : 48) + 16 * s;
        for (int v = 0; v < 2; v++) {
            const __m512i b = load16_u8(qs + 16 * v);
            __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(b, 4);
            if (type == TYPE_Q5_K) {
                const __m512i h = load16_u8(blk + 16 + 16 * v);
                lo = _mm512_or_si512(lo, _mm512_slli_epi32(bits_at(h, s, 1), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi32(bits_at(h, s + 1, 1), 4));
            }
            w[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(mul[v]), _mm512_set1_ps(add[v]));
            w[2 + v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(mul[2 + v]), _mm512_set1_ps(add[2 + v]));
        }
        return;
    }
    if (type == TYPE_Q6_K) {  /* s = 4h: quarter t of the half takes bits 4 (t / 2) of ql[32 (t & 1) + l] */
        const uint8_t *ql = blk + 16 * s, *qh = blk + 128 + 8 * s;
        const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48);
        for (int v = 0; v < 2; v++) {
            const __m512i a = load16_u8(ql + 16 * v), b = load16_u8(ql + 32 + 16 * v), c = load16_u8(qh + 16 * v);
            /* qh's 2-bit fields already shifted to bits 4-5: (c >> 2t & 3) << 4 == (c << 4 - 2t) & 48 */
            const __m512i q[4] = {
                _mm512_or_si512(_mm512_and_si512(a, m15), _mm512_and_si512(_mm512_slli_epi32(c, 4), m48)),
                _mm512_or_si512(_mm512_and_si512(b, m15), _mm512_and_si512(_mm512_slli_epi32(c, 2), m48)),
                _mm512_or_si512(_mm512_srli_epi32(a, 4), _mm512_and_si512(c, m48)),
                _mm512_or_si512(_mm512_srli_epi32(b, 4), _mm512_and_si512(_mm512_srli_epi32(c, 2), m48)),
            };
            /* (q - 32) * m as q * m - 32 m: both exact, so the fused form rounds as the product does */
            for (int t = 0; t < 4; t++)
                w[2 * t + v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[t]), _mm512_set1_ps(mul[2 * t + v]),
                                               _mm512_set1_ps(-32.0f * mul[2 * t + v]));
        }
        return;
    }
    const __m512 d = _mm512_set1_ps(half_to_float(read_u16(blk)));
    if (IS_Q5(type)) {  /* Q5_0: q * d - 16d (q * d exact: one rounding, as (q - 16) * d); Q5_1: q * d + m */
        __m128i lo, hi;
        q5_bytes(blk, type == TYPE_Q5_0 ? 2 : 4, &lo, &hi);
        const __m512 c = type == TYPE_Q5_0 ? _mm512_set1_ps(-16.0f * half_to_float(read_u16(blk)))
                                           : _mm512_set1_ps(half_to_float(read_u16(blk + 2)));
        w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, c);
        w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, c);
        return;
    }
    if (type == TYPE_Q8_0) {
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))), d);
        return;
    }
    const int off = type == TYPE_Q4_0 ? 2 : 4;
    /* Q4_0: (q - 8) * d as q * d - 8d; Q4_1: q * d + m. q * d is exact (4 x 11 bits), so one rounding, as numpy. */
    const __m512 c = type == TYPE_Q4_0 ? _mm512_set1_ps(-8.0f * half_to_float(read_u16(blk)))
                                       : _mm512_set1_ps(half_to_float(read_u16(blk + 2)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + off)));
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), d, c);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d, c);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 float lanes: a block is 4 vectors. */
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256 widen8(__m128i bytes8, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}
static inline __m128i bytes_at(__m128i v, int shift, int mask) {  /* (byte >> shift) & mask, per byte */
    return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8((char)mask));
}
static inline __m128i load16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
/* K-quant sub-blocks decoded per call (Q4_K / Q5_K: the low and high nibbles of the same 32 bytes;
 * Q6_K one at a time: four at once would need 16 of the 16 ymm registers for the weights alone). */
static inline int decode_unit(int type) { return type == TYPE_Q4_K || type == TYPE_Q5_K ? 2 : 1; }
/* Sub-blocks s .. s + decode_unit - 1 (4 vectors each; mul / add from their first group on). */
static inline __attribute__((always_inline)) void decode_vec(int type, const uint8_t *blk, int s,
                                                             const float *mul, const float *add, vf *w) {
    if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
        const uint8_t *qs = blk + (type == TYPE_Q4_K ? 16 : 48) + 16 * s;
        const __m128i m15 = _mm_set1_epi8(15);
        for (int v = 0; v < 2; v++) {
            const __m128i raw = load16(qs + 16 * v);
            __m128i q[2] = {_mm_and_si128(raw, m15), _mm_and_si128(_mm_srli_epi16(raw, 4), m15)};
            if (type == TYPE_Q5_K) {
                const __m128i h = load16(blk + 16 + 16 * v);
                q[0] = _mm_or_si128(q[0], _mm_slli_epi16(bytes_at(h, s, 1), 4));
                q[1] = _mm_or_si128(q[1], _mm_slli_epi16(bytes_at(h, s + 1, 1), 4));
            }
            for (int u = 0; u < 2; u++) {
                const __m256 dv = _mm256_set1_ps(mul[2 * u + v]), mv = _mm256_set1_ps(add[2 * u + v]);
                w[4 * u + 2 * v] = _mm256_fmadd_ps(widen8(q[u], 0), dv, mv);
                w[4 * u + 2 * v + 1] = _mm256_fmadd_ps(widen8(_mm_srli_si128(q[u], 8), 0), dv, mv);
            }
        }
        return;
    }
    if (type == TYPE_Q6_K) {
        const int h = s >> 2, t = s & 3;
        const uint8_t *ql = blk + 64 * h + 32 * (t & 1), *qh = blk + 128 + 32 * h;
        for (int v = 0; v < 2; v++) {  /* 16 bytes = one 16-input scale group */
            const __m128i hi = _mm_slli_epi16(bytes_at(load16(qh + 16 * v), 2 * t, 3), 4);
            const __m128i q = _mm_sub_epi8(_mm_or_si128(bytes_at(load16(ql + 16 * v), 4 * (t >> 1), 15), hi),
                                           _mm_set1_epi8(32));
            const __m256 dv = _mm256_set1_ps(mul[v]);
            w[2 * v] = _mm256_mul_ps(widen8(q, 1), dv);
            w[2 * v + 1] = _mm256_mul_ps(widen8(_mm_srli_si128(q, 8), 1), dv);
        }
        return;
    }
    const __m256 d = _mm256_set1_ps(half_to_float(read_u16(blk)));
    if (IS_Q5(type)) {  /* as the AVX-512 path */
        __m128i lo, hi;
        q5_bytes(blk, type == TYPE_Q5_0 ? 2 : 4, &lo, &hi);
        const __m256 c = type == TYPE_Q5_0 ? _mm256_set1_ps(-16.0f * half_to_float(read_u16(blk)))
                                           : _mm256_set1_ps(half_to_float(read_u16(blk + 2)));
        w[0] = _mm256_fmadd_ps(widen8(lo, 0), d, c);
        w[1] = _mm256_fmadd_ps(widen8(_mm_srli_si128(lo, 8), 0), d, c);
        w[2] = _mm256_fmadd_ps(widen8(hi, 0), d, c);
        w[3] = _mm256_fmadd_ps(widen8(_mm_srli_si128(hi, 8), 0), d, c);
        return;
    }
    if (type == TYPE_Q8_0) {
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(widen8(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i)), 1), d);
        return;
    }
    const int off = type == TYPE_Q4_0 ? 2 : 4;
    const __m256 c = type == TYPE_Q4_0 ? _mm256_set1_ps(-8.0f * half_to_float(read_u16(blk)))
                                       : _mm256_set1_ps(half_to_float(read_u16(blk + 2)));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + off)), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w[0] = _mm256_fmadd_ps(widen8(lo, 0), d, c);
    w[1] = _mm256_fmadd_ps(widen8(_mm_srli_si128(lo, 8), 0), d, c);
    w[2] = _mm256_fmadd_ps(widen8(hi, 0), d, c);
    w[3] = _mm256_fmadd_ps(widen8(_mm_srli_si128(hi, 8), 0), d, c);
}
#endif

/* One output channel for rows [0, rows) of x (rows <= TILE_M): out[r * ldo] = x[r] . w_row, the row being
 * `nblocks` stored blocks of sub_blocks(type) 32-input sub-blocks each.
 * Always inlined, so each (type, rows) call site below compiles to its own loop nest. */
static inline __attribute__((always_inline)) void dot_rows(int type, const uint8_t *row, long nblocks,
                                                           const float *x, long ldx, long rows, float *out,
                                                           long ldo) {
    const long bb = block_bytes(type);
    const int nsub = sub_blocks(type);
    float mul[16], add[16];  /* K-quants: the current super-block's scales (kquant_scales) */
#ifdef LANES
    enum { NV = QK / LANES };
    const int unit = decode_unit(type);
    vf acc[TILE_M][NV], w[4 * NV];
    for (long r = 0; r < rows; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    for (long b = 0; b < nblocks; b++) {
        const uint8_t *blk = row + b * bb;
        if (IS_KQUANT(type)) kquant_scales(type, blk, mul, add);
        /* WHY unrolled: each sub-block's offsets and shifts become constants. */
#pragma GCC unroll 8
        for (int s = 0; s < nsub; s += unit) {
            decode_vec(type, blk, s, mul + 2 * s, add + 2 * s, w);
            for (long r = 0; r < rows; r++) {
                const float *xb = x + r * ldx + (b * nsub + s) * QK;
                for (int v = 0; v < unit * NV; v++)
                    acc[r][v % NV] = vfma(vload(xb + v * LANES), w[v], acc[r][v % NV]);
            }
        }
    }
    for (long r = 0; r < rows; r++) {
        vf s = acc[r][0];
        for (int v = 1; v < NV; v++) s = vadd(s, acc[r][v]);
        out[r * ldo] = vsum(s);
    }
#else
    float acc[TILE_M][QK];
    float w[QK];
    memset(acc, 0, (size_t)rows * sizeof(acc[0]));
    for (long b = 0; b < nblocks; b++) {
        const uint8_t *blk = row + b * bb;
        if (IS_KQUANT(type)) kquant_scales(type, blk, mul, add);
        for (int s = 0; s < nsub; s++) {
            decode_block(type, blk, s, mul + 2 * s, add + 2 * s, w);
            for (long r = 0; r < rows; r++) {
                const float *xb = x + r * ldx + (b * nsub + s) * QK;
                float *a = acc[r];
                for (int j = 0; j < QK; j++) a[j] += xb[j] * w[j];
            }
        }
    }
    for (long r = 0; r < rows; r++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += acc[r][j];
        out[r * ldo] = s;
    }
#endif
}

/* One kernel per (format, row count 1..TILE_M), each its own function: fixed trip counts keep a tile's
 * accumulators in registers (a variable row count kept them on the stack: 4 rows cost 3x one, where
 * small batches and speculative verify steps land), and WHY noinline: inlined into one dispatch loop,
 * the 64 variants' register allocation slowed the 1-row kernel by ~20%. */
typedef void (*dot_fn)(const uint8_t *row, long nblocks, const float *x, long ldx, float *out, long ldo);
#define DOT_FN(T, R)                                                                                     \
    static __attribute__((noinline)) void dot_##T##_##R(const uint8_t *row, long nblocks, const float *x, \
                                                         long ldx, float *out, long ldo) {               \
        dot_rows(T, row, nblocks, x, ldx, (R) < TILE_M ? (R) : TILE_M, out, ldo);                          \
    }
#define DOT_FNS(T) DOT_FN(T, 1) DOT_FN(T, 2) DOT_FN(T, 3) DOT_FN(T, 4) DOT_FN(T, 5) DOT_FN(T, 6) DOT_FN(T, 7) DOT_FN(T, 8)
DOT_FNS(TYPE_Q8_0) DOT_FNS(TYPE_Q4_0) DOT_FNS(TYPE_Q4_1) DOT_FNS(TYPE_Q5_0) DOT_FNS(TYPE_Q5_1)
DOT_FNS(TYPE_Q4_K) DOT_FNS(TYPE_Q5_K) DOT_FNS(TYPE_Q6_K)
#define DOT_TABLE(T) {dot_##T##_1, dot_##T##_2, dot_##T##_3, dot_##T##_4, dot_##T##_5, dot_##T##_6, dot_##T##_7, dot_##T##_8}

static const dot_fn *dot_table(int type) {
    static const dot_fn q8_0[] = DOT_TABLE(TYPE_Q8_0), q4_0[] = DOT_TABLE(TYPE_Q4_0), q4_1[] = DOT_TABLE(TYPE_Q4_1),
                        q5_0[] = DOT_TABLE(TYPE_Q5_0), q5_1[] = DOT_TABLE(TYPE_Q5_1), q4_k[] = DOT_TABLE(TYPE_Q4_K),
                        q5_k[] = DOT_TABLE(TYPE_Q5_K), q6_k[] = DOT_TABLE(TYPE_Q6_K);
    static const dot_fn *const by_type[] = {[TYPE_Q8_0] = q8_0, [TYPE_Q4_0] = q4_0, [TYPE_Q4_1] = q4_1,
                                            [TYPE_Q5_0] = q5_0, [TYPE_Q5_1] = q5_1, [TYPE_Q4_K] = q4_k,
                                            [TYPE_Q5_K] = q5_k, [TYPE_Q6_K] = q6_k};
    return by_type[type];  /* the caller checked block_bytes(type) */
}

/* out[M, N] = x[M, K] @ W^T with W [N, K] in GGUF blocks (K % 32 == 0; K % 256 == 0 for the K-quants).
 * Returns 0, or -1 for a bad type or K. */
int trillium_gguf_matmul(int type, const float *x, long m, long k, long ldx, const uint8_t *w, long n,
                         float *out, int num_threads) {
    const long bb = block_bytes(type), block_k = QK * sub_blocks(type);
    if (bb == 0 || k % block_k) return -1;
    const long nblocks = k / block_k, row_bytes = nblocks * bb;
    const dot_fn *dots = dot_table(type);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long j = 0; j < n; j++) {
        const uint8_t *row = w + j * row_bytes;
        for (long r0 = 0; r0 < m; r0 += TILE_M) {
            const long rows = m - r0 < TILE_M ? m - r0 : TILE_M;
            dots[rows - 1](row, nblocks, x + r0 * ldx, ldx, out + r0 * n + j, n);
        }
    }
    return 0;
}

/* ---- int8 activations (trillium_gguf_matmul_q8): llama.cpp's integer dot products ----------------------
 *
 * For Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 weights only (the K-quants keep the float path above). Each
 * activation row is quantized in 32-value blocks as llama.cpp's Q8_1 (ggml-quants.c quantize_row_q8_1):
 *
 *   dx = max|x| / 127,  q[j] = rint(x[j] * (1 / dx)) (ties to even; q = 0 when dx = 0),  sx = dx * sum(q)
 *
 * and a weight block (d, m or offset, codes c) times an activation block is
 *
 *   d * dx * sum(c[j] * q[j]) + cw * sx        cw: Q4_1 / Q5_1 m, Q4_0 -8d, Q5_0 -16d, Q8_0 0
 *
 * with sum(c * q) an exact 32-bit integer dot (AVX512-VNNI / AVX-VNNI vpdpbusd, else AVX2 maddubs +
 * madd; unsigned codes times signed q; Q8_0's signed codes through |c| and q * sign(c)).
 * WHY: the float path widens every code to float32 and does two FMAs per weight per row; the integer
 * dot does 32 weights in one instruction, so the weight decode is a shift and a mask. The price is
 * the activations' 8-bit rounding (error ~0.4% of a block's largest value), which llama.cpp's CPU path
 * always pays; bench/gguf_packed_accuracy.py measures it against the float model.
 *
 * Determinism: each output's blocks are summed in order, f = fma(dot, d * dx, f) then (but for Q8_0)
 * f = fma(cw, sx, f), one vector lane per output channel (qdot_rows: 8 weight rows side by side), whatever
 * the row count, the row's place in a tile or the thread count; the many-row GEMM below does the same
 * operations in the same order, so a row's result is the same bits in a decode step, a speculative verify
 * step or a prefill chunk of any size. */
/* Activation rows per pass of the integer path: 8 where AVX-512VL gives 32 vector registers (5-row verify
 * steps 15% faster than with 4, the bench model's 121 SmolLM2 weights, 1 thread), else 4. */
#if defined(__AVX512VL__)
#define Q8_TILE 8
#else
#define Q8_TILE 4
#endif
#define IS_LEGACY(type) ((type) == TYPE_Q8_0 || (type) == TYPE_Q4_0 || (type) == TYPE_Q4_1 || IS_Q5(type))

/* Bytes of one packed row of k weights of `type`: 0 where no kernel takes it (an unknown type, k not whole
 * blocks, or int8 activations for a K-quant). native_ops.cpp checks the blocks it is handed against it. */
long trillium_gguf_row_bytes(int type, long k, int int8) {
    const long bb = block_bytes(type), block_k = QK * sub_blocks(type);
    if (bb == 0 || k <= 0 || k % block_k || (int8 && !IS_LEGACY(type))) return 0;
    return k / block_k * bb;
}

/* Rows of x as int8 blocks q [m, k], scales dx, dx * sum(q) sx and sum(q) sums [m, k / 32]. */
static void quantize_rows_q8(const float *x, long m, long k, long ldx, int8_t *q, float *dx, float *sx,
                             int32_t *sums) {
    const long nb = k / QK;
    for (long r = 0; r < m; r++)
        for (long b = 0; b < nb; b++) {
            const float *v = x + r * ldx + b * QK;
            int8_t *o = q + r * k + b * QK;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) {
                const float a = v[j] < 0 ? -v[j] : v[j];
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int c = (int)__builtin_rintf(v[j] * id);
                o[j] = (int8_t)c;
                sum += c;
            }
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)sum;
            sums[r * nb + b] = sum;
        }
}

/* The int8 paths' quantized activations, in one allocation: q [m, k], dx / sx / sums [m, k / 32]. */
typedef struct {
    void *mem;
    int8_t *q;
    float *dx, *sx;
    int32_t *sums;
} QRows;

/* The int8 entry points' start: -1 for a type without the integer path or a bad K, 1 with no rows (nothing
 * to do), -2 when the buffer cannot be allocated, else 0 with `a` filled (the caller frees a->mem). */
static int qrows_quantize(QRows *a, int type, const float *x, long m, long k, long ldx) {
    if (!IS_LEGACY(type) || k % QK) return -1;
    if (m == 0) return 1;
    const long nb = k / QK;
    const size_t q_bytes = ((size_t)(m * k) + 63) / 64 * 64;  /* q first, on a cache line, as malloc'd alone */
    const size_t bytes = q_bytes + (size_t)(m * nb) * (2 * sizeof(float) + sizeof(int32_t));
    a->mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (a->mem == NULL) return -2;
    a->q = (int8_t *)a->mem;
    a->dx = (float *)((uint8_t *)a->mem + q_bytes);
    a->sx = a->dx + m * nb;
    a->sums = (int32_t *)(a->sx + m * nb);
    quantize_rows_q8(x, m, k, ldx, a->q, a->dx, a->sx, a->sums);
    return 0;
}

/* A block's scale d and the coefficient cw of its activation sum (see the header above). */
static inline __attribute__((always_inline)) void block_scales(int type, const uint8_t *blk, float *d, float *cw) {
    *d = half_to_float(read_u16(blk));
    *cw = type == TYPE_Q4_1 || type == TYPE_Q5_1 ? half_to_float(read_u16(blk + 2))
          : type == TYPE_Q4_0                    ? -8.0f * *d
          : type == TYPE_Q5_0                    ? -16.0f * *d
                                                 : 0.0f;
}

#if defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {  /* 8 lanes of 4 products u8 x s8 each, exact */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  /* pairs fit int16: at most 2 * 128 * 127 (Q8_0), no saturation */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* A block's 32 codes as unsigned bytes in input order (Q8_0: |c|, and *sign the signed codes). */
static inline __attribute__((always_inline)) __m256i block_codes(int type, const uint8_t *blk, __m256i *sign) {
    if (type == TYPE_Q8_0) {
        *sign = _mm256_loadu_si256((const __m256i *)(blk + 2));
        return _mm256_sign_epi8(*sign, *sign);
    }
    __m128i lo, hi;
    if (IS_Q5(type)) {
        q5_bytes(blk, type == TYPE_Q5_0 ? 2 : 4, &lo, &hi);
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == TYPE_Q4_0 ? 2 : 4)));
        const __m128i m15 = _mm_set1_epi8(15);
        lo = _mm_and_si128(raw, m15);
        hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m15);
    }
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__)
/* Lane g = the sum of v[g]'s 8 lanes (exact: int32 adds), as float. */
static inline __m256 hsum8x8(const __m256i *v) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                                               _mm256_permute2x128_si256(a, b, 0x31)));
}

/* The fp16 at byte `at` of the 8 blocks at blk + g * stride as 8 floats. */
static inline __m256 block_halves(const uint8_t *blk, long stride, int at) {
    __m128i h = _mm_setzero_si128();
    h = _mm_insert_epi16(h, read_u16(blk + at), 0);
    h = _mm_insert_epi16(h, read_u16(blk + stride + at), 1);
    h = _mm_insert_epi16(h, read_u16(blk + 2 * stride + at), 2);
    h = _mm_insert_epi16(h, read_u16(blk + 3 * stride + at), 3);
    h = _mm_insert_epi16(h, read_u16(blk + 4 * stride + at), 4);
    h = _mm_insert_epi16(h, read_u16(blk + 5 * stride + at), 5);
    h = _mm_insert_epi16(h, read_u16(blk + 6 * stride + at), 6);
    h = _mm_insert_epi16(h, read_u16(blk + 7 * stride + at), 7);
    return _mm256_cvtph_ps(h);
}
#endif

/* QW = 8 output channels (weight rows w0 .. w0 + 7, row_bytes apart; a group at the end of W repeats its
 * last row) for activation rows [0, rows) (rows <= Q8_TILE): out[r * ldo + g] for g < cols.
 * Vector path: per block, the 8 rows' codes are decoded once (shared by the activation rows); per
 * activation row 8 integer dots, one lane sum (hsum8x8: lane g = row g's exact dot), then
 * f = fma(dot, d * dx, f) and, but for Q8_0, f = fma(cw, sx, f): each output's blocks are summed in
 * order, one lane per output, which is what the many-row GEMM below does with 16 lanes, so both paths
 * give every row the same bits. */
#define QW 8
static inline __attribute__((always_inline)) void qdot_rows(int type, const uint8_t *w0, long row_bytes, long nw,
                                                            long nblocks, const int8_t *q, const float *dx,
                                                            const float *sx, long k, long rows, float *out,
                                                            long ldo, long cols) {
    const long bb = block_bytes(type);
#if defined(__AVX2__)
    __m256 f[Q8_TILE];
    for (long r = 0; r < rows; r++) f[r] = _mm256_setzero_ps();
    for (long b = 0; b < nblocks; b++) {
        const uint8_t *blk = w0 + b * bb;
        __m256i cb[QW], sg[QW];
        /* WHY: the 8 rows are read side by side, 8 strided streams the hardware prefetcher follows badly
         * from L3 / memory (25% slower at 1 thread than reading rows one after the other); the next
         * group's rows are one contiguous range, fetched here a slice per block */
        for (long at = b * QW * bb; at < (b + 1) * QW * bb; at += 64)
            _mm_prefetch((const char *)(w0 + QW * row_bytes + at), _MM_HINT_T0);
        for (int g = 0; g < QW; g++) cb[g] = block_codes(type, blk + (g < nw ? g : nw - 1) * row_bytes, &sg[g]);
        __m256 d, cw = _mm256_setzero_ps();
        if (nw == QW) {
            d = block_halves(blk, row_bytes, 0);
            if (type == TYPE_Q4_1 || type == TYPE_Q5_1) cw = block_halves(blk, row_bytes, 2);
        } else {  /* a short group: its rows' scales one by one, the last row repeated */
            float dv[QW], cv[QW];
            for (int g = 0; g < QW; g++) block_scales(type, blk + (g < nw ? g : nw - 1) * row_bytes, &dv[g], &cv[g]);
            d = _mm256_loadu_ps(dv);
            cw = _mm256_loadu_ps(cv);
        }
        if (type == TYPE_Q4_0) cw = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        if (type == TYPE_Q5_0) cw = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
        for (long r = 0; r < rows; r++) {
            const __m256i xs = _mm256_loadu_si256((const __m256i *)(q + r * k + b * QK));
            __m256i dots[QW];
            for (int g = 0; g < QW; g++) dots[g] = dot_u8s8(cb[g], type == TYPE_Q8_0 ? _mm256_sign_epi8(xs, sg[g]) : xs);
            const long i = r * nblocks + b;
            f[r] = _mm256_fmadd_ps(hsum8x8(dots), _mm256_mul_ps(d, _mm256_set1_ps(dx[i])), f[r]);
            if (type != TYPE_Q8_0) f[r] = _mm256_fmadd_ps(cw, _mm256_set1_ps(sx[i]), f[r]);
        }
    }
    for (long r = 0; r < rows; r++) {
        if (cols == QW) {
            _mm256_storeu_ps(out + r * ldo, f[r]);
        } else {
            float v[QW];
            _mm256_storeu_ps(v, f[r]);
            for (long g = 0; g < cols; g++) out[r * ldo + g] = v[g];
        }
    }
#else
    for (long g = 0; g < cols; g++)
        for (long r = 0; r < rows; r++) {
            float f = 0.0f;
            for (long b = 0; b < nblocks; b++) {
                const uint8_t *blk = w0 + g * row_bytes + b * bb;
                float d, cw;
                block_scales(type, blk, &d, &cw);
                int codes[QK];
                block_codes_int(type, blk, codes);
                const int8_t *qb = q + r * k + b * QK;
                int dot = 0;
                for (int j = 0; j < QK; j++) dot += codes[j] * qb[j];
                const long i = r * nblocks + b;
                /* WHY fmaf, not a * b + c: -ffp-contract=fast may fuse that in one variant and not in another */
                f = fmaf((float)dot, d * dx[i], f);
                if (type != TYPE_Q8_0) f = fmaf(cw, sx[i], f);
            }
            out[r * ldo + g] = f;
        }
    (void)nw;
#endif
}

typedef void (*qdot_fn)(const uint8_t *w0, long row_bytes, long nw, long nblocks, const int8_t *q, const float *dx,
                        const float *sx, long k, float *out, long ldo, long cols);
/* One function per (format, row count 1..8), as the float path's DOT_FN and for the same reasons. */
#define QDOT_FN(T, R)                                                                                             \
    static __attribute__((noinline)) void qdot_##T##_##R(const uint8_t *w0, long row_bytes, long nw, long nblocks, \
                                                          const int8_t *q, const float *dx, const float *sx,        \
                                                          long k, float *out, long ldo, long cols) {                \
        qdot_rows(T, w0, row_bytes, nw, nblocks, q, dx, sx, k, (R) < Q8_TILE ? (R) : Q8_TILE, out, ldo, cols);     \
    }
#define QDOT_FNS(T) \
    QDOT_FN(T, 1) QDOT_FN(T, 2) QDOT_FN(T, 3) QDOT_FN(T, 4) QDOT_FN(T, 5) QDOT_FN(T, 6) QDOT_FN(T, 7) QDOT_FN(T, 8)
QDOT_FNS(TYPE_Q8_0) QDOT_FNS(TYPE_Q4_0) QDOT_FNS(TYPE_Q4_1) QDOT_FNS(TYPE_Q5_0) QDOT_FNS(TYPE_Q5_1)
/* NAME(type): the table of P_<type>_1 .. P_<type>_8 (one function per row count) of a legacy format;
 * the caller checked IS_LEGACY(type). */
#define ROWS_TABLE(P, T) {P##_##T##_1, P##_##T##_2, P##_##T##_3, P##_##T##_4, P##_##T##_5, P##_##T##_6, P##_##T##_7, P##_##T##_8}
#define LEGACY_TABLE(NAME, FN_T, P)                                                                           \
    static const FN_T *NAME(int type) {                                                                       \
        static const FN_T q8_0[] = ROWS_TABLE(P, TYPE_Q8_0), q4_0[] = ROWS_TABLE(P, TYPE_Q4_0),               \
                          q4_1[] = ROWS_TABLE(P, TYPE_Q4_1), q5_0[] = ROWS_TABLE(P, TYPE_Q5_0),               \
                          q5_1[] = ROWS_TABLE(P, TYPE_Q5_1);                                                  \
        static const FN_T *const by_type[] = {[TYPE_Q8_0] = q8_0, [TYPE_Q4_0] = q4_0, [TYPE_Q4_1] = q4_1,      \
                                              [TYPE_Q5_0] = q5_0, [TYPE_Q5_1] = q5_1};                        \
        return by_type[type];                                                                                 \
    }
LEGACY_TABLE(qdot_table, qdot_fn, qdot)

/* out[M, N] = x[M, K] @ W^T as trillium_gguf_matmul, the activations quantized to int8 blocks first (the
 * section's header), by the decode kernel whatever M (trillium_gguf_matmul_q8 picks a path by M). Returns 0,
 * -1 for a type without the integer path (the K-quants) or a bad K, -2 when a buffer cannot be allocated. */
int trillium_gguf_decode_q8(int type, const float *x, long m, long k, long ldx, const uint8_t *w, long n,
                            float *out, int num_threads) {
    QRows a;
    const int rc = qrows_quantize(&a, type, x, m, k, ldx);
    if (rc != 0) return rc > 0 ? 0 : rc;
    const long nblocks = k / QK, row_bytes = nblocks * block_bytes(type), groups = (n + QW - 1) / QW;
    const qdot_fn *dots = qdot_table(type);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long gi = 0; gi < groups; gi++) {
        const long j0 = gi * QW, cols = n - j0 < QW ? n - j0 : QW;
        for (long r0 = 0; r0 < m; r0 += Q8_TILE) {
            const long rows = m - r0 < Q8_TILE ? m - r0 : Q8_TILE;
            dots[rows - 1](w + j0 * row_bytes, row_bytes, cols, nblocks, a.q + r0 * k, a.dx + r0 * nblocks,
                           a.sx + r0 * nblocks, k, out + r0 * n + j0, n, cols);
        }
    }
    free(a.mem);
    return 0;
}

/* ---- int8 activations, many rows (trillium_gguf_gemm_q8): prefill's GEMM ---------------------------------
 *
 * The same numbers as trillium_gguf_matmul_q8 (activations quantized to int8 blocks by quantize_rows_q8, exact
 * integer block dots, d * dx * dot + cw * sx per block), laid out for many activation rows. WHY a second
 * layout: qdot_rows decodes a weight row's block once per tile of Q8_TILE activation rows and then sums
 * each row's 8 lanes (hsum8x8); with hundreds of rows that lane sum is most of the work. Here the codes of
 * GT = 16 weight rows are first unpacked, per block, into 8 vectors of 64 bytes (lane i = 4 consecutive
 * codes of weight row i), so one vpdpbusd with an activation row's 4 int8 broadcast adds 4 products to
 * each of the 16 rows' dots: a block is 8 vpdpbusd per activation row and the 16 lanes are 16 outputs,
 * no lane sum at all (llama.cpp's repacked Q4_0_8x8 GEMM is the same idea, kept in the file at load;
 * here the repack is per call, into a buffer of 16 * K bytes that stays in cache, paid once per 16
 * weight rows and shared by every activation row).
 *
 * Codes are unsigned bytes: Q4_x / Q5_x their codes, Q8_0 c + 128, whose 128 * sum(q) is taken off the
 * int32 dot again (quantize_rows_q8's integer sums), so every dot is the exact integer qdot_rows gets.
 * Then the same float operations in the same order as qdot_rows (see "Determinism" above): the two
 * paths give the same bits, and trillium_gguf_matmul_q8 picks one by row count only for speed.
 * AVX-512 VNNI path (vpdpbusd on 512 bits); elsewhere the same layout in plain C
 * (trillium_gguf_gemm_q8_vectorized() says which; the Python side then keeps dequantize + oneDNN). */
#define GT 16  /* weight rows per tile: the 16 int32 lanes of a 512-bit vector */
#define GR 8   /* activation rows per pass: 8 int and 8 float accumulators, 32 registers in all */

int trillium_gguf_gemm_q8_vectorized(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__)
/* r[i] = row i of an 8 x 8 matrix of dwords; afterwards r[c] = column c. */
static inline void transpose8x8_epi32(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 2; j++) {
            u[4 * h + 2 * j] = _mm256_unpacklo_epi64(t[4 * h + j], t[4 * h + j + 2]);
            u[4 * h + 2 * j + 1] = _mm256_unpackhi_epi64(t[4 * h + j], t[4 * h + j + 2]);
        }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
        r[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Block b of the full tile of GT weight rows at `base` (the rows row_bytes apart) in the GEMM's layout:
 * wq[q4] lane i = codes 4 q4 .. 4 q4 + 3 of weight row i (+ 128 for Q8_0), dv / cv lane i = row i's d and
 * cw (cw 0 for Q8_0, whose + 128 comes off the integer dot). The same values as gemm_pack's per-row path
 * below; gemm_pack (full tiles) and the fused passes both take it. The next tile's rows (one contiguous
 * range) are prefetched a slice per block, as in qdot_rows. */
static inline __attribute__((always_inline)) void tile_block(int type, const uint8_t *base, long row_bytes, long b,
                                                             __m512i *wq, __m512 *dv, __m512 *cv) {
    const int q8 = type == TYPE_Q8_0;
    const long bb = block_bytes(type);
    const uint8_t *blk = base + b * bb;
    for (long at = b * GT * bb; at < (b + 1) * GT * bb; at += 64)
        _mm_prefetch((const char *)(base + GT * row_bytes + at), _MM_HINT_T0);
    /* the 16 rows' first dwords (d, and m or the codes' start), for the scales */
    const __m512i rows = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i head = _mm512_i32gather_epi32(_mm512_mullo_epi32(rows, _mm512_set1_epi32((int)row_bytes)),
                                                (const void *)blk, 1);
    if (type == TYPE_Q4_0 || type == TYPE_Q4_1) {
        /* WHY nibbles after the transpose: a block's 16 code bytes are 4 dwords, so the 16 rows go through
         * one in-lane 4 x 4 dword transpose (rows 4L .. 4L + 3 in 128-bit lane L), and then low / high
         * nibbles split 16 rows at once; byte j holds code j (low) and code j + 16 (high) */
        const long at = type == TYPE_Q4_0 ? 2 : 4;
        __m512i rq[4];
        for (int c = 0; c < 4; c++) {
            const uint8_t *bi = blk + at + c * row_bytes;
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)bi));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(bi + 4 * row_bytes)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(bi + 8 * row_bytes)), 2);
            rq[c] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(bi + 12 * row_bytes)), 3);
        }
        const __m512i t0 = _mm512_unpacklo_epi32(rq[0], rq[1]), t1 = _mm512_unpackhi_epi32(rq[0], rq[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(rq[2], rq[3]), t3 = _mm512_unpackhi_epi32(rq[2], rq[3]);
        const __m512i p[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                              _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
        const __m512i m15 = _mm512_set1_epi8(15);
        for (int j = 0; j < 4; j++) {
            wq[j] = _mm512_and_si512(p[j], m15);
            wq[4 + j] = _mm512_and_si512(_mm512_srli_epi16(p[j], 4), m15);
        }
    } else {
        __m256i half[2][8];
        for (long i = 0; i < GT; i++) {
            const uint8_t *bi = blk + i * row_bytes;
            __m256i unused;
            half[i / 8][i % 8] = q8 ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(bi + 2)),
                                                       _mm256_set1_epi8((char)0x80))
                                    : block_codes(type, bi, &unused);
        }
        transpose8x8_epi32(half[0]);
        transpose8x8_epi32(half[1]);
        for (int q4 = 0; q4 < 8; q4++)
            wq[q4] = _mm512_inserti64x4(_mm512_castsi256_si512(half[0][q4]), half[1][q4], 1);
    }
    *dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    *cv = _mm512_setzero_ps();
    if (type == TYPE_Q4_1 || type == TYPE_Q5_1)
        *cv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
    if (type == TYPE_Q4_0) *cv = _mm512_mul_ps(*dv, _mm512_set1_ps(-8.0f));
    if (type == TYPE_Q5_0) *cv = _mm512_mul_ps(*dv, _mm512_set1_ps(-16.0f));
}
#endif

/* Weight rows [n0, n0 + rows) (rows <= GT) as codes [nblocks][8][GT][4] bytes, d and cw [nblocks][GT];
 * lanes past `rows` are zero. Vector path: per block, the 16 rows' codes (8 dwords each) go through two
 * 8 x 8 dword transposes, and the next tile's rows (one contiguous range) are prefetched a slice per block,
 * as in qdot_rows. */
static void gemm_pack(int type, const uint8_t *w, long row_bytes, long nblocks, long n0, long rows,
                      uint8_t *codes, float *dw, float *cw) {
    const long bb = block_bytes(type);
    const uint8_t *base = w + n0 * row_bytes;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (rows == GT) {  /* a full tile: tile_block's register unpacking, stored */
        for (long b = 0; b < nblocks; b++) {
            __m512i wq[8];
            __m512 dv, cv;
            tile_block(type, base, row_bytes, b, wq, &dv, &cv);
            uint8_t *dst = codes + b * 8 * GT * 4;
            for (int q4 = 0; q4 < 8; q4++) _mm512_storeu_si512((void *)(dst + q4 * GT * 4), wq[q4]);
            _mm512_storeu_ps(dw + b * GT, dv);
            _mm512_storeu_ps(cw + b * GT, cv);
        }
        return;
    }
#endif
#if defined(__AVX2__)
    for (long b = 0; b < nblocks; b++) {
        for (long at = b * GT * bb; at < (b + 1) * GT * bb; at += 64)
            _mm_prefetch((const char *)(base + GT * row_bytes + at), _MM_HINT_T0);
        __m256i half[2][8];
        for (long i = 0; i < GT; i++) {
            __m256i c = _mm256_setzero_si256();
            float d = 0.0f, corr = 0.0f;
            if (i < rows) {
                const uint8_t *blk = base + i * row_bytes + b * bb;
                if (type == TYPE_Q8_0) {
                    c = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8((char)0x80));
                } else {
                    __m256i unused;
                    c = block_codes(type, blk, &unused);
                }
                block_scales(type, blk, &d, &corr);
            }
            half[i / 8][i % 8] = c;
            dw[b * GT + i] = d;
            cw[b * GT + i] = corr;  /* Q8_0: unused (its + 128 comes off the integer dot) */
        }
        transpose8x8_epi32(half[0]);
        transpose8x8_epi32(half[1]);
        uint8_t *dst = codes + b * 8 * GT * 4;
        for (int q4 = 0; q4 < 8; q4++) {  /* chunk q4: rows 0-7 then rows 8-15 */
            _mm256_storeu_si256((__m256i *)(dst + q4 * GT * 4), half[0][q4]);
            _mm256_storeu_si256((__m256i *)(dst + q4 * GT * 4 + 32), half[1][q4]);
        }
    }
#else
    if (rows < GT) {
        memset(codes, 0, (size_t)(nblocks * 8 * GT * 4));
        memset(dw, 0, sizeof(float) * (size_t)(nblocks * GT));
        memset(cw, 0, sizeof(float) * (size_t)(nblocks * GT));
    }
    for (long i = 0; i < rows; i++) {
        const uint8_t *row = base + i * row_bytes;
        for (long b = 0; b < nblocks; b++) {
            const uint8_t *blk = row + b * bb;
            int ci[QK];
            uint8_t c[QK];
            block_codes_int(type, blk, ci);
            for (int j = 0; j < QK; j++) c[j] = (uint8_t)(type == TYPE_Q8_0 ? ci[j] + 128 : ci[j]);
            uint8_t *dst = codes + b * 8 * GT * 4 + i * 4;
            for (int q4 = 0; q4 < 8; q4++) memcpy(dst + q4 * GT * 4, c + q4 * 4, 4);
            float d, corr;
            block_scales(type, blk, &d, &corr);
            dw[b * GT + i] = d;
            cw[b * GT + i] = corr;
        }
    }
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Block b of one tile (wq, dv, cv: tile_block's layout) into the float sums f[r] of activation rows
 * [0, rows): each row's exact integer dot (8 vpdpbusd, 4 broadcast codes each), then, but for Q8_0's
 * + 128 taken off, f = fma(dot, d * dx, f) and f = fma(cw, sx, f). The one place these operations are
 * written, for the buffered GEMM and the fused pass alike: the order is what keeps their bits equal. */
static inline __attribute__((always_inline)) void block_rows(int q8, const __m512i *wq, __m512 dv, __m512 cv,
                                                             const int8_t *q, const float *dx, const float *sx,
                                                             const int32_t *sums, long k, long nblocks, long b,
                                                             long rows, __m512 *f) {
    __m512i a[GR];
    for (long r = 0; r < rows; r++) a[r] = _mm512_setzero_si512();
    for (int q4 = 0; q4 < 8; q4++)
        for (long r = 0; r < rows; r++) {
            int32_t x4;
            memcpy(&x4, q + r * k + b * QK + q4 * 4, 4);
            a[r] = _mm512_dpbusd_epi32(a[r], wq[q4], _mm512_set1_epi32(x4));
        }
    for (long r = 0; r < rows; r++) {
        const long i = r * nblocks + b;
        if (q8) a[r] = _mm512_sub_epi32(a[r], _mm512_set1_epi32(128 * sums[i]));  /* the codes' + 128 */
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), _mm512_mul_ps(dv, _mm512_set1_ps(dx[i])), f[r]);
        if (!q8) f[r] = _mm512_fmadd_ps(cv, _mm512_set1_ps(sx[i]), f[r]);
    }
}
#endif

/* out[r, 0..cols) for activation rows [0, rows) against one packed tile. */
static inline __attribute__((always_inline)) void gemm_rows(int q8, const uint8_t *codes, const float *dw,
                                                            const float *cw, long nblocks, const int8_t *q,
                                                            const float *dx, const float *sx, const int32_t *sums,
                                                            long k, long rows, float *out, long ldo, long cols) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 f[GR];
    for (long r = 0; r < rows; r++) f[r] = _mm512_setzero_ps();
    for (long b = 0; b < nblocks; b++) {
        const uint8_t *pw = codes + b * 8 * GT * 4;
        __m512i wq[8];
        for (int q4 = 0; q4 < 8; q4++) wq[q4] = _mm512_loadu_si512((const void *)(pw + q4 * GT * 4));
        block_rows(q8, wq, _mm512_loadu_ps(dw + b * GT), _mm512_loadu_ps(cw + b * GT), q, dx, sx, sums, k, nblocks,
                   b, rows, f);
    }
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    for (long r = 0; r < rows; r++) _mm512_mask_storeu_ps(out + r * ldo, mask, f[r]);
#else
    for (long r = 0; r < rows; r++) {
        float f[GT] = {0};
        for (long b = 0; b < nblocks; b++) {
            const uint8_t *pw = codes + b * 8 * GT * 4;
            const int8_t *qb = q + r * k + b * QK;
            const long i = r * nblocks + b;
            for (int lane = 0; lane < GT; lane++) {
                int32_t dot = 0;
                for (int q4 = 0; q4 < 8; q4++)
                    for (int t = 0; t < 4; t++) dot += pw[q4 * GT * 4 + lane * 4 + t] * qb[q4 * 4 + t];
                if (q8) dot -= 128 * sums[i];
                f[lane] = fmaf((float)dot, dw[b * GT + lane] * dx[i], f[lane]);
                if (!q8) f[lane] = fmaf(cw[b * GT + lane], sx[i], f[lane]);
            }
        }
        for (long lane = 0; lane < cols; lane++) out[r * ldo + lane] = f[lane];
    }
#endif
}

typedef void (*gemm_fn)(int q8, const uint8_t *codes, const float *dw, const float *cw, long nblocks,
                        const int8_t *q, const float *dx, const float *sx, const int32_t *sums, long k, float *out,
                        long ldo, long cols);
#define GEMM_FN(R)                                                                                              \
    static __attribute__((noinline)) void gemm_##R(int q8, const uint8_t *codes, const float *dw,              \
                                                   const float *cw, long nblocks, const int8_t *q,              \
                                                   const float *dx, const float *sx, const int32_t *sums,       \
                                                   long k, float *out, long ldo, long cols) {                   \
        gemm_rows(q8, codes, dw, cw, nblocks, q, dx, sx, sums, k, R, out, ldo, cols);                           \
    }
GEMM_FN(1) GEMM_FN(2) GEMM_FN(3) GEMM_FN(4) GEMM_FN(5) GEMM_FN(6) GEMM_FN(7) GEMM_FN(8)
static const gemm_fn gemm_table[GR] = {gemm_1, gemm_2, gemm_3, gemm_4, gemm_5, gemm_6, gemm_7, gemm_8};

/* The buffered GEMM's tile of weight rows [n0, n0 + GT) (fewer at the end of W): packed into `codes` and
 * `dw` (d, then cw: 2 * nblocks * GT floats), then every pass of GR activation rows of `a` over it. */
static void gemm_tile(int type, const uint8_t *w, long row_bytes, long nblocks, long n0, uint8_t *codes, float *dw,
                      const QRows *a, long m, long k, float *out, long n) {
    const long cols = n - n0 < GT ? n - n0 : GT;
    float *cw = dw + nblocks * GT;
    gemm_pack(type, w, row_bytes, nblocks, n0, cols, codes, dw, cw);
    for (long r0 = 0; r0 < m; r0 += GR) {
        const long rows = m - r0 < GR ? m - r0 : GR;
        gemm_table[rows - 1](type == TYPE_Q8_0, codes, dw, cw, nblocks, a->q + r0 * k, a->dx + r0 * nblocks,
                             a->sx + r0 * nblocks, a->sums + r0 * nblocks, k, out + r0 * n + n0, n, cols);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* One pass of at most GR activation rows against one full tile of GT weight rows, straight from the
 * blocks: per block, tile_block's unpacking in registers, then block_rows, as the buffered GEMM (the
 * same bits). WHY: with a few rows (a verify step's token and its drafts, a small
 * batch) the buffered GEMM writes its tile's 16 x K bytes that one pass of rows reads back once; here
 * nothing goes through memory. */
static inline __attribute__((always_inline)) void gemm_fused_rows(int type, const uint8_t *base, long row_bytes,
                                                                  long nblocks, const int8_t *q, const float *dx,
                                                                  const float *sx, const int32_t *sums, long k,
                                                                  long rows, float *out, long ldo) {
    const int q8 = type == TYPE_Q8_0;
    __m512 f[GR];
    for (long r = 0; r < rows; r++) f[r] = _mm512_setzero_ps();
    for (long b = 0; b < nblocks; b++) {
        __m512i wq[8];
        __m512 dv, cv;
        tile_block(type, base, row_bytes, b, wq, &dv, &cv);
        block_rows(q8, wq, dv, cv, q, dx, sx, sums, k, nblocks, b, rows, f);
    }
    for (long r = 0; r < rows; r++) _mm512_storeu_ps(out + r * ldo, f[r]);
}

typedef void (*fused_fn)(const uint8_t *base, long row_bytes, long nblocks, const int8_t *q, const float *dx,
                         const float *sx, const int32_t *sums, long k, float *out, long ldo);
/* One function per (format, row count), as QDOT_FN. */
#define FUSED_FN(T, R)                                                                                          \
    static __attribute__((noinline)) void fused_##T##_##R(const uint8_t *base, long row_bytes, long nblocks,    \
                                                          const int8_t *q, const float *dx, const float *sx,    \
                                                          const int32_t *sums, long k, float *out, long ldo) {  \
        gemm_fused_rows(T, base, row_bytes, nblocks, q, dx, sx, sums, k, R, out, ldo);                          \
    }
#define FUSED_FNS(T) \
    FUSED_FN(T, 1) FUSED_FN(T, 2) FUSED_FN(T, 3) FUSED_FN(T, 4) FUSED_FN(T, 5) FUSED_FN(T, 6) FUSED_FN(T, 7) FUSED_FN(T, 8)
FUSED_FNS(TYPE_Q8_0) FUSED_FNS(TYPE_Q4_0) FUSED_FNS(TYPE_Q4_1) FUSED_FNS(TYPE_Q5_0) FUSED_FNS(TYPE_Q5_1)
LEGACY_TABLE(fused_table, fused_fn, fused)
#endif

/* Rows up to which trillium_gguf_matmul_q8 takes the fused pass: one pass. With more, the GEMM's buffer,
 * unpacked once per tile, beats unpacking each block again for every pass of GR rows (24 SmolLM2 Q4_1
 * matmuls at 1 thread: 1.61 ms fused against 1.79 buffered at 8 rows, two fused passes 3.04 against
 * 2.85 at 16). trillium_gguf_fused_q8 itself takes more rows in passes of GR (tests, benches). */
#define FUSED_MAX_ROWS 8
#define FUSED_PASSES_MAX_ROWS 64

/* out[M, N] = x[M, K] @ W^T for M <= FUSED_PASSES_MAX_ROWS, in passes of GR rows: full tiles by the fused
 * pass above, a last short tile (N not a multiple of GT) through gemm_pack + gemm_rows; the same bits as
 * trillium_gguf_gemm_q8. Returns as it; -1 also where the fused pass is not built (no AVX-512 VNNI) or
 * M > FUSED_PASSES_MAX_ROWS. */
int trillium_gguf_fused_q8(int type, const float *x, long m, long k, long ldx, const uint8_t *w, long n,
                           float *out, int num_threads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (m > FUSED_PASSES_MAX_ROWS) return -1;
    QRows a;
    const int rc = qrows_quantize(&a, type, x, m, k, ldx);
    if (rc != 0) return rc > 0 ? 0 : rc;
    const long nblocks = k / QK, row_bytes = nblocks * block_bytes(type), full = n / GT;
    const fused_fn *fns = fused_table(type);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long t = 0; t < full; t++)
        for (long r0 = 0; r0 < m; r0 += GR)  /* a second pass reads the tile's blocks from L1 / L2 */
            fns[(m - r0 < GR ? m - r0 : GR) - 1](w + t * GT * row_bytes, row_bytes, nblocks, a.q + r0 * k,
                                                 a.dx + r0 * nblocks, a.sx + r0 * nblocks, a.sums + r0 * nblocks, k,
                                                 out + r0 * n + t * GT, n);
    int failed = 0;
    if (full * GT < n) {  /* the short tile: GT - 1 rows at most, one thread */
        uint8_t *codes = aligned_alloc(64, (size_t)(nblocks * 8 * GT * 4));
        float *dw = malloc(2 * sizeof(float) * (size_t)(nblocks * GT));
        if (codes != NULL && dw != NULL)
            gemm_tile(type, w, row_bytes, nblocks, full * GT, codes, dw, &a, m, k, out, n);
        else
            failed = 1;
        free(codes);
        free(dw);
    }
    free(a.mem);
    return failed ? -2 : 0;
#else
    (void)type, (void)x, (void)m, (void)k, (void)ldx, (void)w, (void)n, (void)out, (void)num_threads;
    return -1;
#endif
}

/* out[M, N] = x[M, K] @ W^T, int8 activations, by the GEMM whatever M (same bits and return codes as
 * trillium_gguf_decode_q8). */
int trillium_gguf_gemm_q8(int type, const float *x, long m, long k, long ldx, const uint8_t *w, long n,
                          float *out, int num_threads) {
    QRows a;
    const int rc = qrows_quantize(&a, type, x, m, k, ldx);
    if (rc != 0) return rc > 0 ? 0 : rc;
    const long nblocks = k / QK, row_bytes = nblocks * block_bytes(type), tiles = (n + GT - 1) / GT;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint8_t *codes = aligned_alloc(64, (size_t)(nblocks * 8 * GT * 4));
        float *dw = malloc(2 * sizeof(float) * (size_t)(nblocks * GT));
        const int ok = codes != NULL && dw != NULL;
        failed = !ok;
        /* every thread meets the worksharing loop (a thread without buffers skips its tiles, and the call fails) */
#pragma omp for schedule(static)
        for (long t = 0; t < tiles; t++) {
            if (!ok) continue;
            gemm_tile(type, w, row_bytes, nblocks, t * GT, codes, dw, &a, m, k, out, n);
        }
        free(codes);
        free(dw);
    }
    free(a.mem);
    return failed ? -2 : 0;
}

/* out[N, K] float32 = the dequantized W. Returns 0, or -1 for a bad type. */
int trillium_gguf_dequantize(int type, const uint8_t *w, long n, long k, float *out, int num_threads) {
    const long bb = block_bytes(type), nsub = sub_blocks(type);
    if (bb == 0 || k % (QK * nsub)) return -1;
    const long nblocks = k / (QK * nsub), row_bytes = nblocks * bb;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long j = 0; j < n; j++)
        for (long b = 0; b < nblocks; b++) {
            const uint8_t *blk = w + j * row_bytes + b * bb;
            float mul[16], add[16];
            if (IS_KQUANT(type)) kquant_scales(type, blk, mul, add);
            for (long s = 0; s < nsub; s++)
                decode_block(type, blk, (int)s, mul + 2 * s, add + 2 * s, out + j * k + (b * nsub + s) * QK);
        }
    return 0;
}

/* out[M, N] = x[M, K] @ W^T with int8 activations, where the GEMM's VNNI path is built: up to
 * FUSED_MAX_ROWS rows (one pass) the fused pass (trillium_gguf_fused_q8), more rows the buffered GEMM;
 * elsewhere the decode kernel. Same bits on every path (the section's "Determinism"). WHY the fused pass
 * from one row: it reads each 16-row tile's blocks side by side and has no lane sums, so it beats the
 * decode kernel at every row count, 1 row included (24 SmolLM2 Q4_1 matmuls at 1 thread: 1.26x at 1 row,
 * 1.59x at 5, 1.68x at 8; the Q8_0 LM head 1.0x / 1.7x / 1.8x), and the buffered GEMM at up to 8 rows
 * (bench/quant_matmul.py --prefill and --rows-sweep). */
int trillium_gguf_matmul_q8(int type, const float *x, long m, long k, long ldx, const uint8_t *w, long n,
                            float *out, int num_threads) {
    if (trillium_gguf_gemm_q8_vectorized())
        return m <= FUSED_MAX_ROWS ? trillium_gguf_fused_q8(type, x, m, k, ldx, w, n, out, num_threads)
                       : trillium_gguf_gemm_q8(type, x, m, k, ldx, w, n, out, num_threads);
    return trillium_gguf_decode_q8(type, x, m, k, ldx, w, n, out, num_threads);
}
