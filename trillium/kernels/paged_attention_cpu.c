/* Decode attention on CPU over the paged KV cache, read in place (no gathered copy).
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
 * Chunks are split across OpenMP threads (dynamic: lengths differ), so one long sequence still
 * keeps every thread busy. A row of one chunk is finished as before (acc / l); several chunks
 * are merged in key order (flash-decoding's split-K: each chunk's acc and l rescaled to the
 * largest max). While a block is read the next one's K and V rows are prefetched (the block
 * table says where it lies).
 *
 * Vectorization: plain loops under `omp simd` (a reduction for the dot products; no intrinsics, so
 * any -march builds it), and a polynomial exp (Cephes expf's, ~1 ulp) that vectorizes where libm's
 * expf does not without -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <stdlib.h>

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

static inline void prefetch_block(const Cache *c, long block) {
    const long bytes = c->bs * c->kh * c->d * c->elem;
    const char *kb = (const char *)c->k + block * bytes, *vb = (const char *)c->v + block * bytes;
    for (long at = 0; at < bytes; at += 64) {
        __builtin_prefetch(kb + at, 0, 3);
        __builtin_prefetch(vb + at, 0, 3);
    }
}

/* One query row's keys start .. end-1 (within its n keys) for all h = kh * g heads q (scaled by the
 * caller's scale): per head the unnormalized acc[h * d], its running max m[h] and sum l[h]. */
static void attend_chunk(const Cache *c, const int32_t *table, long start, long end,
                         const float *q, float *restrict acc, float *restrict m, float *restrict l,
                         float *restrict s, float *restrict buf) {
    const long bs = c->bs, d = c->d, g = c->g, kh = c->kh, h_all = kh * g;
    for (long h = 0; h < h_all; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
    memset(acc, 0, (size_t)(h_all * d) * sizeof(float));
    for (long bi = start / bs; bi * bs < end; bi++) {
        const long slot0 = (long)table[bi] * bs;
        if ((bi + 1) * bs < end) prefetch_block(c, table[bi + 1]);
        const long lo = start > bi * bs ? start - bi * bs : 0, hi = end - bi * bs < bs ? end - bi * bs : bs;
        const long nk = hi - lo;
        for (long t = 0; t < nk; t++)
            for (long kvh = 0; kvh < kh; kvh++) {
                const float *kr = kv_row(c->k, c->lut, slot0 + lo + t, kvh, kh, d, buf);
                for (long j = 0; j < g; j++) {
                    const long h = kvh * g + j;
                    const float *qh = q + h * d;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (long i = 0; i < d; i++) dot += qh[i] * kr[i];
                    s[h * bs + t] = dot * c->scale;
                }
            }
        for (long h = 0; h < h_all; h++) {
            float *sh = s + h * bs, mx = m[h], sum = 0.0f;
            if (c->softcap > 0.0f)
                for (long t = 0; t < nk; t++) sh[t] = c->softcap * tanhf(sh[t] / c->softcap);
            for (long t = 0; t < nk; t++) mx = sh[t] > mx ? sh[t] : mx;
#pragma omp simd reduction(+ : sum)
            for (long t = 0; t < nk; t++) {
                sh[t] = exp_nonpositive(sh[t] - mx);
                sum += sh[t];
            }
            if (mx != m[h]) {  /* the max rose: rescale what this head accumulated so far */
                const float corr = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
                float *ah = acc + h * d;
#pragma omp simd
                for (long i = 0; i < d; i++) ah[i] *= corr;
                l[h] *= corr;
                m[h] = mx;
            }
            l[h] += sum;
        }
        for (long t = 0; t < nk; t++)
            for (long kvh = 0; kvh < kh; kvh++) {
                const float *vr = kv_row(c->v, c->lut, slot0 + lo + t, kvh, kh, d, buf);
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

/* The first key row r attends (a sliding window cuts the front). */
static inline long first_key(long n, long window) { return window > 0 && n > window ? n - window : 0; }

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
#pragma omp parallel num_threads(threads)
    {
        float qs[h * d], s[h * bs], buf[d];
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            const long r = item_row[it], n = seq_lens[r];
            const long tab = row_seq ? row_seq[r] : r;  /* r: the query row; tab: its block table */
            const long lo = first_key(n, window), chunk = lo / CHUNK_KEYS + (it - first[r]);
            const long start = chunk * CHUNK_KEYS > lo ? chunk * CHUNK_KEYS : lo;
            const long end = (chunk + 1) * CHUNK_KEYS < n ? (chunk + 1) * CHUNK_KEYS : n;
            for (long j = 0; j < h; j++)
                memcpy(qs + j * d, q + r * q_row_stride + j * q_head_stride, (size_t)d * sizeof(float));
            float *p = parts + it * part;
            attend_chunk(&c, table + tab * table_stride, start, end, qs, p, p + h * d,
                         p + h * d + h, s, buf);
        }
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
