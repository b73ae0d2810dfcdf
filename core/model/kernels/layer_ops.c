/* A decoder layer's small operators in one call each (kvboost_rag's ``model/lean_layers.py``):
 * RMSNorm (with the residual add before it), RoPE on queries and keys, and SiLU(gate) * up.
 * In torch each is 3-12 operators on a decoding step's one row, ~5 us apiece of dispatch;
 * at Qwen2.5-Coder-1.5B that was ~1,400 calls and ~5 ms a step beside 30 ms of weights.
 *
 * Every result is what transformers' Llama-family modules compute, rounded where they round:
 * a bf16 operator's float32 result rounds to bf16 (nearest even) before the next operator
 * reads it. Built with -ffp-contract=off so that no product and sum fuse into one rounding.
 * The sums of squares run in float32 in another order than torch's (a last-bit difference
 * in the variance, as between two BLAS), and SiLU's exp is a polynomial within 2 ulp of
 * expf: those are the only departures.
 *
 * dtype: 0 float32, 1 bfloat16. Rows: a token each; threads over rows where there are many.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline __m512 load(const void *x, int bf16, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 -> bfloat16 bits, nearest even (torch's conversion; NaN is not expected here) */
static inline __m256i to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* what a bf16 tensor would hold: v rounded to bf16 and widened back (float32: v) */
static inline __m512 rounded(__m512 v, int bf16) {
    if (!bf16) return v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

static inline void store(void *y, int bf16, int64_t i, __m512 v) {
    if (!bf16)
        _mm512_storeu_ps((float *)y + i, v);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), to_bf16(v));
}

/* y = w * (s * rsqrt(mean(s^2) + eps)) over ``dim``, s = x + add (add NULL: s = x), s written
 * to ``sum`` when it is not NULL: transformers' ``residual + h`` then its RMSNorm. */
void rms_norm(const void *x, const void *add, void *sum, const void *w, void *y, int bf16,
              int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for if (rows > 4) num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            __m512 s = load(x, bf16, base + i);
            if (add) {
                s = rounded(_mm512_add_ps(s, load(add, bf16, base + i)), bf16);
                if (sum) store(sum, bf16, base + i, s);
            }
            squares = _mm512_add_ps(squares, _mm512_mul_ps(s, s));
        }
        float mean = _mm512_reduce_add_ps(squares) / (float)dim;
        __m512 scale = _mm512_set1_ps(1.f / sqrtf(mean + eps));
        for (int64_t i = 0; i < dim; i += 16) {
            __m512 s = add ? load(sum, bf16, base + i) : load(x, bf16, base + i);
            __m512 h = rounded(_mm512_mul_ps(s, scale), bf16);
            store(y, bf16, base + i, _mm512_mul_ps(load(w, bf16, i), h));
        }
    }
}

/* RoPE, rotate-half form, on ``heads`` heads of ``dim`` a token: x is [tokens][stride]
 * (a projection's output, or a view of several side by side), its head h at h * dim; out is
 * [batch][heads][seq][dim] (transformers' layout after its transpose); cos and sin are
 * [tokens][dim], or [seq][dim] for every row (``shared``: positions the rows share).
 * out = x * cos + rotate_half(x) * sin, each product rounded, then the sum. */
void rope(const void *x, int64_t stride, const void *cos, const void *sin, int shared,
          void *out, int bf16, int64_t batch, int64_t seq, int64_t heads, int64_t dim,
          int threads) {
    int64_t half = dim / 2;
#pragma omp parallel for if (batch * seq > 4) num_threads(threads) schedule(static)
    for (int64_t t = 0; t < batch * seq; t++) {
        int64_t b = t / seq, s = t % seq, at = (shared ? s : t) * dim;
        for (int64_t h = 0; h < heads; h++) {
            int64_t in = t * stride + h * dim, to = ((b * heads + h) * seq + s) * dim;
            for (int64_t i = 0; i < dim; i += 16) {
                int64_t j = i < half ? i + half : i - half; /* rotate_half's partner */
                __m512 partner = load(x, bf16, in + j);
                if (i < half) partner = _mm512_sub_ps(_mm512_setzero_ps(), partner);
                __m512 a = rounded(_mm512_mul_ps(load(x, bf16, in + i), load(cos, bf16, at + i)), bf16);
                __m512 c = rounded(_mm512_mul_ps(partner, load(sin, bf16, at + i)), bf16);
                store(out, bf16, to + i, _mm512_add_ps(a, c));
            }
        }
    }
}

/* exp(x) for x <= 0 (SiLU's exp(-|g|)): 2^n * p(r), r = x - n ln2, p of degree 6
 * (Cephes' expf coefficients), within 2 ulp of expf; below -87 it is 0. */
static inline __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* y = silu(gate) * up over ``inter``, gate and up [rows][stride] at columns 0 and ``up``
 * (one joint projection's output, or one tensor each with up = 0 and its own pointer). */
void silu_mul(const void *gate, const void *upx, int64_t stride, void *y, int bf16,
              int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for if (rows > 4) num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < inter; i += 16) {
            __m512 g = load(gate, bf16, r * stride + i);
            /* silu(g) = g / (1 + exp(-g)), exp's argument kept <= 0 for its range */
            __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            __m512 one = _mm512_set1_ps(1.f);
            /* g >= 0: g / (1 + e); g < 0: g * e / (1 + e) */
            __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
            __m512 act = rounded(_mm512_div_ps(num, _mm512_add_ps(one, e)), bf16);
            store(y, bf16, r * inter + i, _mm512_mul_ps(act, load(upx, bf16, r * stride + i)));
        }
    }
}
