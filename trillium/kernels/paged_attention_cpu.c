/* Decode attention on CPU over the paged KV cache, read in place (no gathered copy); and, at the end of
 * the file, causal prefill attention of a prompt's first chunk over its own keys
 * (trillium_fresh_prefill_attention) and of a later chunk over the keys in the paged cache
 * (trillium_paged_prefill_attention).
 *
 * Built at first use by trillium/kernels/paged_attention_cpu.py through c_library.py (the system C
 * compiler, -O3 -march=native, -ffp-contract=fast, OpenMP) and called through ctypes.
 *
 * Query rows that each attend like a decode token. Layout (trillium/kernels/metadata.py):
 *
 *   q        [B, H, D] float32 (B query rows), rows / heads at any stride, D contiguous
 *   k, v     [num_blocks, block_size, KH, D] float32, or fp8 bytes widened through a 256-entry table
 *   table    [S, table_stride] int32 block ids; seq_lens [B] int32: keys row r attends (the row sits
 *            at seq_lens[r] - 1)
 *   row_seq  [B] int32: the table row of each query row; NULL: row r is sequence r (a pure decode step,
 *            B == S). Several rows of one sequence (a speculative verify step: the last token and its
 *            drafts) are several rows with the same row_seq and lengths n, n + 1, ...: causal.
 *   out      [B, H, D] float32, contiguous
 *
 * Semantics are those of reference.paged_attention for a decode row: keys 0 .. n-1 (with a sliding
 * window only n - window .. n-1, and blocks wholly behind it are never read), scores q.k * scale
 * (times k_scale for fp8), soft-capped as cap * tanh(s / cap) when cap > 0, softmax, times V (times
 * v_scale for fp8). Slots past a sequence's end are never read.
 *
 * Work item: one chunk of CHUNK_KEYS keys of one query row (chunks at fixed key positions 0, 64,
 * 128, ... so a row's chunks depend only on its own length and window, never on the batch or the
 * threads: a verify row and the decode step of the same position split alike), every head of the
 * row: each slot's [KH, D] row is read once, front to back, as the blocks lie. Per head, online
 * softmax one block at a time: the block's scores, the running max raised once per block, the
 * accumulators rescaled once per block (not per key); the GQA group's heads share each K / V row.
 * Chunks are split across OpenMP threads (claimed from a shared counter, as lengths differ), so one
 * long sequence still keeps every thread busy. A row of one chunk is finished as
 * before (acc / l); several chunks are merged in key order (flash-decoding's split-K: each chunk's
 * acc and l rescaled to the largest max). While a block is read the next one's K and V rows are
 * prefetched into L2 a slice per head (prefetch_slice), and while a chunk's last block is read, the
 * first block of the chunk the thread takes next (claimed one ahead, where there are at least two
 * chunks a thread). On the 2-core AMD EPYC (Zen 3)
 * we benchmark on, 8 layers of the bench model, 400 keys a row, 2 threads, against the whole next
 * block prefetched into L1 at each block's start and nothing across chunks: 64 rows 30.3 -> 25.1 ms a
 * forward, 1 thread 60.6 -> 50.3 (the same blocks read from cache: ~19 ms, so the rest is waiting on
 * memory).
 *
 * Vectorization: plain loops under `omp simd` (a reduction for the dot products; no intrinsics, so
 * any -march builds it), and a polynomial exp (Cephes expf's, ~1 ulp). Under AVX-512 a float32 cache
 * with head dim 64 or 128 takes attend_chunk_fixed instead: 16 keys' dot products summed across lanes
 * in one tree (sum16x16), the block's softmax in 16-lane registers, each head's accumulator held in
 * registers over the block (same fused multiply-adds in the same key order as the plain loop); under
 * AVX2 without AVX-512 the same in 8-lane registers (attend_chunk_fixed8, 8 keys a tree). A
 * key's score never depends on which keys share its group, so verify rows still equal their decode
 * steps bit for bit. SmolLM2-135M, 1 thread: a decode step's attention 4.5 -> 2.7 ms, a 5-row verify
 * step's 7.8 -> 6.0 ms (torch profiler, compiled decode).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TRILLIUM_ATTENTION_AVX2 1
#endif

/* exp(x) for x <= 0 (a score minus the running max), ~1 ulp; x below -87 gives ~1e-38, not 0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return y * two_n;
}

/* Row `slot` of head `kvh` as float32: the cache row itself, or widened into buf through lut. */
static inline const float *kv_row(const void *cache, const float *lut, long slot, long kvh, long kh, long d,
                                  float *restrict buf) {
    const long at = (slot * kh + kvh) * d;
    if (lut == NULL) return (const float *)cache + at;
    const uint8_t *bytes = (const uint8_t *)cache + at;
    for (long i = 0; i < d; i++) buf[i] = lut[bytes[i]];
    return buf;
}

typedef struct {
    const void *k, *v;
    const float *lut;
    long bs, kh, d, g, elem;  /* elem: bytes per cache element (4, or 1 for fp8) */
    float scale, softcap;
} Cache;

/* Keys per work item (see the header): a row's chunks are [0, 64), [64, 128), ... cut to its keys. */
#define CHUNK_KEYS 64

/* Slice `part` of `parts` of block `block`'s K rows (v == 0) or V rows (v == 1), prefetched into L2 (block < 0:
 * nothing). A walker prefetches the next block a slice at a time while it reads this one (a head's slice as
 * it scores or sums that head), so the loads overlap its arithmetic. WHY slices, and L2: the whole next
 * block at once (32 KB at the bench model's shape) filled the core's miss buffers and stalled it until
 * the block had arrived, so reading and computing took turns; and prefetched into L1 it pushed out the
 * block being read, which every head reads again. */
static inline void prefetch_slice(const Cache *c, long block, int v, long part, long parts) {
    if (block < 0) return;
    const long bytes = c->bs * c->kh * c->d * c->elem;
    const char *base = (const char *)(v ? c->v : c->k) + block * bytes;
    for (long at = (bytes * part / parts) & ~63L; at < bytes * (part + 1) / parts; at += 64)
        __builtin_prefetch(base + at, 0, 2);
}

