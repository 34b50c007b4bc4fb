/* float32 linear layers for a few activation rows on CPU: y[m, n] = x[m, :] . w[n, :] (+ bias[n]).
 *
 * Built at first use by trillium/kernels/dense_cpu.py (the system C compiler, -O3 -march=native,
 * -ffp-contract=fast, OpenMP; no torch headers) and called through ctypes.
 *
 * WHY a kernel of our own for a few rows: a decode step at batch 1-8 is a chain of matrix-vector
 * products, bound by reading the weights once from memory. oneDNN's and MKL's small-M paths read
 * several weight rows at once in interleaved short streams, which the hardware prefetcher follows
 * badly: on the 2-core AMD EPYC we benchmark on they read the bench model's 110 MB of float32
 * weights at ~8 GB/s where a plain sum over the same bytes reads 13-15 GB/s. Here each thread takes
 * chunks of consecutive output channels and walks their rows in order, a long sequential stream;
 * each weight row (K floats, in L1) is multiplied by every activation row before the next is read.
 *
 * Layout: x [M, K] rows x_stride floats apart (stride 1 within a row), w [N, K] contiguous, bias [N]
 * or NULL, y [M, N] contiguous. The result equals x @ w.T up to float32 summation order.
 */
#include <stddef.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define TILE_M 4 /* activation rows multiplied per pass over a weight row */
/* Weight rows a thread takes at a time (64 x 2 KB at K = 512: a long sequential stream). WHY
 * dynamic: on a small machine the other processes of the server (scheduler, detokenizer, api) take
 * a core now and then; with a static split the thread whose core was taken holds up the whole
 * product, with chunks the other thread takes over its rows (measured with a process busy a
 * quarter of the time beside the bench model's linears: 9.1 against 10.3 ms a step; quiet, a tie). */
#define CHUNK_ROWS 64

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One activation row: four independent accumulators so the FMA latency never stalls the stream. */
static inline float dot1(const float *restrict w, const float *restrict x, long k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; i++) s += w[i] * x[i];
    return s;
}

/* `rows` (2..TILE_M) activation rows against one weight row, each weight vector loaded once. */
static inline void dot_tile(const float *restrict w, const float *restrict x, long xs, int rows, long k,
                            float *restrict out) {
    __m256 a[TILE_M][2];
    for (int r = 0; r < TILE_M; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int r = 0; r < rows; r++) {
            a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * xs + i), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * xs + i + 8), a[r][1]);
        }
    }
    for (; i + 8 <= k; i += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + i);
        for (int r = 0; r < rows; r++) a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * xs + i), a[r][0]);
    }
    for (int r = 0; r < rows; r++) {
        float s = hsum8(_mm256_add_ps(a[r][0], a[r][1]));
        for (long j = i; j < k; j++) s += w[j] * x[r * xs + j];
        out[r] = s;
    }
}
#else
static inline float dot1(const float *restrict w, const float *restrict x, long k) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < k; i++) s += w[i] * x[i];
    return s;
}

static inline void dot_tile(const float *restrict w, const float *restrict x, long xs, int rows, long k,
                            float *restrict out) {
    for (int r = 0; r < rows; r++) out[r] = dot1(w, x + r * xs, k);
}
#endif

/* Returns 0, or -1 for a shape it does not take. */
int trillium_f32_linear(const float *x, long m, long k, long x_stride, const float *w, long n,
                        const float *bias, float *y, int num_threads) {
    if (m <= 0 || k <= 0 || n <= 0 || x_stride < k) return -1;
    /* WHY a floor: below ~64K multiply-adds a thread team's wake-up costs more than it saves. */
    const int threads = n * k < (1L << 16) || num_threads < 1 ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
        float part[TILE_M];
#pragma omp for schedule(dynamic, 1)
        for (long c = 0; c < (n + CHUNK_ROWS - 1) / CHUNK_ROWS; c++) {
            const long end = (c + 1) * CHUNK_ROWS < n ? (c + 1) * CHUNK_ROWS : n;
            for (long j = c * CHUNK_ROWS; j < end; j++) {
                const float *wr = w + j * k;
                const float b = bias ? bias[j] : 0.0f;
                if (m == 1) {
                    y[j] = dot1(wr, x, k) + b;
                    continue;
                }
                for (long r = 0; r < m; r += TILE_M) {
                    const int rows = m - r < TILE_M ? (int)(m - r) : TILE_M;
                    dot_tile(wr, x + r * x_stride, x_stride, rows, k, part);
                    for (int i = 0; i < rows; i++) y[(r + i) * n + j] = part[i] + b;
                }
            }
        }
    }
    return 0;
}
