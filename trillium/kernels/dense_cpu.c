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
 * chunks of consecutive output channels and walks their rows in order, a long sequential stream.
 *
 * Rows per pass: up to TILE_M activation rows are multiplied by each weight row as it streams by
 * (more rows: a pass per tile over the chunk's weight rows, then in L2). WHY a function per row
 * count: with a variable count the compiler kept the tile's accumulators on the stack, and
 * 8 rows cost 5x one (512x1536, 1 thread: 142 us at 1 row, 730 at 8); with the count a constant
 * they live in registers (the bench model's 33 linears, 1 thread: 16 rows 25 -> 14 ms). Each
 * function is noinline, so each gets its own register allocation.
 *
 * Every row is computed alike whatever the row count, its place in a tile, or the threads: two
 * accumulators of one vector each (alternate vectors of K), the tail through a masked load into
 * the first, one horizontal sum. So a row's result is the same bits at M = 1 and inside a batch or
 * a speculative verify step (the tests check it): a verify row equals its decode step.
 *
 * Layout: x [M, K] rows x_stride floats apart (stride 1 within a row), w [N, K] contiguous, bias [N]
 * or NULL, y [M, N] contiguous. The result equals x @ w.T up to float32 summation order.
 *
 * Two builds of the tiles. The 256-bit one below is tuned on a Zen 4 (512-bit ops in two halves).
 * With TRILLIUM_DENSE_512 (dense_cpu.py passes it on an Intel CPU with AVX-512, where 512-bit FMAs
 * run at full width) the tiles are 512-bit and two-dimensional (see WIDE_ROWS), and dense_cpu.py
 * sends it up to 64 rows (the 256-bit build too on AVX2 without AVX-512; 16 on a Zen 4). Either build keeps the rule above: a row's result does not
 * depend on the rows or weight rows beside it, nor on the threads.
 */
#include <stddef.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(TRILLIUM_DENSE_512) && defined(__AVX512F__)
#define DENSE_VECTOR_BITS 512
/* WHY two-dimensional tiles of single accumulators: a tile is WIDE_ROWS activation rows by WIDE_COLS
 * weight rows, one 512-bit accumulator per output (24 of the 32 registers), so each weight vector
 * loaded feeds 8 FMAs and each activation vector 3. With more than 8 rows a chunk's weight rows
 * are read again from L2 for each tile of rows. One accumulator per output (not two as in the
 * 256-bit tiles): with 24 outputs in flight the FMAs' latency is hidden, and a weight row alone
 * (J = 1 at a chunk's end) is no slower than the stream. Each output is the sum of its products in
 * K order, then its 16 lanes summed in _mm512_reduce_add_ps's tree (reduce_8: a weight row's 8
 * outputs at once), whatever the tile's shape: the bits do not depend on the tile.
 * bench/dense_linear.py on the 2-core Intel Xeon (AVX-512) we benchmark on, ms per step of the
 * bench model's 33 linears at 2 threads, 256-bit 4-row tiles -> these (oneDNN in brackets):
 * 1 row 3.7-4.0 -> 2.9-3.6 (4.9-5.3; noisy, bound by memory), 8 rows 6.3-6.7 -> 4.6-4.9 (8.4),
 * 16 rows 10.1 -> 6.8-7.1 (10.1); and past 16 rows (where the 256-bit tiles stopped then): 32 rows 10.7-11.1
 * (11.9-13.3), 48 rows 14.4-15.4 (15.7-16.0), 64 rows 17.6-18.5 (18.5-19.3); 96 rows 24.9 (22.9:
 * oneDNN's). Tiles of 6x4, 5x4 and 4x4 were slower at every row count. */
#define WIDE_ROWS 8
#define WIDE_COLS 3
/* Weight rows a thread takes at a time: 128 (256 KB at K = 512) stays in L2 while every tile of rows
 * reads it; 32 and 64 were a little slower (1 row: 3.4-3.8 against 3.2 ms). */
#define WIDE_CHUNK 128
#define WIDE_PREFETCH_FLOATS 2048
/* The sums of 8 vectors, each by _mm512_reduce_add_ps's tree (lanes i + i+8, then i + i+4, then
 * (0 + 2) + (1 + 3)), so the bits are the ones that intrinsic gives (a float add commutes), but 8 at
 * once: 16 shuffles and 8 adds for 8 sums where the intrinsic takes ~8 ops each. WHY: at K = 512 the
 * per-output sums were a fifth of a tile's vector ops; the bench model's 33 linears at 8-64 rows ran
 * 1.01-1.07x (bench/dense_linear.py --against c5ba155: 64 rows 17.25 against 18.26 ms). */
static inline __attribute__((always_inline)) void reduce_8(const __m512 v[WIDE_ROWS], float out[WIDE_ROWS]) {
    __m512 h[4];
    for (int p = 0; p < 4; p++) /* [v.lo256 + v.hi256 of v[2p], of v[2p+1]] */
        h[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    /* 128-bit lane L of q0: the 4 partial sums of v[L] (v[4 + L] in q1) */
    const __m512 q0 = _mm512_add_ps(_mm512_shuffle_f32x4(h[0], h[1], 0x88), _mm512_shuffle_f32x4(h[0], h[1], 0xDD));
    const __m512 q1 = _mm512_add_ps(_mm512_shuffle_f32x4(h[2], h[3], 0x88), _mm512_shuffle_f32x4(h[2], h[3], 0xDD));
    /* lane L: [v[L] (0 + 2), v[L] (1 + 3), v[4 + L] (0 + 2), v[4 + L] (1 + 3)] */
    const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(q0, q1, 0x44), _mm512_shuffle_ps(q0, q1, 0xEE));
    /* lane L: [v[L], v[4 + L], v[L], v[4 + L]] */
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c, c, 0x88), _mm512_shuffle_ps(c, c, 0xDD));
    float lanes[16];
    _mm512_storeu_ps(lanes, d);
    for (int r = 0; r < 4; r++) {
        out[r] = lanes[4 * r];
        out[4 + r] = lanes[4 * r + 1];
    }
}

