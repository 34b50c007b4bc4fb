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
 * Work item: one (query row, KV head). Its H / KH query heads (GQA) are attended together, so each K
 * and V row is read once for the whole group. Online softmax one block at a time: the block's scores
 * for every head of the group, the running max raised once per block, the accumulators rescaled once
 * per block (not per key). Items are split across OpenMP threads (dynamic: lengths differ).
 *
 * Vectorization: plain loops under `omp simd` (a reduction for the dot products; no intrinsics, so
 * any -march builds it), and a polynomial exp (Cephes expf's, ~1 ulp) that vectorizes where libm's
 * expf does not without -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

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
    long bs, kh, d, g;
    float scale, softcap;
} Cache;

/* One (sequence, KV head): out_g[h] for the g query heads q_g (scaled) over keys start .. n-1. */
static void attend_group(const Cache *c, const int32_t *table, long start, long n, const float *qg,
                         float *restrict acc, float *restrict m, float *restrict l, float *restrict s,
                         float *restrict buf, long kvh) {
    const long bs = c->bs, d = c->d, g = c->g;
    for (long h = 0; h < g; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
    memset(acc, 0, (size_t)(g * d) * sizeof(float));
    for (long bi = start / bs; bi * bs < n; bi++) {
        const long slot0 = (long)table[bi] * bs;
        const long lo = start > bi * bs ? start - bi * bs : 0, hi = n - bi * bs < bs ? n - bi * bs : bs;
        const long nk = hi - lo;
        for (long t = 0; t < nk; t++) {
            const float *kr = kv_row(c->k, c->lut, slot0 + lo + t, kvh, c->kh, d, buf);
            for (long h = 0; h < g; h++) {
                const float *qh = qg + h * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (long i = 0; i < d; i++) dot += qh[i] * kr[i];
                s[h * bs + t] = dot * c->scale;
            }
        }
        for (long h = 0; h < g; h++) {
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
        for (long t = 0; t < nk; t++) {
            const float *vr = kv_row(c->v, c->lut, slot0 + lo + t, kvh, c->kh, d, buf);
            for (long h = 0; h < g; h++) {
                const float p = s[h * bs + t];
                float *ah = acc + h * d;
#pragma omp simd
                for (long i = 0; i < d; i++) ah[i] += p * vr[i];
            }
        }
    }
}

/* Returns 0, or -1 for a shape it does not take. k_scale / v_scale: NULL or one float each (fp8);
 * window <= 0: none; softcap <= 0: none. */
int trillium_paged_decode_attention(const float *q, long b, long h, long d, long q_row_stride,
                                    long q_head_stride, const void *k, const void *v, const float *lut,
                                    long bs, long kh, const int32_t *table, long table_stride,
                                    const int32_t *seq_lens, const int32_t *row_seq, float scale,
                                    const float *k_scale,
                                    const float *v_scale, long window, float softcap, float *out,
                                    int num_threads) {
    if (kh <= 0 || h % kh || d <= 0 || bs <= 0) return -1;
    const long g = h / kh, items = b * kh;
    const Cache c = {k, v, lut, bs, kh, d, g, scale * (k_scale ? *k_scale : 1.0f), softcap};
    const float out_scale = v_scale ? *v_scale : 1.0f;
    long keys = 0;
    for (long i = 0; i < b; i++) keys += seq_lens[i];
    /* WHY a floor: below ~64K multiply-adds a thread team's wake-up costs more than it saves. */
    const int threads = keys * h * d < (1L << 16) ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
        float qg[g * d], acc[g * d], m[g], l[g], s[g * bs], buf[d];
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            const long seq = it / kh, kvh = it % kh, n = seq_lens[seq];
            const long tab = row_seq ? row_seq[seq] : seq;  /* seq: the query row; tab: its block table */
            const long start = window > 0 && n > window ? n - window : 0;
            for (long j = 0; j < g; j++) {
                const float *src = q + seq * q_row_stride + (kvh * g + j) * q_head_stride;
                memcpy(qg + j * d, src, (size_t)d * sizeof(float));
            }
            attend_group(&c, table + tab * table_stride, start, n, qg, acc, m, l, s, buf, kvh);
            for (long j = 0; j < g; j++) {
                float *o = out + (seq * h + kvh * g + j) * d;
                const float inv = l[j] > 0.0f ? out_scale / l[j] : 0.0f;
#pragma omp simd
                for (long i = 0; i < d; i++) o[i] = acc[j * d + i] * inv;
            }
        }
    }
    return 0;
}