/* A work item's state before its first key: each head's running max -inf, its sum 0, its
 * accumulator (h_all heads of d values) zeros. */
static inline void start_item(long h_all, long d, float *restrict acc, float *restrict m, float *restrict l) {
    for (long h = 0; h < h_all; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
    memset(acc, 0, (size_t)(h_all * d) * sizeof(float));
}

/* Block bi of a row's keys start .. end-1 (its blocks: start / bs onwards while bi * bs < end): the
 * cache slot of the block's first key in that range, *nk its keys there, *next the block to prefetch
 * while this one is read: the item's next block, or after its last the first block of the thread's next
 * item (`after`, -1: none). */
static inline long block_first_slot(const Cache *c, const int32_t *table, long bi, long start, long end, long after,
                                    long *nk, long *next) {
    const long bs = c->bs;
    *next = (bi + 1) * bs < end ? table[bi + 1] : after;
    const long lo = start > bi * bs ? start - bi * bs : 0, hi = end - bi * bs < bs ? end - bi * bs : bs;
    *nk = hi - lo;
    return (long)table[bi] * bs + lo;
}

/* Gemma-style soft-capping of a head's nk scores, when the model has it. */
static inline void softcap_scores(const Cache *c, float *restrict sh, long nk) {
    if (c->softcap > 0.0f)
        for (long t = 0; t < nk; t++) sh[t] = c->softcap * tanhf(sh[t] / c->softcap);
}

/* A head's running max *m rose to mx: what it accumulated (ah, d values, and its sum *l) is rescaled
 * by exp(*m - mx), once per block (not per key). */
static inline void raise_max(float *restrict ah, long d, float *m, float *l, float mx) {
    const float corr = *m == -INFINITY ? 0.0f : expf(*m - mx);
#pragma omp simd
    for (long i = 0; i < d; i++) ah[i] *= corr;
    *l *= corr;
    *m = mx;
}

/* One row's n scores (sr, scaled) -> their exp against its running max *m, the max raised and what
 * the row accumulated (accr, d values, and its sum *l) rescaled, the sum added. */
static inline void softmax_row(float *restrict sr, long n, float *restrict accr, long d, float *m, float *l) {
    float mx = *m, sum = 0.0f;
    for (long t = 0; t < n; t++) mx = sr[t] > mx ? sr[t] : mx;
#pragma omp simd reduction(+ : sum)
    for (long t = 0; t < n; t++) {
        sr[t] = exp_nonpositive(sr[t] - mx);
        sum += sr[t];
    }
    if (mx != *m) raise_max(accr, d, m, l, mx);
    *l += sum;
}

/* One block's nk scores per head (s[h * bs + t], scaled), soft-capped where the model has it, through
 * softmax_row. */
static inline void block_softmax(const Cache *c, long nk, float *restrict s, float *restrict acc,
                                 float *restrict m, float *restrict l) {
    const long bs = c->bs, d = c->d, h_all = c->kh * c->g;
    for (long h = 0; h < h_all; h++) {
        softcap_scores(c, s + h * bs, nk);
        softmax_row(s + h * bs, nk, acc + h * d, d, &m[h], &l[h]);
    }
}

#if defined(__AVX512F__)
/* The first n lanes of 16 (n >= 16: all). */
static inline __mmask16 first_lanes(long n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* exp_nonpositive on 16 lanes: the same steps (clamp, n = floor(x log2 e + 1/2), the Cephes polynomial,
 * times 2^n). */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

/* Lane t of the result: the sum of the 16 lanes of a[t], every t summed in the same tree
 * ((lane i + lane i+2) + (i+1 + i+3) within each 128-bit quarter, then the quarters (0 + 2) + (1 + 3)),
 * so a key's score does not depend on which keys share its group. */
static inline __m512 sum16x16(const __m512 *a) {
    __m512 b[8], c4[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c4[2 * i], c4[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(c4[2 * i], c4[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

/* softmax_row in 16-lane registers (lanes past n masked off); the rescale is softmax_row's own. */
static inline void softmax_row16(float *restrict sr, long n, float *restrict accr, long d, float *m, float *l) {
    __m512 vmx = _mm512_set1_ps(*m);
    for (long t = 0; t < n; t += 16) {
        const __mmask16 k = first_lanes(n - t);
        vmx = _mm512_mask_max_ps(vmx, k, vmx, _mm512_maskz_loadu_ps(k, sr + t));
    }
    const float mx = _mm512_reduce_max_ps(vmx);
    __m512 vsum = _mm512_setzero_ps();
    for (long t = 0; t < n; t += 16) {
        const __mmask16 k = first_lanes(n - t);
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + t), _mm512_set1_ps(mx)));
        _mm512_mask_storeu_ps(sr + t, k, e);
        vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
    }
    if (mx != *m) raise_max(accr, d, m, l, mx);
    *l += _mm512_reduce_add_ps(vsum);
}

/* block_softmax with softmax_row16. */
static inline void block_softmax16(const Cache *c, long nk, float *restrict s, float *restrict acc,
                                   float *restrict m, float *restrict l) {
    const long bs = c->bs, d = c->d, h_all = c->kh * c->g;
    for (long h = 0; h < h_all; h++) {
        softcap_scores(c, s + h * bs, nk);
        softmax_row16(s + h * bs, nk, acc + h * d, d, &m[h], &l[h]);
    }
}
#endif

/* One query row's keys start .. end-1 (within its n keys) for all h = kh * g heads q (scaled by the
 * caller's scale): per head the unnormalized acc[h * d], its running max m[h] and sum l[h]. */
static void attend_chunk(const Cache *c, const int32_t *table, long start, long end, long after,
                         const float *q, float *restrict acc, float *restrict m, float *restrict l,
                         float *restrict s, float *restrict buf) {
    const long bs = c->bs, d = c->d, g = c->g, kh = c->kh, h_all = kh * g;
    start_item(h_all, d, acc, m, l);
    for (long bi = start / bs; bi * bs < end; bi++) {
        long nk, next;
        const long first = block_first_slot(c, table, bi, start, end, after, &nk, &next);
        for (long t = 0; t < nk; t++) {
            prefetch_slice(c, next, 0, t, nk);
            for (long kvh = 0; kvh < kh; kvh++) {
                const float *kr = kv_row(c->k, c->lut, first + t, kvh, kh, d, buf);
                for (long j = 0; j < g; j++) {
                    const long h = kvh * g + j;
                    const float *qh = q + h * d;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (long i = 0; i < d; i++) dot += qh[i] * kr[i];
                    s[h * bs + t] = dot * c->scale;
                }
            }
        }
        block_softmax(c, nk, s, acc, m, l);
        for (long t = 0; t < nk; t++) {
            prefetch_slice(c, next, 1, t, nk);
            for (long kvh = 0; kvh < kh; kvh++) {
                const float *vr = kv_row(c->v, c->lut, first + t, kvh, kh, d, buf);
                for (long j = 0; j < g; j++) {
                    const long h = kvh * g + j;
                    const float p = s[h * bs + t];
                    float *ah = acc + h * d;
#pragma omp simd
                    for (long i = 0; i < d; i++) ah[i] += p * vr[i];
                }
            }
        }
    }
}

#if defined(__AVX512F__)
/* attend_chunk for a float32 cache with the head dim D a constant multiple of 16 (inlined into one
 * function per D): the same work in 16-lane registers. Scores: a head's query stays in registers
 * while the block's keys stream past (one vector chain and one horizontal sum per key); values: a
 * head's accumulator stays in registers over the block's keys (loaded and stored once per block,
 * not once per key), with the same fused multiply-adds in the same key order as the plain loop.
 * WHY: the plain loops spent ~150 us a layer on 300 keys of SmolLM2's 9 heads (4.5 of a 20 ms
 * decode step at 1 thread), reloading and storing each head's accumulator for every key. */
static inline __attribute__((always_inline)) void attend_chunk_fixed(const Cache *c, const int32_t *table,
                                                                     long start, long end, long after,
                                                                     const float *q,
                                                                     float *restrict acc, float *restrict m,
                                                                     float *restrict l, float *restrict s,
                                                                     const long D) {
    const long bs = c->bs, g = c->g, kh = c->kh, h_all = kh * g;
    const float *kc = (const float *)c->k, *vc = (const float *)c->v;
    start_item(h_all, D, acc, m, l);
    for (long bi = start / bs; bi * bs < end; bi++) {
        long nk, next;
        const long first = block_first_slot(c, table, bi, start, end, after, &nk, &next);
        const float *kb = kc + first * kh * D, *vb = vc + first * kh * D;
        for (long h = 0; h < h_all; h++) {
            const long kvh = h / g;
            prefetch_slice(c, next, 0, h, h_all);
            __m512 qv[D / 16];
            for (long v = 0; v < D / 16; v++) qv[v] = _mm512_loadu_ps(q + h * D + 16 * v);
            for (long t0 = 0; t0 < nk; t0 += 16) {  /* 16 keys' dot products, summed across lanes at once */
                const long n16 = nk - t0 < 16 ? nk - t0 : 16;
                __m512 a[16];
                for (long t = 0; t < 16; t++) {
                    const float *kr = kb + ((t0 + (t < n16 ? t : 0)) * kh + kvh) * D;  /* past nk: a repeat */
                    a[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
                    for (long v = 1; v < D / 16; v++) a[t] = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(kr + 16 * v), a[t]);
                }
                _mm512_mask_storeu_ps(s + h * bs + t0, first_lanes(n16),
                                      _mm512_mul_ps(sum16x16(a), _mm512_set1_ps(c->scale)));
            }
        }
        block_softmax16(c, nk, s, acc, m, l);
        for (long h = 0; h < h_all; h++) {
            const long kvh = h / g;
            prefetch_slice(c, next, 1, h, h_all);
            __m512 av[D / 16];
            float *ah = acc + h * D;
            for (long v = 0; v < D / 16; v++) av[v] = _mm512_loadu_ps(ah + 16 * v);
            for (long t = 0; t < nk; t++) {
                const __m512 p = _mm512_set1_ps(s[h * bs + t]);
                const float *vr = vb + (t * kh + kvh) * D;
                for (long v = 0; v < D / 16; v++) av[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * v), av[v]);
            }
            for (long v = 0; v < D / 16; v++) _mm512_storeu_ps(ah + 16 * v, av[v]);
        }
    }
}

static __attribute__((noinline)) void attend_chunk_d64(const Cache *c, const int32_t *table, long start, long end,
                                                       long after, const float *q, float *acc, float *m, float *l,
                                                       float *s) {
    attend_chunk_fixed(c, table, start, end, after, q, acc, m, l, s, 64);
}

static __attribute__((noinline)) void attend_chunk_d128(const Cache *c, const int32_t *table, long start, long end,
                                                        long after, const float *q, float *acc, float *m, float *l,
                                                        float *s) {
    attend_chunk_fixed(c, table, start, end, after, q, acc, m, l, s, 128);
}
#endif

#if defined(TRILLIUM_ATTENTION_AVX2)
/* The AVX2 twin of the AVX-512 path above, for CPUs without AVX-512 (AMD Zen 2 / 3, most laptops):
 * the same work in 8-lane registers, 8 keys' dot products at a time. WHY: the plain loops reload
 * and store each head's accumulator for every key and sum each dot product on its own. On the
 * 2-core AMD EPYC (Zen 3, AVX2) we benchmark on, bench/paged_decode_attention.py --against (the
 * plain loops), the bench model's 8 layers of 8 / 4 heads, 400 keys a row, 2 threads: one row
 * 0.44 -> 0.24 ms a forward, 16 rows 9.26 -> 7.11, 64 rows 35.9 -> 30.1. */

/* Lanes 0 .. n-1 of 8 set (n >= 8: all), as maskload / maskstore / blendv take them. */
static inline __m256i first_lanes8(long n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* exp_nonpositive on 8 lanes: the AVX-512 version's steps (clamp, n = floor(x log2 e + 1/2), the Cephes
 * polynomial, times 2^n). */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(y, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

/* Lane t of the result: the sum of the 8 lanes of a[t], every t in the same tree
 * (((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))), so a key's score does not depend on which keys share its group. */
static inline __m256 sum8x8(const __m256 *a) {
    const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3); /* [a0..a3 lanes 0-3 | a0..a3 lanes 4-7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

/* The 8 lanes' sum in one fixed tree. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* softmax_row in 8-lane registers (lanes past n held at the max, so their exp is 1, then masked off
 * the sum); the rescale is softmax_row's own. */
static inline void softmax_row8(float *restrict sr, long n, float *restrict accr, long d, float *m, float *l) {
    __m256 vmx = _mm256_set1_ps(*m);
    for (long t = 0; t < n; t += 8) {
        const __m256 live = _mm256_castsi256_ps(first_lanes8(n - t));
        vmx = _mm256_blendv_ps(vmx, _mm256_max_ps(vmx, _mm256_maskload_ps(sr + t, first_lanes8(n - t))), live);
    }
    __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
    const float mx = _mm_cvtss_f32(_mm_max_ss(h4, _mm_movehdup_ps(h4)));
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (long t = 0; t < n; t += 8) {
        const __m256i k = first_lanes8(n - t);
        const __m256 live = _mm256_castsi256_ps(k);
        const __m256 x = _mm256_blendv_ps(vm, _mm256_maskload_ps(sr + t, k), live);
        const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(x, vm)), live);
        _mm256_maskstore_ps(sr + t, k, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (mx != *m) raise_max(accr, d, m, l, mx);
    *l += hsum8(vsum);
}

/* block_softmax with softmax_row8. */
static inline void block_softmax8(const Cache *c, long nk, float *restrict s, float *restrict acc,
                                  float *restrict m, float *restrict l) {
    const long bs = c->bs, d = c->d, h_all = c->kh * c->g;
    for (long h = 0; h < h_all; h++) {
        softcap_scores(c, s + h * bs, nk);
        softmax_row8(s + h * bs, nk, acc + h * d, d, &m[h], &l[h]);
    }
}

/* attend_chunk for a float32 cache with the head dim D a constant multiple of 64 (inlined into one
 * function per D), as attend_chunk_fixed above: scores 8 keys at a time, one horizontal tree for the 8
 * (sum8x8); values with a head's accumulator in registers over the block's keys, 64 dims (8 registers)
 * at a time, the same fused multiply-adds in the same key order as the plain loop. */
static inline __attribute__((always_inline)) void attend_chunk_fixed8(const Cache *c, const int32_t *table,
                                                                      long start, long end, long after,
                                                                      const float *q,
                                                                      float *restrict acc, float *restrict m,
                                                                      float *restrict l, float *restrict s,
                                                                      const long D) {
    const long bs = c->bs, g = c->g, kh = c->kh, h_all = kh * g;
    const float *kc = (const float *)c->k, *vc = (const float *)c->v;
    start_item(h_all, D, acc, m, l);
    for (long bi = start / bs; bi * bs < end; bi++) {
        long nk, next;
        const long first = block_first_slot(c, table, bi, start, end, after, &nk, &next);
        const float *kb = kc + first * kh * D, *vb = vc + first * kh * D;
        for (long h = 0; h < h_all; h++) {
            const float *qh = q + h * D;
            const long kvh = h / g;
            prefetch_slice(c, next, 0, h, h_all);
            for (long t0 = 0; t0 < nk; t0 += 8) {  /* 8 keys' dot products, summed across lanes at once */
                const long n8 = nk - t0 < 8 ? nk - t0 : 8;
                __m256 a[8];
                for (long t = 0; t < 8; t++) {
                    const float *kr = kb + ((t0 + (t < n8 ? t : 0)) * kh + kvh) * D;  /* past nk: a repeat */
                    a[t] = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(kr));
                    for (long v = 1; v < D / 8; v++)
                        a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), _mm256_loadu_ps(kr + 8 * v), a[t]);
                }
                _mm256_maskstore_ps(s + h * bs + t0, first_lanes8(n8),
                                    _mm256_mul_ps(sum8x8(a), _mm256_set1_ps(c->scale)));
            }
        }
        block_softmax8(c, nk, s, acc, m, l);
        for (long h = 0; h < h_all; h++) {
            const long kvh = h / g;
            prefetch_slice(c, next, 1, h, h_all);
            for (long d0 = 0; d0 < D; d0 += 64) {
                float *ah = acc + h * D + d0;
                __m256 av[8];
                for (long v = 0; v < 8; v++) av[v] = _mm256_loadu_ps(ah + 8 * v);
                for (long t = 0; t < nk; t++) {
                    const __m256 p = _mm256_set1_ps(s[h * bs + t]);
                    const float *vr = vb + (t * kh + kvh) * D + d0;
                    for (long v = 0; v < 8; v++) av[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * v), av[v]);
                }
                for (long v = 0; v < 8; v++) _mm256_storeu_ps(ah + 8 * v, av[v]);
            }
        }
    }
}