static inline __attribute__((always_inline)) void wide_tile(const float *restrict w, long j, long k,
                                                            const float *restrict x, long xs, const float *bias,
                                                            float *restrict y, long n, const int R, const int J) {
    __m512 acc[WIDE_ROWS][WIDE_COLS];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < J; q++) acc[r][q] = _mm512_setzero_ps();
    const float *restrict wr = w + j * k;
    long i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 wv[WIDE_COLS];
        for (int q = 0; q < J; q++) {
            _mm_prefetch((const char *)(wr + q * k + i + WIDE_PREFETCH_FLOATS), _MM_HINT_T1);
            wv[q] = _mm512_loadu_ps(wr + q * k + i);
        }
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * xs + i);
            for (int q = 0; q < J; q++) acc[r][q] = _mm512_fmadd_ps(wv[q], xv, acc[r][q]);
        }
    }
    if (i < k) { /* the tail through masked loads: the lanes past K are zeros and add nothing */
        const __mmask16 live = (__mmask16)((1u << (k - i)) - 1u);
        __m512 wv[WIDE_COLS];
        for (int q = 0; q < J; q++) wv[q] = _mm512_maskz_loadu_ps(live, wr + q * k + i);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(live, x + r * xs + i);
            for (int q = 0; q < J; q++) acc[r][q] = _mm512_fmadd_ps(wv[q], xv, acc[r][q]);
        }
    }
    /* A partial tile: the intrinsic per output (the same tree, so the same bits). WHY: reduce_8 sums 8
     * vectors whatever R is; with fewer live rows it saved nothing measurable. */
    if (R < WIDE_ROWS) {
        for (int r = 0; r < R; r++)
            for (int q = 0; q < J; q++)
                y[r * n + j + q] = _mm512_reduce_add_ps(acc[r][q]) + (bias ? bias[j + q] : 0.0f);
        return;
    }
    for (int q = 0; q < J; q++) { /* a full tile: a weight row's 8 outputs at once */
        __m512 v[WIDE_ROWS];
        for (int r = 0; r < WIDE_ROWS; r++) v[r] = acc[r][q];
        float sums[WIDE_ROWS];
        reduce_8(v, sums);
        const float b = bias ? bias[j + q] : 0.0f;
        for (int r = 0; r < WIDE_ROWS; r++) y[r * n + j + q] = sums[r] + b;
    }
}

