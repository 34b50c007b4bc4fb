/* float32 linear layers on weights packed once into panels: y[m, n] = x[m, :] . w[n, :] (+ bias[n]).
 *
 * Built at first use by trillium/kernels/panel_cpu.py (the system C compiler, -O3 -march=native,
 * -ffp-contract=fast, OpenMP; no torch headers) and called through ctypes. AVX-512F only: the
 * Python side loads it on such a CPU that is not Intel's (it was measured on a Zen 4 alone).
 *
 * WHY: a decode step of more than 16 rows (a batch of that many sequences) is past the reach of
 * dense_cpu.c's tiles on a Zen 4, and oneDNN's matmul on its packed copy ran the bench model's 33
 * linears (110 MB of weights, read from memory as in a decode step) at 126-165 GFLOP/s at 16-64
 * rows, ~65-85% of what the two cores do on weights held in cache. This kernel streams each weight
 * once from memory and keeps each weight vector it loads in a register for MR rows:
 * bench/dense_linear.py's panel column. Prefill chunks (hundreds of rows) run here too: level with
 * oneDNN alone, ahead served (panel_cpu.py has the figures).
 *
 * Layout: the weight w [N, K] is packed once (trillium_panel_pack) into panels of NR = 48 output
 * channels: panel p holds w[p*NR + c][i] at [i][c] (c < NR, zeros past N), so a panel is one
 * contiguous stream of K x 48 floats and the panels follow each other. A tile is MR = 8 activation
 * rows by a panel: 24 512-bit accumulators (8 rows x 3 vectors of 16 channels); each step of K
 * loads the panel's 3 vectors and broadcasts the 8 rows' values, 24 FMAs. With more than 8 rows the
 * panel (96 KB at K = 512) is read again from L2 for each tile of rows.
 *
 * Every output is one FMA chain over K in order, starting from zero (then + bias): a row's result
 * does not depend on the rows beside it, their count, the tile it falls in, or the threads (the
 * tests check it). The bits differ from dense_cpu.c's (two accumulators and a horizontal sum) and
 * from oneDNN's.
 *
 * Threads share out (panel, tile of rows) items, a block of rows at a time (trillium_panel_linear).
 */
#include <stddef.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NR 48 /* output channels a panel holds: 3 vectors of 16 */
#define MR 8  /* activation rows a tile multiplies: with 3 vectors, 24 of the 32 registers hold sums */
#define ROW_BLOCK 256 /* rows the panels stream past at a time (a multiple of MR) */

/* The build's panel width (0: not built for AVX-512F, nothing else here works). */
int trillium_panel_width(void) {
#if defined(__AVX512F__)
    return NR;
#else
    return 0;
#endif
}

/* out [ceil(n / NR) * k * NR] <- w [n, k] (rows k floats apart) in panels; zeros past n. */
void trillium_panel_pack(const float *w, long n, long k, float *out, int threads) {
    const long panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < panels; p++) {
        float *dst = out + p * k * NR;
        for (long c = 0; c < NR; c++) {
            const long j = p * NR + c;
            if (j < n) {
                const float *src = w + j * k;
                for (long i = 0; i < k; i++) dst[i * NR + c] = src[i];
            } else {
                for (long i = 0; i < k; i++) dst[i * NR + c] = 0.0f;
            }
        }
    }
}

#if defined(__AVX512F__)
/* R rows (R <= MR) of x (rows xs floats apart) times one panel b [k][NR]: y's `cols` <= NR
 * channels of each row (rows n floats apart). */