static __attribute__((noinline)) void attend_chunk8_d64(const Cache *c, const int32_t *table, long start, long end,
                                                        long after, const float *q, float *acc, float *m, float *l,
                                                        float *s) {
    attend_chunk_fixed8(c, table, start, end, after, q, acc, m, l, s, 64);
}

static __attribute__((noinline)) void attend_chunk8_d128(const Cache *c, const int32_t *table, long start, long end,
                                                         long after, const float *q, float *acc, float *m, float *l,
                                                         float *s) {
    attend_chunk_fixed8(c, table, start, end, after, q, acc, m, l, s, 128);
}
#endif

/* One work item: the fixed-D register path where it applies, else the plain loops. */
static inline void attend(const Cache *c, const int32_t *table, long start, long end, long after, const float *q,
                          float *restrict acc, float *restrict m, float *restrict l, float *restrict s,
                          float *restrict buf) {
#if defined(__AVX512F__)
    if (c->lut == NULL && c->d == 64) return attend_chunk_d64(c, table, start, end, after, q, acc, m, l, s);
    if (c->lut == NULL && c->d == 128) return attend_chunk_d128(c, table, start, end, after, q, acc, m, l, s);
#elif defined(TRILLIUM_ATTENTION_AVX2)
    if (c->lut == NULL && c->d == 64) return attend_chunk8_d64(c, table, start, end, after, q, acc, m, l, s);
    if (c->lut == NULL && c->d == 128) return attend_chunk8_d128(c, table, start, end, after, q, acc, m, l, s);
#endif
    attend_chunk(c, table, start, end, after, q, acc, m, l, s, buf);
}