typedef void (*wide_fn)(const float *, long, long, const float *, long, const float *, float *, long);
#define WIDE_FN(R, J)                                                                                          \
    static __attribute__((noinline)) void wide_##R##_##J(const float *w, long j, long k, const float *x, long xs, \
                                                         const float *bias, float *y, long n) {                  \
        wide_tile(w, j, k, x, xs, bias, y, n, R, J);                                                            \
    }
#define WIDE_FNS(R) WIDE_FN(R, 1) WIDE_FN(R, 2) WIDE_FN(R, 3)
WIDE_FNS(1) WIDE_FNS(2) WIDE_FNS(3) WIDE_FNS(4) WIDE_FNS(5) WIDE_FNS(6) WIDE_FNS(7) WIDE_FNS(8)
#define WIDE_ROW(R) {NULL, wide_##R##_1, wide_##R##_2, wide_##R##_3}
static const wide_fn WIDE[WIDE_ROWS + 1][WIDE_COLS + 1] = {
    {NULL}, WIDE_ROW(1), WIDE_ROW(2), WIDE_ROW(3), WIDE_ROW(4), WIDE_ROW(5), WIDE_ROW(6), WIDE_ROW(7), WIDE_ROW(8)};
#define CHUNK_ROWS WIDE_CHUNK

/* Weight rows j0 .. j1-1 against all m activation rows: a tile of rows at a time. */
static void chunk(const float *x, long m, long k, long xs, const float *w, long j0, long j1, const float *bias,
                  float *y, long n) {
    for (long r = 0; r < m; r += WIDE_ROWS) {
        const int rows = m - r < WIDE_ROWS ? (int)(m - r) : WIDE_ROWS;
        for (long j = j0; j < j1; j += WIDE_COLS) {
            const int cols = j1 - j < WIDE_COLS ? (int)(j1 - j) : WIDE_COLS;
            WIDE[rows][cols](w, j, k, x + r * xs, xs, bias, y + r * n, n);
        }
    }
}
#else
/* Weight rows a thread takes at a time (64 x 2 KB at K = 512: a long sequential stream). WHY
 * dynamic: on a small machine the other processes of the server (scheduler, detokenizer, api) take
 * a core now and then; with a static split the thread whose core was taken holds up the whole
 * product, with chunks the other thread takes over its rows (measured with a process busy a
 * quarter of the time beside the bench model's linears: 9.1 against 10.3 ms a step; quiet, a tie). */
#define CHUNK_ROWS 64

/* WHY 256-bit vectors where AVX-512 is there too, and 4 rows a tile: on the Zen 4 we benchmark on
 * (512-bit ops in two halves) 512-bit vectors with 8-row tiles ran the bench model's 33 linears
 * slower at every row count (1 thread, 8 rows: 10.7 against 8.7 ms; 16 rows: 17.1 against 13.8),
 * and 256-bit tiles of 6 or 8 rows slower than tiles of 4 (8 rows: 10.5 and 13.6 ms). */
/* WHY a software prefetch, 8 KB ahead into L2, one cache line per inner iteration (each iteration
 * reads one line of w): with the hardware prefetcher alone a core with a few rows' FMAs in flight
 * stops running ahead of the stream, and every row past the first cost almost as much as the first.
 * bench/dense_linear.py (the bench model's 33 linears, 110 MB) on the 2-core AMD EPYC, ms a step
 * without -> with: 2 threads 3.85 -> 2.38 at 1 row, 4.8 -> 2.3 at 2, 6.8 -> 2.6 at 4, 8.4 -> 4.7 at 8;
 * 1 thread 8.1-8.6 -> 4.2-9.2 at 1 row (noisy), 9.6-10.6 -> 4.3-5.6 at 2, 12.8 -> 5.5 at 4. Into
 * L1 (_MM_HINT_T0) it helped less and less reliably; 4-32 KB ahead were alike. Past w's end the
 * hint reads nothing (no fault). It changes no arithmetic: the bits are the same. */
