/* Attention of a few queries per row over a row's cached keys (kvboost_rag's
 * ``model/attention.py``, ``few_query_attention``): a decoding step's one query, or a draft's
 * few, per row of a batch. The keys and values are read as the cache holds them (bf16 or
 * fp32) and converted in registers, where the torch form copies each layer's whole cache to
 * float32 first; products, softmax and sums are float32.
 *
 * The query heads of one key-value head (``groups`` of them, with their ``q`` queries each)
 * share one read of its keys and values. The keys are split into chunks of CHUNK, one
 * OpenMP task per (row, key-value head, chunk), each keeping a running maximum, sum and
 * weighted value sum per query, merged afterwards (flash-decoding's split softmax), so one
 * long row spreads over every thread.
 *
 * Layouts (strides in elements; the last dimension contiguous):
 *   query [B][H][Q][D]   (b, h, i) at b * qs_b + h * qs_h + i * qs_i
 *   key   [B][KVH][N][D] (b, kvh, j) at b * ks_b + kvh * ks_h + j * D; value the same
 *   mask  bool [B][Q][>= N] at b * ms_b + i * ms_i + j, or NULL: every key attends
 *   out   [B][Q][H][D], contiguous, the query's dtype
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define CHUNK 256
#define ROWS 8 /* queries a pass over a chunk keeps in registers */

/* 16 values at ``p`` as float32 (``bf16``: bfloat16, widened exactly). */
static inline __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline void store16(void *p, int bf16, __m512 v) {
    if (!bf16) {
        _mm512_storeu_ps(p, v);
        return;
    }
    /* round to nearest even, as torch's float -> bfloat16 conversion does (no NaN input) */
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* The sums of 8 vectors' elements, in the first 8 floats: pairs interleaved and added, then
 * 128-bit lanes (24 operations where 8 separate reductions take 64). */
static inline __m256 sums8(const __m512 a[8]) {
    __m512 s[4];
    for (int i = 0; i < 4; i++) /* per lane: a2i 0+2, a2i+1 0+2, a2i 1+3, a2i+1 1+3 */
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    __m512 t[2];
    for (int i = 0; i < 2; i++) { /* per lane: the lane's sum of a4i .. a4i+3 */
        __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
        t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* lanes: t0's 0+1, t0's 2+3, t1's 0+1, t1's 2+3; then 0+1 and 2+3 of those */
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
    __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u, u, 0x08), _mm512_shuffle_f32x4(u, u, 0x0D));
    return _mm512_castps512_ps256(w);
}

/* e^x for x <= 0 (differences from a running maximum), within 2 ulp: x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, scaled by 2^n; under -87 it is 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_mask_mov_ps(e, tiny, _mm512_setzero_ps());
}

typedef struct {
    const void *q, *k, *v;
    const uint8_t *mask;
    int bf16_q, bf16_kv;
    int64_t B, H, KVH, Q, N, D;
    int64_t qs_b, qs_h, qs_i, ks_b, ks_h, vs_b, vs_h, ms_b, ms_i;
    float scale;
} Problem;

/* One task: rows ``r0 .. r0 + rows`` (row r = head g * Q + query i of key-value head
 * ``kvh``) over keys ``j0 .. j1``: per row its maximum ``m``, sum ``l`` and weighted value
 * sum ``o`` [D], relative to ``m``. ``s``: scratch of ROWS * (CHUNK + D) floats. */