/* The first key row r attends (a sliding window cuts the front). */
static inline long first_key(long n, long window) { return window > 0 && n > window ? n - window : 0; }

/* Work item `it` (chunk it - first[r] of its row r): *tab the row's block table row, its keys
 * *start .. *end-1; returns r. */
static inline long item_span(long it, const long *item_row, const long *first, const int32_t *seq_lens,
                             const int32_t *row_seq, long window, long *tab, long *start, long *end) {
    const long r = item_row[it], n = seq_lens[r];
    const long lo = first_key(n, window), chunk = lo / CHUNK_KEYS + (it - first[r]);
    *tab = row_seq ? row_seq[r] : r;  /* r: the query row; tab: its block table */
    *start = chunk * CHUNK_KEYS > lo ? chunk * CHUNK_KEYS : lo;
    *end = (chunk + 1) * CHUNK_KEYS < n ? (chunk + 1) * CHUNK_KEYS : n;
    return r;
}

/* Returns 0, or -1 for a shape it does not take (or no memory for the chunks' partial results).
 * k_scale / v_scale: NULL or one float each (fp8); window <= 0: none; softcap <= 0: none. */
int trillium_paged_decode_attention(const float *q, long b, long h, long d, long q_row_stride,
                                    long q_head_stride, const void *k, const void *v, const float *lut,
                                    long bs, long kh, const int32_t *table, long table_stride,
                                    const int32_t *seq_lens, const int32_t *row_seq, float scale,
                                    const float *k_scale,
                                    const float *v_scale, long window, float softcap, float *out,
                                    int num_threads) {
    if (kh <= 0 || h % kh || d <= 0 || bs <= 0) return -1;
    const long g = h / kh;
    const Cache c = {k, v, lut, bs, kh, d, g, lut ? 1 : 4, scale * (k_scale ? *k_scale : 1.0f), softcap};
    const float out_scale = v_scale ? *v_scale : 1.0f;
    /* first[r]: row r's first work item (its chunks are first[r] .. first[r + 1] - 1) */
    long *first = malloc((size_t)(b + 1) * sizeof(long));
    if (first == NULL) return -1;
    long keys = 0;
    first[0] = 0;
    for (long r = 0; r < b; r++) {
        const long n = seq_lens[r], lo = first_key(n, window);
        keys += n - lo;
        first[r + 1] = first[r] + (n > lo ? (n - 1) / CHUNK_KEYS - lo / CHUNK_KEYS + 1 : 0);
    }
    const long items = first[b], part = h * (d + 2);  /* per item: acc [h, d], m [h], l [h] */
    long *item_row = malloc((size_t)(items > 0 ? items : 1) * sizeof(long));
    float *parts = malloc((size_t)(items > 0 ? items : 1) * (size_t)part * sizeof(float));
    if (item_row == NULL || parts == NULL) {
        free(first); free(item_row); free(parts);
        return -1;
    }
    for (long r = 0; r < b; r++)
        for (long it = first[r]; it < first[r + 1]; it++) item_row[it] = r;
    /* WHY a floor: below ~64K multiply-adds a thread team's wake-up costs more than it saves. */
    const int threads = keys * h * d < (1L << 16) ? 1 : num_threads;
    long handed_out = 0;  /* work items claimed so far (atomically, by every thread) */
    /* WHY only with two items a thread or more: a thread claiming ahead may take the item another thread
     * (not started yet) would have run, so with as many items as threads one could run two and another none. */
    const int ahead = items >= 2L * threads;
#pragma omp parallel num_threads(threads)
    {
        float qs[h * d], s[h * bs], buf[d];
        /* Items are claimed one ahead (dynamic: lengths differ): a thread knows the item it reads next,
         * so while it reads this one's last block it prefetches that one's first. WHY: an item is
         * 64 keys, 4 blocks of 16, so a quarter of the blocks were read cold: with the slices alone
         * 64 rows took 30.1 ms a forward, with items 4x as long 25.4, claimed ahead 25.1. */
        long it = __atomic_fetch_add(&handed_out, 1, __ATOMIC_RELAXED);
        while (it < items) {
            const long next = ahead ? __atomic_fetch_add(&handed_out, 1, __ATOMIC_RELAXED) : items;
            long tab, start, end, after = -1;
            const long r = item_span(it, item_row, first, seq_lens, row_seq, window, &tab, &start, &end);
            if (next < items) {
                long next_tab, next_start, next_end;
                item_span(next, item_row, first, seq_lens, row_seq, window, &next_tab, &next_start, &next_end);
                after = table[next_tab * table_stride + next_start / bs];
            }
            for (long j = 0; j < h; j++)
                memcpy(qs + j * d, q + r * q_row_stride + j * q_head_stride, (size_t)d * sizeof(float));
            float *p = parts + it * part;
            attend(&c, table + tab * table_stride, start, end, after, qs, p, p + h * d, p + h * d + h, s, buf);
            it = ahead ? next : __atomic_fetch_add(&handed_out, 1, __ATOMIC_RELAXED);
        }
#pragma omp barrier
        /* finish each row: one chunk as acc / l; several merged in key order at the largest max */
#pragma omp for schedule(static)
        for (long r = 0; r < b; r++) {
            const long n_items = first[r + 1] - first[r];
            const float *p0 = parts + first[r] * part;
            for (long j = 0; j < h; j++) {
                float *o = out + (r * h + j) * d;
                if (n_items == 1) {
                    const float lj = p0[h * d + h + j];
                    const float inv = lj > 0.0f ? out_scale / lj : 0.0f;
#pragma omp simd
                    for (long i = 0; i < d; i++) o[i] = p0[j * d + i] * inv;
                    continue;
                }
                float mx = -INFINITY, sum = 0.0f;
                for (long it = 0; it < n_items; it++) {
                    const float mi = p0[it * part + h * d + j];
                    mx = mi > mx ? mi : mx;
                }
                memset(o, 0, (size_t)d * sizeof(float));
                for (long it = 0; it < n_items; it++) {
                    const float *pi = p0 + it * part;
                    const float mi = pi[h * d + j];
                    if (mi == -INFINITY) continue;
                    const float w = expf(mi - mx);
                    sum += pi[h * d + h + j] * w;
#pragma omp simd
                    for (long i = 0; i < d; i++) o[i] += pi[j * d + i] * w;
                }
                const float inv = sum > 0.0f ? out_scale / sum : 0.0f;
#pragma omp simd
                for (long i = 0; i < d; i++) o[i] *= inv;
            }
        }
    }
    free(first); free(item_row); free(parts);
    return 0;
}