#define PREFETCH_FLOATS 2048
/* 16 vector registers: 4 rows x 2 accumulators + 2 weight vectors, room to spare */
#define TILE_M 4
#if defined(__AVX2__) && defined(__FMA__)
#define W 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
static inline __m256 tail8(const float *p, long n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane));
}
#define VTAIL(p, n) tail8(p, n)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VSUM(v) hsum8(v)
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* R activation rows (R a constant after inlining) against weight rows j0 .. j1-1. */
static inline __attribute__((always_inline)) void rows_tile(const float *restrict w, long j0, long j1, long k,
                                                            const float *restrict x, long xs, const float *bias,
                                                            float *restrict y, long n, const int R) {
    for (long j = j0; j < j1; j++) {
        const float *restrict wr = w + j * k;
        vec a0[TILE_M], a1[TILE_M];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = VZERO();
        long i = 0;
        for (; i + 2 * W <= k; i += 2 * W) {
            _mm_prefetch((const char *)(wr + i + PREFETCH_FLOATS), _MM_HINT_T1);
            const vec w0 = VLOAD(wr + i), w1 = VLOAD(wr + i + W);
            for (int r = 0; r < R; r++) {
                a0[r] = VFMA(w0, VLOAD(x + r * xs + i), a0[r]);
                a1[r] = VFMA(w1, VLOAD(x + r * xs + i + W), a1[r]);
            }
        }
        if (i + W <= k) {
            const vec w0 = VLOAD(wr + i);
            for (int r = 0; r < R; r++) a0[r] = VFMA(w0, VLOAD(x + r * xs + i), a0[r]);
            i += W;
        }
        if (i < k) {
            const vec w0 = VTAIL(wr + i, k - i);
            for (int r = 0; r < R; r++) a1[r] = VFMA(w0, VTAIL(x + r * xs + i, k - i), a1[r]);
        }
        const float b = bias ? bias[j] : 0.0f;
        for (int r = 0; r < R; r++) y[r * n + j] = VSUM(VADD(a0[r], a1[r])) + b;
    }
}
#else
/* No vector extension the kernel knows: plain loops, each row's sum in one order whatever R is. */
static inline void rows_tile(const float *restrict w, long j0, long j1, long k, const float *restrict x, long xs,
                             const float *bias, float *restrict y, long n, const int R) {
    for (long j = j0; j < j1; j++)
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (long i = 0; i < k; i++) s += w[j * k + i] * x[r * xs + i];
            y[r * n + j] = s + (bias ? bias[j] : 0.0f);
        }
}
#endif

typedef void (*tile_fn)(const float *, long, long, long, const float *, long, const float *, float *, long);
#define TILE_FN(R)                                                                                         \
    static __attribute__((noinline)) void tile_##R(const float *w, long j0, long j1, long k, const float *x, \
                                                   long xs, const float *bias, float *y, long n) {          \
        rows_tile(w, j0, j1, k, x, xs, bias, y, n, R);                                                      \
    }
TILE_FN(1)
TILE_FN(2)
TILE_FN(3)
TILE_FN(4)
static const tile_fn TILES[TILE_M + 1] = {NULL, tile_1, tile_2, tile_3, tile_4};

static void chunk(const float *x, long m, long k, long xs, const float *w, long j0, long j1, const float *bias,
                  float *y, long n) {
    for (long r = 0; r < m; r += TILE_M) {
        const long rows = m - r < TILE_M ? m - r : TILE_M;
        TILES[rows](w, j0, j1, k, x + r * xs, xs, bias, y + r * n, n);
    }
}
#if defined(__AVX2__) && defined(__FMA__)
#define DENSE_VECTOR_BITS 256
#else
#define DENSE_VECTOR_BITS 0
#endif
#endif /* TRILLIUM_DENSE_512 */

/* The tiles' vector width in bits: 512, 256, or 0 for plain loops (dense_cpu.py reports it). */
int trillium_f32_linear_vector_bits(void) { return DENSE_VECTOR_BITS; }

/* Returns 0, or -1 for a shape it does not take. */
int trillium_f32_linear(const float *x, long m, long k, long x_stride, const float *w, long n,
                        const float *bias, float *y, int num_threads) {
    if (m <= 0 || k <= 0 || n <= 0 || x_stride < k) return -1;
    /* WHY a floor: below ~64K multiply-adds a thread team's wake-up costs more than it saves. */
    const int threads = n * k < (1L << 16) || num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long c = 0; c < (n + CHUNK_ROWS - 1) / CHUNK_ROWS; c++) {
        const long j0 = c * CHUNK_ROWS, j1 = j0 + CHUNK_ROWS < n ? j0 + CHUNK_ROWS : n;
        chunk(x, m, k, x_stride, w, j0, j1, bias, y, n);
    }
    return 0;
}
