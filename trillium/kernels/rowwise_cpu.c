/* The row-wise ops of a decoder layer in float32 on CPU: RMSNorm, SiLU-and-mul, rotary embedding.
 *
 * Called two ways, by the same machine code: eagerly through ctypes (rowwise_cpu.py, from
 * kernels/dispatch.py), and from compiled decode graphs through native_ops.cpp (its ops hold these
 * functions' addresses). WHY one kernel for both: a row must get the same bits whether its step
 * ran eagerly (a prefill, a mixed step, a verify step past the largest bucket) or in a graph, or a
 * greedy near-tie late in a request flips with the batch it ran in (speculative against plain, batch 8
 * against 1). Inductor's own fused loops and ATen's ops sum and approximate in orders of their own;
 * these functions fix one, and neither path computes it any other way.
 *
 * Every function works one row at a time and a row's result depends on nothing but the row (no
 * row count, thread or alignment decides an order), so batches are invariant too. Rows are split
 * across `num_threads` OpenMP threads where a call has THREADED_ELEMENTS elements or more (a
 * prefill's or a large decode batch's rows; a thread computes whole rows, so the bits do not
 * change), 16 rows at a time as threads come free (a core the server's other processes take for a
 * while does not hold up the call). WHY: single-threaded, a 1024-token prefill step of the bench
 * model spent ~4% of its time in SiLU-and-mul, norms and rope while the second core waited. Built with
 * -ffp-contract=off (rowwise_cpu.py): no fused multiply-add is formed, each product is rounded as
 * written, so whatever the compiler vectorizes computes exactly the scalar code's values.
 *
 *   trillium_rms_norm     y = x * (1 / sqrt(mean(x^2) + eps)) * w; the squares summed in 16 lanes
 *                         (element i into lane i % 16), the lanes then added pairwise (8, 4, 2, 1)
 *   trillium_silu_and_mul [gate | up] -> gate / (1 + exp(-gate)) * up, exp by Cody-Waite reduction
 *                         and a degree-6 polynomial (Cephes' expf, ~1 ulp)
 *   trillium_rope         neox (rotate-half) rope from a [positions, D] table of [cos | sin]:
 *                         x1 * cos - x2 * sin, x2 * cos + x1 * sin (the reference's products and sums
 *                         exactly, so these bits are kernels/reference.py's too)
 *
 * Rows are given as (outer, inner) with a stride for each, so a layer's views (q and k of one fused
 * projection, rows strided) need no copy; outputs are contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16
/* WHY a floor: below ~32K elements a thread team's wake-up costs more than the second core saves. */
#define THREADED_ELEMENTS (1L << 15)

static inline int team(long elements, int num_threads) {
    return elements < THREADED_ELEMENTS || num_threads < 1 ? 1 : num_threads;
}