/* ---- Causal prefill attention over a step's own keys -------------------------------------------
 *
 * fresh_prefill.py's runs: sequences whose whole context is this step's tokens (a prompt's first
 * chunk), q [rows, H, D], k, v [rows, KH, D] straight from the qkv projection (any row and head
 * stride, D contiguous), num_seqs sequences of q_len consecutive rows; out [rows, H, D] contiguous.
 * Row p of a sequence attends to its keys 0..p (causal), scores q.k * scale, softmax, times V: the
 * math of torch's causal SDPA (which this replaces for float32 on the CPU), rounded otherwise.
 *
 * Work item: PF_QB consecutive query positions of one sequence and one KV head, for all g heads of
 * its GQA group (g * PF_QB query rows sharing every K / V row they read). Keys go in blocks of PF_KB:
 * the block's K rows transposed once into kt [D][PF_KB] (then each query row's scores are PF_KB-wide
 * vector FMAs of a broadcast query element, PF_QK_ROWS rows at a time: under AVX-512 2 vector loads
 * feed 16 FMAs), the block's V rows copied once into a contiguous buffer, the
 * block's online softmax per row (max raised once per block, the accumulator rescaled then), and
 * P.V two rows at a time (each V vector loaded once for both). Only the diagonal block is masked;
 * blocks wholly past a row's position are skipped. Items are claimed last query block first (they
 * have the most keys) with OpenMP's dynamic schedule. Under AVX-512 a K block is transposed 16 keys x
 * 16 dims at a time in registers, and full 8-row score tiles skip the per-row test (before both: 661
 * against 583 ms in bench/prefill_attention.py).
 * trillium_paged_prefill_attention runs the same items with the keys read through a block table.
 *
 * WHY: torch's CPU flash attention runs its float32 blocks through MKL sgemm calls (64-row query
 * blocks, each call packing its operands): the bench model's prefill attention ran at ~37-45
 * GFLOP/s, ~25% of a prefill chunk's time on the 2-core Zen 4. Figures in bench/prefill_attention.py.
 */
