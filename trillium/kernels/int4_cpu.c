/* Group-wise int4 weight-only matmuls on CPU (AWQ / GPTQ checkpoints): float32 activations.
 *
 * Built at first use by trillium/kernels/int4_cpu.py (the system C compiler, -O3 -march=native,
 * -ffp-contract=fast, OpenMP; no torch headers) and called through ctypes.
 *
 * The loader (trillium/models/int4_checkpoint.py) repacks AWQ's and GPTQ's int32 words into one
 * row-major layout at load -- still 4 bits a weight, never float -- one row per output channel:
 *
 *   qs [N, K/2] uint8   row n: [chunk 0][chunk 1] ... [chunk K/32 - 1], 16 bytes a chunk of 32 inputs:
 *                       byte j holds q[32c + j] in its low nibble and q[32c + j + 16] in its high one
 *   sz [N, G, 2] float  per group of `group` inputs (a multiple of 32): (s, -z * s)
 *
 *   w[n, k] = q * s + (-z * s) = (q - z) * s      with s = the checkpoint's fp16/bf16 scale, z its zero
 *
 * WHY exact: q * s and z * s are exact in float32 (4-5 bit integers times an 11-bit mantissa), and so
 * is their difference (q - z) * s, so the fused q * s + c rounds to exactly the float32 the reference
 * dequantization ((q - z).float() * s.float()) gives; the activations stay float32. The result is
 * dequantize-then-matmul up to float32 summation order. Only the packed bytes cross the memory bus.
 *
 * AVX-512 and AVX2+FMA paths (intrinsics, picked by -march=native), else plain loops. Output channels
 * are split across threads; each thread walks its rows once per tile of TILE_M activation rows.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QK 32
#define CHUNK_BYTES 16
#if defined(__AVX512F__) || !defined(__AVX2__)
#define TILE_M 8
#else
#define TILE_M 4
#endif

/* The 32 float32 weights of one chunk. */
static inline __attribute__((always_inline)) void decode_chunk(const uint8_t *qs, float s, float c,
                                                               float *restrict w) {
    for (int j = 0; j < QK / 2; j++) {
        w[j] = (float)(qs[j] & 15) * s + c;
        w[j + QK / 2] = (float)(qs[j] >> 4) * s + c;
    }
}

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline __attribute__((always_inline)) void decode_vec(const uint8_t *qs, float s, float c, vf *w) {
    const __m512 vs = _mm512_set1_ps(s), vc = _mm512_set1_ps(c);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), vs, vc);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), vs, vc);
}
#elif defined(__AVX2__) && defined(__FMA__)
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
static inline __m256 widen8(__m128i bytes8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8)); }
static inline __attribute__((always_inline)) void decode_vec(const uint8_t *qs, float s, float c, vf *w) {
    const __m256 vs = _mm256_set1_ps(s), vc = _mm256_set1_ps(c);
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w[0] = _mm256_fmadd_ps(widen8(lo), vs, vc);
    w[1] = _mm256_fmadd_ps(widen8(_mm_srli_si128(lo, 8)), vs, vc);
    w[2] = _mm256_fmadd_ps(widen8(hi), vs, vc);
    w[3] = _mm256_fmadd_ps(widen8(_mm_srli_si128(hi, 8)), vs, vc);
}
#endif

/* One output channel for rows [0, rows) of x (rows <= TILE_M): out[r * ldo] = x[r] . w_row. */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *qs, const float *sz, long nchunks,
                                                           long chunks_per_group, const float *x, long ldx,
                                                           long rows, float *out, long ldo) {
#ifdef LANES
    enum { NV = QK / LANES };
    vf acc[TILE_M][NV], w[NV];
    for (long r = 0; r < rows; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    /* WHY groups outside chunks: the group of a chunk without a division per chunk. */
    for (long g = 0, b = 0; b < nchunks; g++) {
        const float s = sz[2 * g], c = sz[2 * g + 1];
        for (const long end = b + chunks_per_group; b < end; b++) {
            decode_vec(qs + b * CHUNK_BYTES, s, c, w);
            for (long r = 0; r < rows; r++) {
                const float *xb = x + r * ldx + b * QK;
                for (int v = 0; v < NV; v++) acc[r][v] = vfma(vload(xb + v * LANES), w[v], acc[r][v]);
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
    for (long g = 0, b = 0; b < nchunks; g++) {
        const float s = sz[2 * g], c = sz[2 * g + 1];
        for (const long end = b + chunks_per_group; b < end; b++) {
            decode_chunk(qs + b * CHUNK_BYTES, s, c, w);
            for (long r = 0; r < rows; r++) {
                const float *xb = x + r * ldx + b * QK;
                for (int j = 0; j < QK; j++) acc[r][j] += xb[j] * w[j];
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

/* out[M, N] = x[M, K] @ W^T. K % group == 0, group % 32 == 0. Returns 0, or -1 for bad sizes. */
int trillium_int4_matmul(const float *x, long m, long k, long ldx, const uint8_t *qs, const float *sz, long n,
                         long group, float *out, int num_threads) {
    if (group <= 0 || group % QK || k % group) return -1;
    const long nchunks = k / QK, cpg = group / QK, ngroups = k / group;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long j = 0; j < n; j++) {
        const uint8_t *row = qs + j * (k / 2);
        const float *rsz = sz + j * ngroups * 2;
        for (long r0 = 0; r0 < m; r0 += TILE_M) {
            const long rows = m - r0 < TILE_M ? m - r0 : TILE_M;
            const float *xr = x + r0 * ldx;
            float *o = out + r0 * n + j;
            /* WHY the constant arguments: decode (M = 1) and full tiles get loops with fixed trip counts. */
            if (rows == 1) dot_rows(row, rsz, nchunks, cpg, xr, ldx, 1, o, n);
            else if (rows == TILE_M) dot_rows(row, rsz, nchunks, cpg, xr, ldx, TILE_M, o, n);
            else dot_rows(row, rsz, nchunks, cpg, xr, ldx, rows, o, n);
        }
    }
    return 0;
}

/* out[N, K] float32 = the dequantized W. Returns 0, or -1 for bad sizes. */
int trillium_int4_dequantize(const uint8_t *qs, const float *sz, long n, long k, long group, float *out,
                             int num_threads) {
    if (group <= 0 || group % QK || k % group) return -1;
    const long nchunks = k / QK, cpg = group / QK, ngroups = k / group;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long j = 0; j < n; j++)
        for (long b = 0; b < nchunks; b++) {
            const float *g = sz + j * ngroups * 2 + 2 * (b / cpg);
            decode_chunk(qs + j * (k / 2) + b * CHUNK_BYTES, g[0], g[1], out + j * k + b * QK);
        }
    return 0;
}