static inline __attribute__((always_inline)) void tile(const float *restrict x, long xs, const float *restrict b,
                                                       long k, const float *restrict bias, float *restrict y,
                                                       long n, long cols, const int R) {
    __m512 acc[MR][3];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 3; q++) acc[r][q] = _mm512_setzero_ps();
    for (long i = 0; i < k; i++) {
        const __m512 b0 = _mm512_loadu_ps(b + i * NR), b1 = _mm512_loadu_ps(b + i * NR + 16),
                     b2 = _mm512_loadu_ps(b + i * NR + 32);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * xs + i]);
            acc[r][0] = _mm512_fmadd_ps(xv, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xv, b2, acc[r][2]);
        }
    }
    __m512 bv[3];
    for (int q = 0; q < 3; q++) bv[q] = _mm512_setzero_ps();
    if (bias != NULL) { /* a partial panel's bias through masked loads: nothing read past n */
        for (int q = 0; q < 3; q++) {
            const long live = cols - 16 * q;
            if (live >= 16) bv[q] = _mm512_loadu_ps(bias + 16 * q);
            else if (live > 0) bv[q] = _mm512_maskz_loadu_ps((__mmask16)((1u << live) - 1u), bias + 16 * q);
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 3; q++) {
            const __m512 v = bias != NULL ? _mm512_add_ps(acc[r][q], bv[q]) : acc[r][q];
            const long live = cols - 16 * q;
            if (live >= 16) _mm512_storeu_ps(y + r * n + 16 * q, v);
            else if (live > 0) _mm512_mask_storeu_ps(y + r * n + 16 * q, (__mmask16)((1u << live) - 1u), v);
        }
}

/* WHY a function per row count: with R a constant each function keeps its accumulators in registers
 * (dense_cpu.c's notes: a variable count left them on the stack). */
#define TILE_ROWS(R)                                                                                   \
    static __attribute__((noinline)) void tile_##R(const float *x, long xs, const float *b, long k,   \
                                                   const float *bias, float *y, long n, long cols) {   \
        tile(x, xs, b, k, bias, y, n, cols, R);                                                        \
    }
TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6) TILE_ROWS(7) TILE_ROWS(8)
typedef void (*tile_fn)(const float *, long, const float *, long, const float *, float *, long, long);
static const tile_fn TILES[MR + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};
#endif

/* y [m, n] <- x [m, k] (rows xs floats apart) @ w.T (+ bias [n] or NULL), w packed by
 * trillium_panel_pack. 0, or -1 (nothing written) for sizes it does not take or a build without
 * AVX-512F. */
int trillium_panel_linear(const float *x, long m, long k, long xs, const float *packed, long n, const float *bias,
                          float *y, int threads) {
#if defined(__AVX512F__)
    if (m <= 0 || k <= 0 || n <= 0 || xs < k) return -1;
    const long panels = (n + NR - 1) / NR, tiles = (m + MR - 1) / MR;
    /* WHY items of a panel by a tile of rows, in panel order, handed out by OpenMP's guided schedule:
     * with few panels (11 at N = 512) a panel's tiles can go to both threads instead of one thread
     * taking a whole panel more (6 against 5: the 512x512 projection at 64 rows ran at ~105 GFLOP/s
     * served), and a thread the OS pauses (the server's other processes share the cores) does not
     * hold the other at the barrier with half the work left; the first chunks are long runs of
     * panels, each thread one sequential stream.
     * WHY blocks of ROW_BLOCK rows, one after the other: a prefill chunk's rows (x) are read again
     * for every panel; a block's rows (256 x K floats) stay in cache while the panels stream by. */
#pragma omp parallel num_threads(threads)
    for (long t0 = 0; t0 < tiles; t0 += ROW_BLOCK / MR) {
        const long block = tiles - t0 < ROW_BLOCK / MR ? tiles - t0 : ROW_BLOCK / MR;
#pragma omp for schedule(guided)
        for (long it = 0; it < panels * block; it++) {
            const long p = it / block, r0 = (t0 + it % block) * MR;
            const long cols = n - p * NR < NR ? n - p * NR : NR;
            const int rows = m - r0 < MR ? (int)(m - r0) : MR;
            TILES[rows](x + r0 * xs, xs, packed + p * k * NR, k, bias == NULL ? NULL : bias + p * NR,
                        y + r0 * n + p * NR, n, cols);
        }
    }
    return 0;
#else
    (void)x, (void)m, (void)k, (void)xs, (void)packed, (void)n, (void)bias, (void)y, (void)threads;
    return -1;
#endif
}