#if defined(__AVX512F__)
#define PF_VW 16
#else
#define PF_VW 8
#endif
#define PF_QB 16
#define PF_KB 64
/* query rows a score tile takes (its accumulators: 2 vectors a row; 16 of 32 registers under AVX-512,
 * 8 of 16 under AVX2) */
#if defined(__AVX512F__)
#define PF_QK_ROWS 8
#else
#define PF_QK_ROWS 4
#endif
#define PF_MAX_D 256
#define PF_MAX_G 16

typedef float pf_vec __attribute__((vector_size(PF_VW * 4)));
typedef float pf_uvec __attribute__((vector_size(PF_VW * 4), aligned(4), may_alias));

/* WHY macros: a function taking or returning these vectors draws GCC's ABI note where they are wider
 * than the build's registers (a plain x86-64 build) */
#define pf_load(p) (*(const pf_uvec *)(p))
#define pf_store(p, v) (*(pf_uvec *)(p) = (v))

typedef struct {
    const float *q, *k, *v;
    long q_row, q_head, k_row, k_head, v_row, v_head;
    long g, q_len, h, d;
    float scale;
    float *out;
    /* A chunk after a context (trillium_paged_prefill_attention): one sequence whose queries sit at
     * positions ctx .. ctx + q_len - 1 and whose keys 0 .. ctx + q_len - 1 are read from the paged
     * cache (k, v [slots, kh, D]) through its block table; table NULL: keys are the step's own rows. */
    const int32_t *table;
    long bs, kh, ctx;
} Prefill;

/* Key (or value) row j of KV head kvh: the cache slot its block table gives, or row j of the step's
 * own rows (the sequence's first at `base`). */
static inline const float *pf_key_row(const Prefill *c, const float *rows, long row_stride, long head_stride,
                                      long base, long j, long kvh, long D) {
    if (c->table != NULL)
        return rows + (((long)c->table[j / c->bs] * c->bs + j % c->bs) * c->kh + kvh) * D;
    return rows + (base + j) * row_stride + kvh * head_stride;
}

/* Scores of query rows r0 .. r0 + nr - 1 (nr <= PF_QK_ROWS) against the block's PF_KB keys (kt [D][PF_KB],
 * zero past the block's keys): s[r * PF_KB + t]. */
static inline __attribute__((always_inline)) void pf_scores(const float *restrict qs, const float *restrict kt,
                                                            float *restrict s, long r0, long nr, const long D) {
    for (long t0 = 0; t0 < PF_KB; t0 += 2 * PF_VW) {
        pf_vec a[PF_QK_ROWS][2] = {{{0}}};
        for (long e = 0; e < D; e++) {
            const pf_vec b0 = pf_load(kt + e * PF_KB + t0), b1 = pf_load(kt + e * PF_KB + t0 + PF_VW);
            for (long i = 0; i < PF_QK_ROWS; i++) {
                if (i >= nr) break;
                const float x = qs[(r0 + i) * D + e];
                a[i][0] += x * b0;
                a[i][1] += x * b1;
            }
        }
        for (long i = 0; i < nr; i++) {
            pf_store(s + (r0 + i) * PF_KB + t0, a[i][0]);
            pf_store(s + (r0 + i) * PF_KB + t0 + PF_VW, a[i][1]);
        }
    }
}

