/* GGUF weight-only matmuls on CPU: float32 activations x packed Q8_0 / Q4_0 / Q4_1 weights.
 *
 * Built at first use by trillium/kernels/gguf_cpu.py (the system C compiler, -O3 -march=native,
 * -ffp-contract=fast, OpenMP; no torch headers, so it builds in about a second) and called through ctypes.
 *
 * Weights stay in llama.cpp's own block layout, one row per output channel:
 *
 *   row n: [block 0][block 1] ... [block K/32 - 1]      every block covers 32 inputs
 *   Q8_0 block (34 B): fp16 d | int8 q[32]               w[j] = d * q[j]
 *   Q4_0 block (18 B): fp16 d | uint8 qs[16]             w[j] = d * ((qs[j] & 15) - 8), w[j+16] = d * ((qs[j] >> 4) - 8)
 *   Q4_1 block (20 B): fp16 d | fp16 m | uint8 qs[16]    w[j] = d * (qs[j] & 15) + m,    w[j+16] = d * (qs[j] >> 4) + m
 *
 * WHY exact: each block is widened to the float32 values gguf.quants.dequantize
 * produces (bit for bit: d * q is exact in float32, so Q4_1's fused d * q + m
 * rounds once, as numpy's), in registers, and multiplied there; nothing is requantized and the
 * activations stay float32, so the result is the dequantize-then-matmul result up
 * to float32 summation order. Only the weights' bytes cross the memory bus.
 *
 * AVX-512 and AVX2+FMA paths (intrinsics, picked by -march=native), else plain loops.
 *
 * Layout of the work: output channels are split across threads; each thread walks
 * its rows once per tile of TILE_M activation rows, keeping a 32-lane accumulator
 * per activation row (reduced once per output), so a decoded block serves the
 * whole tile.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8 };
#define QK 32
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

static long block_bytes(int type) {
    switch (type) {
        case TYPE_Q8_0: return 2 + QK;
        case TYPE_Q4_0: return 2 + QK / 2;
        case TYPE_Q4_1: return 4 + QK / 2;
        default: return 0;
    }
}

/* The 32 float32 weights of one block. */
static inline __attribute__((always_inline)) void decode_block(int type, const uint8_t *blk, float *restrict w) {
    if (type == TYPE_Q8_0) {
        const float d = half_to_float(read_u16(blk));
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < QK; j++) w[j] = d * (float)q[j];
    } else if (type == TYPE_Q4_0) {
        const float d = half_to_float(read_u16(blk));
        const uint8_t *qs = blk + 2;
        for (int j = 0; j < QK / 2; j++) {
            w[j] = d * (float)((int)(qs[j] & 15) - 8);
            w[j + QK / 2] = d * (float)((int)(qs[j] >> 4) - 8);
        }
    } else {
        const float d = half_to_float(read_u16(blk)), m = half_to_float(read_u16(blk + 2));
        const uint8_t *qs = blk + 4;
        for (int j = 0; j < QK / 2; j++) {
            w[j] = d * (float)(qs[j] & 15) + m;
            w[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
        }
    }
}

#if defined(__AVX512F__)
/* 16 float lanes: a block is 2 vectors. */
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline __attribute__((always_inline)) void decode_vec(int type, const uint8_t *blk, vf *w) {
    const __m512 d = _mm512_set1_ps(half_to_float(read_u16(blk)));
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
static inline __attribute__((always_inline)) void decode_vec(int type, const uint8_t *blk, vf *w) {
    const __m256 d = _mm256_set1_ps(half_to_float(read_u16(blk)));
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

/* One output channel for rows [0, rows) of x (rows <= TILE_M): out[r * ldo] = x[r] . w_row.
 * Always inlined, so each (type, rows) call site below compiles to its own loop nest. */
static inline __attribute__((always_inline)) void dot_rows(int type, const uint8_t *row, long nblocks,
                                                           const float *x, long ldx, long rows, float *out,
                                                           long ldo) {
    const long bb = block_bytes(type);
#ifdef LANES
    enum { NV = QK / LANES };
    vf acc[TILE_M][NV], w[NV];
    for (long r = 0; r < rows; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    for (long b = 0; b < nblocks; b++) {
        decode_vec(type, row + b * bb, w);
        for (long r = 0; r < rows; r++) {
            const float *xb = x + r * ldx + b * QK;
            for (int v = 0; v < NV; v++) acc[r][v] = vfma(vload(xb + v * LANES), w[v], acc[r][v]);
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
        decode_block(type, row + b * bb, w);
        for (long r = 0; r < rows; r++) {
            const float *xb = x + r * ldx + b * QK;
            float *a = acc[r];
            for (int j = 0; j < QK; j++) a[j] += xb[j] * w[j];
        }
    }
    for (long r = 0; r < rows; r++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += acc[r][j];
        out[r * ldo] = s;
    }
#endif
}

/* out[M, N] = x[M, K] @ W^T with W [N, K] in GGUF blocks (K % 32 == 0). Returns 0, or -1 for a bad type. */
int trillium_gguf_matmul(int type, const float *x, long m, long k, long ldx, const uint8_t *w, long n,
                         float *out, int num_threads) {
    const long bb = block_bytes(type);
    if (bb == 0 || k % QK) return -1;
    const long nblocks = k / QK, row_bytes = nblocks * bb;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long j = 0; j < n; j++) {
        const uint8_t *row = w + j * row_bytes;
        for (long r0 = 0; r0 < m; r0 += TILE_M) {
            const long rows = m - r0 < TILE_M ? m - r0 : TILE_M;
            const float *xr = x + r0 * ldx;
            float *o = out + r0 * n + j;
            /* WHY the constant arguments: decode (M = 1) and full tiles get loops with fixed trip counts. */
#define DOT(T)                                                                               \
    if (rows == 1) dot_rows(T, row, nblocks, xr, ldx, 1, o, n);                                \
    else if (rows == TILE_M) dot_rows(T, row, nblocks, xr, ldx, TILE_M, o, n);                 \
    else dot_rows(T, row, nblocks, xr, ldx, rows, o, n);
            if (type == TYPE_Q8_0) { DOT(TYPE_Q8_0) }
            else if (type == TYPE_Q4_0) { DOT(TYPE_Q4_0) }
            else { DOT(TYPE_Q4_1) }
#undef DOT
        }
    }
    return 0;
}

/* out[N, K] float32 = the dequantized W. Returns 0, or -1 for a bad type. */
int trillium_gguf_dequantize(int type, const uint8_t *w, long n, long k, float *out, int num_threads) {
    const long bb = block_bytes(type);
    if (bb == 0 || k % QK) return -1;
    const long nblocks = k / QK, row_bytes = nblocks * bb;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long j = 0; j < n; j++)
        for (long b = 0; b < nblocks; b++) decode_block(type, w + j * row_bytes + b * bb, out + j * k + b * QK);
    return 0;
}