void trillium_rms_norm(const float *x, long outer, long inner, long n, long stride_outer, long stride_inner,
                       const float *weight, float eps, float *out, int num_threads) {
#pragma omp parallel for collapse(2) schedule(dynamic, 16) num_threads(team(outer * inner * n, num_threads))
    for (long o = 0; o < outer; o++) {
        for (long i = 0; i < inner; i++) {
            const float *row = x + o * stride_outer + i * stride_inner;
            float *dst = out + (o * inner + i) * n;
            float acc[LANES] = {0};
            long e = 0;
            for (; e + LANES <= n; e += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += row[e + l] * row[e + l];
            for (int l = 0; e + l < n; l++) acc[l] += row[e + l] * row[e + l];
            for (int width = LANES / 2; width > 0; width /= 2)
                for (int l = 0; l < width; l++) acc[l] += acc[l + width];
            const float scale = 1.0f / sqrtf(acc[0] / (float)n + eps);
            for (long j = 0; j < n; j++) dst[j] = row[j] * scale * weight[j];
        }
    }
}

/* exp(x): +inf above float's range (a gate below -88.4 then gets silu -0, as the reference), held at
 * exp(-87.34) below it (the gate itself to rounding); NaN stays NaN. */
static inline float exp_cephes(float x) {
    const float in = x;
    x = x > 88.3762626647949f ? 88.3762626647949f : x;
    x = x < -87.3365447504f ? -87.3365447504f : x;
    const float shift = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to the nearest integer */
    const float n = (x * 1.44269504088896341f + shift) - shift;
    x = x - n * 0.693359375f;  /* ln 2 in two parts: n * 0.693359375 is exact */
    x = x - n * -2.12194440e-4f;
    const float z = x * x;
    float p = 1.9875691500E-4f;
    p = p * x + 1.3981999507E-3f;
    p = p * x + 8.3334519073E-3f;
    p = p * x + 4.1665795894E-2f;
    p = p * x + 1.6666665459E-1f;
    p = p * x + 5.0000001201E-1f;
    p = p * z + x + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n, n in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return in > 88.3762626647949f ? INFINITY : p * scale;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
#define ROWWISE_SILU_AVX2 1
/* exp_cephes on 8 lanes, operation for operation (no FMA: products and sums rounded as the scalar
 * code rounds them), so each lane's bits are the scalar function's. WHY: under AVX2 GCC leaves the
 * scalar loop unvectorized ("control flow in loop"; with AVX-512 it vectorizes it itself, masked), and SiLU-and-mul then cost ~11 ns an element a thread: a
 * tenth of a 64-row decode step, about as much in a prefill. The clamps are min/max with the bound
 * first, which keep a NaN lane NaN as the scalar comparisons do; the conversion of the rounded n to
 * an integer truncates, as the scalar cast does. */
static inline __m256 exp_cephes8(__m256 x) {
    const __m256 in = x;
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
    x = _mm256_max_ps(_mm256_set1_ps(-87.3365447504f), x);
    const __m256 shift = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), shift),
                                   shift);
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, z), x), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    const __m256 over = _mm256_cmp_ps(in, _mm256_set1_ps(88.3762626647949f), _CMP_GT_OQ);
    return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), over);
}
#endif

void trillium_silu_and_mul(const float *x, long rows, long inter, long stride, float *out, int num_threads) {
#pragma omp parallel for schedule(dynamic, 16) num_threads(team(rows * inter, num_threads))
    for (long r = 0; r < rows; r++) {
        const float *gate = x + r * stride, *up = gate + inter;
        float *dst = out + r * inter;
        long j = 0;
#if defined(ROWWISE_SILU_AVX2)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= inter; j += 8) {
            const __m256 g = _mm256_loadu_ps(gate + j);
            const __m256 e = exp_cephes8(_mm256_xor_ps(g, sign));
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + j)));
        }
#endif
        for (; j < inter; j++) dst[j] = gate[j] / (1.0f + exp_cephes(-gate[j])) * up[j];
    }
}

/* x [T, H, D] rows at (stride_t, stride_h), positions [T], table [P, D]. Returns -1, having written
 * nothing, when a position is outside the table; else 0. */
int trillium_rope(const float *x, long t, long h, long d, long stride_t, long stride_h, const int64_t *positions,
                  const float *table, long table_rows, float *out, int num_threads) {
    const long half = d / 2;
    for (long i = 0; i < t; i++)
        if (positions[i] < 0 || positions[i] >= table_rows) return -1;
#pragma omp parallel for schedule(dynamic, 16) num_threads(team(t * h * d, num_threads))
    for (long i = 0; i < t; i++) {
        const float *cos = table + positions[i] * d, *sin = cos + half;
        for (long j = 0; j < h; j++) {
            const float *row = x + i * stride_t + j * stride_h;
            float *dst = out + (i * h + j) * d;
            for (long e = 0; e < half; e++) {
                const float x1 = row[e], x2 = row[half + e];
                dst[e] = x1 * cos[e] - x2 * sin[e];
                dst[half + e] = x2 * cos[e] + x1 * sin[e];
            }
        }
    }
    return 0;
}