/* pf_scores of a whole tile (PF_QK_ROWS rows): the same sums without the per-row test in the inner loop. */
static inline __attribute__((always_inline)) void pf_scores_tile(const float *restrict qs, const float *restrict kt,
                                                                 float *restrict s, long r0, const long D) {
    for (long t0 = 0; t0 < PF_KB; t0 += 2 * PF_VW) {
        pf_vec a[PF_QK_ROWS][2] = {{{0}}};
        for (long e = 0; e < D; e++) {
            const pf_vec b0 = pf_load(kt + e * PF_KB + t0), b1 = pf_load(kt + e * PF_KB + t0 + PF_VW);
            for (long i = 0; i < PF_QK_ROWS; i++) {
                const float x = qs[(r0 + i) * D + e];
                a[i][0] += x * b0;
                a[i][1] += x * b1;
            }
        }
        for (long i = 0; i < PF_QK_ROWS; i++) {
            pf_store(s + (r0 + i) * PF_KB + t0, a[i][0]);
            pf_store(s + (r0 + i) * PF_KB + t0 + PF_VW, a[i][1]);
        }
    }
}

#if defined(__AVX512F__)
/* kt[(e0 + j) * PF_KB + t0 + i] = rows[i][e0 + j] for i, j < 16: one 16 x 16 block transposed in registers. */
static inline __attribute__((always_inline)) void pf_transpose16(const float *const rows[16], long e0,
                                                                 float *restrict kt, long t0) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows[i] + e0);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
    for (int j = 0; j < 16; j++) _mm512_storeu_ps(kt + (e0 + j) * PF_KB + t0, r[j]);
}
#endif

/* A row's softmax step in the widest registers the build has (the decode kernel's own). */
#if defined(__AVX512F__)
#define pf_softmax_row softmax_row16
#elif defined(TRILLIUM_ATTENTION_AVX2)
#define pf_softmax_row softmax_row8
#else
#define pf_softmax_row softmax_row
#endif

static inline __attribute__((always_inline)) void prefill_item(const Prefill *c, long seq, long kvh, long p0,
                                                               long p1, float *restrict work, const long D) {
    const long g = c->g, nq = p1 - p0, rows = g * nq;
    float *qs = work, *acc = qs + PF_QB * PF_MAX_G * PF_MAX_D, *kt = acc + PF_QB * PF_MAX_G * PF_MAX_D;
    float *vb = kt + PF_MAX_D * PF_KB, *s = vb + PF_MAX_D * PF_KB, *m = s + PF_QB * PF_MAX_G * PF_KB;
    float *l = m + PF_QB * PF_MAX_G;
    const long base = seq * c->q_len;  /* the sequence's first row */
    /* row r = j * nq + i: head kvh * g + j at position p0 + i */
    for (long j = 0; j < g; j++)
        for (long i = 0; i < nq; i++) {
            const float *src = c->q + (base + p0 + i) * c->q_row + (kvh * g + j) * c->q_head;
            float *dst = qs + (j * nq + i) * D;
#pragma omp simd
            for (long e = 0; e < D; e++) dst[e] = src[e] * c->scale;
        }
    start_item(rows, D, acc, m, l);
    const long ctx = c->ctx, last = ctx + p1;  /* keys 0 .. last - 1: the item's last query sees them all */
    for (long kb0 = 0; kb0 < last; kb0 += PF_KB) {
        const long kn = last - kb0 < PF_KB ? last - kb0 : PF_KB;
        long t = 0;
#if defined(__AVX512F__)
        for (; t + 16 <= kn; t += 16) {  /* 16 keys at a time transposed in registers (D: a multiple of 16) */
            const float *kr[16];
            for (int i = 0; i < 16; i++)
                kr[i] = pf_key_row(c, c->k, c->k_row, c->k_head, base, kb0 + t + i, kvh, D);
            for (long e0 = 0; e0 < D; e0 += 16) pf_transpose16(kr, e0, kt, t);
        }
#endif
        for (; t < kn; t++) {
            const float *kr = pf_key_row(c, c->k, c->k_row, c->k_head, base, kb0 + t, kvh, D);
            for (long e = 0; e < D; e++) kt[e * PF_KB + t] = kr[e];
        }
        for (long t = kn; t < PF_KB; t++)
            for (long e = 0; e < D; e++) kt[e * PF_KB + t] = 0.0f;
        for (long t = 0; t < kn; t++)  /* WHY a copy: V rows lie a qkv row apart (one 4 KB page each at the
                                        * bench shape); read 2 * g * PF_QB / 2 times, they come from L1 */
            memcpy(vb + t * D, pf_key_row(c, c->v, c->v_row, c->v_head, base, kb0 + t, kvh, D),
                   (size_t)D * sizeof(float));
        for (long r0 = 0; r0 < rows; r0 += PF_QK_ROWS) {
            if (rows - r0 >= PF_QK_ROWS) pf_scores_tile(qs, kt, s, r0, D);
            else pf_scores(qs, kt, s, r0, rows - r0, D);
        }
        long vis[PF_QB * PF_MAX_G];  /* each row's keys visible in this block */
        for (long r = 0; r < rows; r++) {
            const long pos = ctx + p0 + r % nq, n = pos - kb0 + 1 < kn ? pos - kb0 + 1 : kn;
            vis[r] = n > 0 ? n : 0;
            if (vis[r] > 0) pf_softmax_row(s + r * PF_KB, vis[r], acc + r * D, D, &m[r], &l[r]);
        }
        /* P.V: rows in pairs, each V vector loaded once for both */
        for (long r = 0; r < rows; r += 2) {
            const long r1 = r + 1 < rows ? r + 1 : r, n0 = vis[r], n1 = r1 != r ? vis[r1] : 0;
            const long n = n0 > n1 ? n0 : n1;
            pf_vec a0[PF_MAX_D / PF_VW], a1[PF_MAX_D / PF_VW];
            for (long e = 0; e < D / PF_VW; e++) { a0[e] = pf_load(acc + r * D + e * PF_VW); a1[e] = pf_load(acc + r1 * D + e * PF_VW); }
            const float *s0 = s + r * PF_KB, *s1 = s + r1 * PF_KB;
            for (long t = 0; t < n; t++) {
                const float *vr = vb + t * D;
                const float w0 = t < n0 ? s0[t] : 0.0f, w1 = t < n1 ? s1[t] : 0.0f;
                for (long e = 0; e < D / PF_VW; e++) {
                    const pf_vec x = pf_load(vr + e * PF_VW);
                    a0[e] += w0 * x;
                    a1[e] += w1 * x;
                }
            }
            for (long e = 0; e < D / PF_VW; e++) {
                pf_store(acc + r * D + e * PF_VW, a0[e]);
                if (r1 != r) pf_store(acc + r1 * D + e * PF_VW, a1[e]);
            }
        }
    }
    for (long r = 0; r < rows; r++) {
        const long j = r / nq, i = r % nq;
        const float inv = 1.0f / l[r];  /* l >= 1: a row always sees its own key */
        float *o = c->out + ((base + p0 + i) * c->h + kvh * g + j) * D;
#pragma omp simd
        for (long e = 0; e < D; e++) o[e] = acc[r * D + e] * inv;
    }
}