static void chunk(const Problem *p, int64_t b, int64_t kvh, int64_t r0, int rows, int64_t j0,
                  int64_t j1, float *s, float *m, float *l, float *o) {
    int64_t D = p->D, G = p->H / p->KVH, n = j1 - j0;
    int qsz = p->bf16_q ? 2 : 4, kvsz = p->bf16_kv ? 2 : 4;
    float *qf = s + ROWS * CHUNK; /* the rows' queries in float32: [rows][D] */
    const uint8_t *mrow[ROWS];
    for (int r = 0; r < rows; r++) {
        int64_t g = (r0 + r) / p->Q, i = (r0 + r) % p->Q;
        const char *row = (const char *)p->q + (b * p->qs_b + (kvh * G + g) * p->qs_h + i * p->qs_i) * qsz;
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(qf + r * D + d, load16(row + d * qsz, p->bf16_q));
        mrow[r] = p->mask ? p->mask + b * p->ms_b + i * p->ms_i : 0;
    }
    const char *kb = (const char *)p->k + (b * p->ks_b + kvh * p->ks_h) * kvsz;
    const char *vb = (const char *)p->v + (b * p->vs_b + kvh * p->vs_h) * kvsz;
    for (int64_t j = j0; j < j1; j++) {
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            __m512 kv = load16(kb + (j * D + d) * kvsz, p->bf16_kv);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + r * D + d), kv, acc[r]);
        }
        float dots[ROWS];
        _mm256_storeu_ps(dots, sums8(acc));
        for (int r = 0; r < rows; r++) {
            int allowed = !mrow[r] || mrow[r][j];
            s[r * CHUNK + (j - j0)] = allowed ? dots[r] * p->scale : -INFINITY;
        }
    }
    for (int r = 0; r < rows; r++) {
        float *sr = s + r * CHUNK, top = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < n; j++) top = fmaxf(top, sr[j]);
        m[r] = top;
        if (top == -INFINITY) { /* every key of the chunk masked: it adds nothing */
            for (int64_t j = 0; j < n; j++) sr[j] = 0.f;
        } else {
            int64_t j = 0;
            for (; j + 16 <= n; j += 16) {
                __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(top)));
                _mm512_storeu_ps(sr + j, e);
                sum += _mm512_reduce_add_ps(e);
            }
            for (; j < n; j++) {
                sr[j] = expf(sr[j] - top);
                sum += sr[j];
            }
        }
        l[r] = sum;
    }
    for (int64_t d = 0; d < D; d += 64) { /* up to 4 vectors of 16 dimensions per pass */
        int width = D - d < 64 ? (int)((D - d) / 16) : 4;
        __m512 acc[ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int w = 0; w < width; w++) acc[r][w] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            __m512 vv[4];
            for (int w = 0; w < width; w++)
                vv[w] = load16(vb + ((j0 + j) * D + d + 16 * w) * kvsz, p->bf16_kv);
            for (int r = 0; r < rows; r++) {
                __m512 weight = _mm512_set1_ps(s[r * CHUNK + j]);
                for (int w = 0; w < width; w++) acc[r][w] = _mm512_fmadd_ps(weight, vv[w], acc[r][w]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int w = 0; w < width; w++) _mm512_storeu_ps(o + r * D + d + 16 * w, acc[r][w]);
    }
}

/* out = softmax(q k^T * scale, masked) v for every row, query head and query; -1 when the
 * scratch cannot be allocated. D a multiple of 16. */
int few_query_attention(const void *q, int bf16_q, const void *k, const void *v, int bf16_kv,
                        const uint8_t *mask, int64_t B, int64_t H, int64_t KVH, int64_t Q,
                        int64_t N, int64_t D, int64_t qs_b, int64_t qs_h, int64_t qs_i,
                        int64_t ks_b, int64_t ks_h, int64_t vs_b, int64_t vs_h, int64_t ms_b,
                        int64_t ms_i, float scale, void *out, int threads) {
    Problem p = {q, k, v, mask, bf16_q, bf16_kv, B, H, KVH, Q, N, D,
                 qs_b, qs_h, qs_i, ks_b, ks_h, vs_b, vs_h, ms_b, ms_i, scale};
    int64_t R = (H / KVH) * Q, chunks = N > 0 ? (N + CHUNK - 1) / CHUNK : 1;
    int64_t tasks = B * KVH * chunks;
    float *m = malloc((size_t)(tasks * R) * sizeof(float));
    float *l = malloc((size_t)(tasks * R) * sizeof(float));
    float *o = malloc((size_t)(tasks * R * D) * sizeof(float));
    int ok = m && l && o;
    if (ok) {
#pragma omp parallel num_threads(threads)
        {
            float *s = malloc((size_t)ROWS * (CHUNK + D) * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                int64_t c = t % chunks, kvh = (t / chunks) % KVH, b = t / (chunks * KVH);
                int64_t j0 = c * CHUNK, j1 = j0 + CHUNK < N ? j0 + CHUNK : N;
                for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
                    int rows = R - r0 < ROWS ? (int)(R - r0) : ROWS;
                    int64_t at = t * R + r0;
                    chunk(&p, b, kvh, r0, rows, j0, j1, s, m + at, l + at, o + at * D);
                }
            }
            free(s);
        }
        int osz = bf16_q ? 2 : 4;
        int64_t G = H / KVH;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t br = 0; br < B * KVH * R; br++) {
            int64_t r = br % R, kvh = (br / R) % KVH, b = br / (R * KVH);
            int64_t first = (b * KVH + kvh) * chunks;
            float top = -INFINITY, sum = 0.f;
            for (int64_t c = 0; c < chunks; c++) top = fmaxf(top, m[(first + c) * R + r]);
            float w[chunks > 0 ? chunks : 1];
            for (int64_t c = 0; c < chunks; c++) {
                float mc = m[(first + c) * R + r];
                w[c] = mc == -INFINITY ? 0.f : expf(mc - top);
                sum += w[c] * l[(first + c) * R + r];
            }
            int64_t g = r / Q, i = r % Q, h = kvh * G + g;
            char *dst = (char *)out + ((b * Q + i) * H + h) * D * osz;
            for (int64_t d = 0; d < D; d += 16) {
                __m512 total = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++)
                    total = _mm512_fmadd_ps(_mm512_set1_ps(w[c]),
                                            _mm512_loadu_ps(o + ((first + c) * R + r) * D + d), total);
                store16(dst + d * osz, bf16_q, _mm512_div_ps(total, _mm512_set1_ps(sum)));
            }
        }
    }
    free(m);
    free(l);
    free(o);
    return ok ? 0 : -1;
}