static __attribute__((noinline)) void prefill_item_d64(const Prefill *c, long seq, long kvh, long p0, long p1,
                                                       float *work) {
    prefill_item(c, seq, kvh, p0, p1, work, 64);
}

static __attribute__((noinline)) void prefill_item_d128(const Prefill *c, long seq, long kvh, long p0, long p1,
                                                        float *work) {
    prefill_item(c, seq, kvh, p0, p1, work, 128);
}

static __attribute__((noinline)) void prefill_item_any(const Prefill *c, long seq, long kvh, long p0, long p1,
                                                       float *work) {
    prefill_item(c, seq, kvh, p0, p1, work, c->d);
}

/* Heads and head dim the prefill kernels take: D a multiple of the vector width up to PF_MAX_D, GQA
 * groups up to PF_MAX_G heads. */
static int prefill_shape(long q_len, long h, long kh, long d) {
    return kh > 0 && h % kh == 0 && d > 0 && d % PF_VW == 0 && d <= PF_MAX_D && h / kh <= PF_MAX_G && q_len > 0;
}

/* Every work item of num_seqs sequences of c->q_len query rows (PF_QB positions of one sequence and KV
 * head each) on `threads` threads, each with its own work buffers. 0, or -1: no memory for them. */
static int prefill_items(const Prefill *c, long num_seqs, int threads) {
    const long kh = c->h / c->g, q_len = c->q_len, d = c->d;
    const long nqb = (q_len + PF_QB - 1) / PF_QB, items = num_seqs * kh * nqb;
    const size_t work_floats = 2 * (size_t)PF_QB * PF_MAX_G * PF_MAX_D + 2 * (size_t)PF_MAX_D * PF_KB
                               + (size_t)PF_QB * PF_MAX_G * PF_KB + 2 * (size_t)PF_QB * PF_MAX_G;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *work = aligned_alloc(64, (work_floats * sizeof(float) + 63) / 64 * 64);
        if (work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            if (work == NULL) continue;
            /* the last query blocks (of every sequence and KV head) first: they read the most keys */
            const long qb = nqb - 1 - it / (num_seqs * kh), rest = it % (num_seqs * kh), kvh = rest % kh,
                       seq = rest / kh;
            const long p0 = qb * PF_QB, p1 = p0 + PF_QB < q_len ? p0 + PF_QB : q_len;
            if (d == 64) prefill_item_d64(c, seq, kvh, p0, p1, work);
            else if (d == 128) prefill_item_d128(c, seq, kvh, p0, p1, work);
            else prefill_item_any(c, seq, kvh, p0, p1, work);
        }
        free(work);
    }
    return failed ? -1 : 0;
}

/* Returns 0, or -1 for a shape it does not take (head dim not a multiple of the vector width or past
 * PF_MAX_D, a GQA group past PF_MAX_G heads, no memory). Strides in floats. */
int trillium_fresh_prefill_attention(const float *q, long q_row, long q_head, const float *k, long k_row,
                                     long k_head, const float *v, long v_row, long v_head, long num_seqs,
                                     long q_len, long h, long kh, long d, float scale, float *out,
                                     int num_threads) {
    if (!prefill_shape(q_len, h, kh, d)) return -1;
    const Prefill c = {q, k, v, q_row, q_head, k_row, k_head, v_row, v_head, h / kh, q_len, h, d, scale, out,
                       NULL, 0, 0, 0};
    /* WHY a floor: a thread team's wake-up costs more than a short prompt's attention */
    return prefill_items(&c, num_seqs, q_len * q_len * h * d * num_seqs < (1L << 18) ? 1 : num_threads);
}

/* One sequence's prefill chunk after `ctx` keys already in the cache (a prompt's later chunk, or its
 * first after a cached prefix): query rows q [q_len, H, D] (any row and head stride, D contiguous) at
 * positions ctx .. ctx + q_len - 1, keys and values 0 .. ctx + q_len - 1 read from the float32 paged
 * cache k, v [num_blocks, bs, KH, D] (contiguous) through the sequence's block table (this chunk's own
 * keys already written there); row p sees keys 0 .. ctx + p. out [q_len, H, D] contiguous.
 *
 * The fresh kernel's items and arithmetic (prefill_item), each key row read from the slot its block
 * table gives instead of from the step's qkv rows.
 *
 * WHY: torch's SDPA over a gathered copy (reference._attend_prefill) was ~47% of a 4000-token
 * prompt's prefill on the bench model (MKL sgemm calls with their packing, 1024-token chunks), where
 * the fresh kernel takes its first chunk at about twice SDPA's rate; and the gather copies the whole
 * context once per layer per chunk. Returns 0, or -1 for a shape it does not take (as the fresh
 * kernel) or no memory. */
int trillium_paged_prefill_attention(const float *q, long q_row, long q_head, const float *k, const float *v,
                                     long bs, long kh, const int32_t *table, long ctx, long q_len, long h, long d,
                                     float scale, float *out, int num_threads) {
    if (!prefill_shape(q_len, h, kh, d) || bs <= 0 || ctx < 0) return -1;
    const Prefill c = {q, k, v, q_row, q_head, 0, 0, 0, 0, h / kh, q_len, h, d, scale, out, table, bs, kh, ctx};
    return prefill_items(&c, 1, q_len * (ctx + q_len) * h * d < (1L << 18) ? 1 : num_threads);
}
