/* Products of activations with weights kept in a GGUF's own blocks (kvboost_rag's
 * ``model/blocks.py``): y = x W^T + b, W[n, k] = scale[n, g] * (q[n, k] - zero) + min[n, g]
 * over groups g of ``group`` inputs (16 or 32), q unsigned (4 bits: two per byte; 8 bits: a
 * byte). As llama.cpp does for its K- and legacy quants, each group of an input row is
 * quantized to int8 with its own scale first (Q4_K's own path below: each 256 inputs),
 * so the product is integer arithmetic
 * (AVX512-VNNI vpdpbusd: u8 weights times s8 inputs, exact int32 sums) and each group's sum
 * is scaled once. The weights are read once per tile of up to MR rows, never dequantized.
 *
 * Layouts (made by ``blocks.pack``), for N outputs in blocks of 16 and K inputs:
 *   q      8 bits: [N/16][K/4][16][4] bytes; 4 bits: [N/16][K/8][16][4], a byte holding
 *          input 8j + t in its low nibble and 8j + 4 + t in its high one
 *   scale  fp16 [N/16][K/group][16]; mins (or NULL: symmetric) the same
 * A row's arithmetic does not depend on how many rows share the call (tiles of every size
 * add the same terms in the same order), so a batch gives each row what it alone would.
 *
 * Threads: one OpenMP team over output blocks, in the OpenMP runtime torch loaded (this
 * library is loaded after torch, whose libgomp.so.1 it then resolves to).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 8

static inline float load_input(const void *x, int bf16, int64_t i) {
    if (!bf16) return ((const float *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Each group of ``group`` inputs of row m: int8 values, their scale and their sum. */
void quantize_rows(const void *x, int bf16, int64_t M, int64_t K, int group, int8_t *xq,
                   float *xs, int32_t *xsum, int threads) {
    int64_t groups = K / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < groups; g++) {
            int64_t base = m * K + g * group;
            float amax = 0.f;
            for (int i = 0; i < group; i++) amax = fmaxf(amax, fabsf(load_input(x, bf16, base + i)));
            float step = amax / 127.f;
            float inv = step > 0.f ? 1.f / step : 0.f;
            int32_t sum = 0;
            for (int i = 0; i < group; i++) {
                int v = (int)nearbyintf(load_input(x, bf16, base + i) * inv);
                xq[base + i] = (int8_t)v;
                sum += v;
            }
            xs[m * groups + g] = step;
            xsum[m * groups + g] = sum;
        }
    }
}

static inline __m512i weights_quad(const uint8_t *q, int bits, int64_t quad) {
    if (bits == 8) return _mm512_loadu_si512((const void *)(q + quad * 64));
    __m512i v = _mm512_loadu_si512((const void *)(q + (quad >> 1) * 64));
    if (quad & 1) v = _mm512_srli_epi16(v, 4);
    return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}

static inline void store_row(void *y, int bf16, const float *bias, int64_t N, int64_t m,
                             int64_t n0, __m512 acc) {
    if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + n0));
    if (!bf16) {
        _mm512_storeu_ps((float *)y + m * N + n0, acc);
        return;
    }
    /* round to nearest even, as torch's float -> bfloat16 conversion does */
    __m512i u = _mm512_castps_si512(acc);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + m * N + n0), h);
}

/* Rows m0 .. m0 + rows of one block of 16 outputs. Always inlined with a constant ``rows``,
 * so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(
    int rows, const int8_t *xq, const float *xs, const int32_t *xsum, int64_t K, int group,
    const uint8_t *q, const uint16_t *scale, const uint16_t *mins, int zero, int bits,
    const float *bias, void *y, int bf16, int64_t N, int64_t nb, int64_t m0) {
    int64_t groups = K / group, quads = group / 4;
    int64_t qbytes = bits == 8 ? K * 16 : K * 8;
    const uint8_t *qb = q + nb * qbytes;
    const uint16_t *sb = scale + nb * groups * 16;
    const uint16_t *mb = mins ? mins + nb * groups * 16 : 0;
    __m512 acc[MR];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i sums[MR];
        for (int r = 0; r < rows; r++) sums[r] = _mm512_setzero_si512();
        for (int64_t j = 0; j < quads; j++) {
            int64_t quad = g * quads + j;
            __m512i w = weights_quad(qb, bits, quad);
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, xq + (m0 + r) * K + quad * 4, 4);
                sums[r] = _mm512_dpbusd_epi32(sums[r], w, _mm512_set1_epi32(four));
            }
        }
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + g * 16)));
        __m512 mn = mb ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mb + g * 16)))
                       : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            int64_t at = (m0 + r) * groups + g;
            __m512i exact = sums[r];
            if (zero) exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(zero * xsum[at]));
            __m512 f = _mm512_cvtepi32_ps(exact);
            acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(s, _mm512_set1_ps(xs[at])), acc[r]);
            if (mb) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[at] * (float)xsum[at]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_row(y, bf16, bias, N, m0 + r, nb * 16, acc[r]);
}

/* y[M][N] (fp32, or bf16 when ``bf16``) = the product of quantized rows and the blocks. */
void block_gemm(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,
                int group, const uint8_t *q, const uint16_t *scale, const uint16_t *mins,
                int zero, int bits, const float *bias, void *y, int bf16, int64_t N,
                int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++) {
        int64_t m0 = 0;
        for (; m0 + MR <= M; m0 += MR)
            tile(MR, xq, xs, xsum, K, group, q, scale, mins, zero, bits, bias, y, bf16, N, nb, m0);
        switch (M - m0) {
#define REST(n) \
    case n: tile(n, xq, xs, xsum, K, group, q, scale, mins, zero, bits, bias, y, bf16, N, nb, m0); break;
            REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7)
#undef REST
            default: break;
        }
    }
}

/* y = x W^T + b in one call, for a layer's forward: ``x``'s rows quantized into scratch
 * memory of its own, then ``block_gemm``. One row is quantized on the calling thread (a few
 * microseconds: a team would cost more); -1 when the scratch cannot be allocated. */
int block_linear(const void *x, int bf16, int64_t M, int64_t K, int group, const uint8_t *q,
                 const uint16_t *scale, const uint16_t *mins, int zero, int bits,
                 const float *bias, void *y, int64_t N, int threads) {
    int64_t groups = K / group;
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc((size_t)(M * groups) * sizeof(float));
    int32_t *xsum = malloc((size_t)(M * groups) * sizeof(int32_t));
    int ok = xq && xs && xsum;
    if (ok) {
        quantize_rows(x, bf16, M, K, group, xq, xs, xsum, M > 1 ? threads : 1);
        block_gemm(xq, xs, xsum, M, K, group, q, scale, mins, zero, bits, bias, y, bf16, N,
                   threads);
    }
    free(xq);
    free(xs);
    free(xsum);
    return ok ? 0 : -1;
}

/* ---- 4-bit K blocks (Q4_K): integer sub-scales, inputs quantized per super-block ----
 * W[n, k] = d[n, s] * sc[n, j] * q[n, k] - dmin[n, s] * mn[n, j], for super-blocks s of 256
 * inputs and their 8 sub-blocks j of 32, sc and mn 6-bit integers, d and dmin fp16: the
 * file's own numbers, none rounded again. As llama.cpp's Q8_K does, each 256 inputs of a
 * row are quantized with one scale, so a sub-block's int32 sum is multiplied by its integer
 * scale in integers (exact: |sum| <= 63 * 256 * 15 * 127 < 2^31) and a super-block's sum
 * is turned to float once, and the minimums' term is one int16 product a super-block
 * (the row's per-32 sums times mn, vpdpwssd).
 * Layouts for N outputs in blocks of 16: q as above (4 bits); sc uint8 [N/16][K/32][16];
 * mn uint8 [N/16][K/64][16][2] (sub-blocks 2p and 2p + 1 side by side); units fp16
 * [N/16][K/256][2][16], d then dmin. */
#define SUPER 256

/* 16 inputs from x[i..i+16) as floats (bf16 widened exactly). */
static inline __m512 load16(const void *x, int bf16, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Each 256 inputs of row m: int8 values, one scale, and the sums of each ``sub`` (int16).
 * Vectorized, and the same numbers as the scalar form: |x| max, x * (127 / max) rounded to
 * nearest even (the conversion's default mode, as nearbyintf). A decoding step quantizes
 * ~380k inputs at Qwen2.5-Coder-1.5B, on one thread: 17 us for 8960 scalar, ~2 here. */
void quantize_rows_k(const void *x, int bf16, int64_t M, int64_t K, int sub, int8_t *xq,
                     float *xs, int16_t *bs, int threads) {
    int64_t supers = K / SUPER;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t s = 0; s < supers; s++) {
            int64_t base = m * K + s * SUPER;
            __m512 amax = _mm512_setzero_ps();
            for (int i = 0; i < SUPER; i += 16)
                amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x, bf16, base + i)));
            float step = _mm512_reduce_max_ps(amax) / 127.f;
            __m512 inv = _mm512_set1_ps(step > 0.f ? 1.f / step : 0.f);
            for (int j = 0; j < SUPER / sub; j++) {
                __m512i sum = _mm512_setzero_si512();
                for (int i = 0; i < sub; i += 16) {
                    int64_t at = base + sub * j + i;
                    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, bf16, at), inv));
                    _mm_storeu_si128((__m128i *)(xq + at), _mm512_cvtepi32_epi8(v));
                    sum = _mm512_add_epi32(sum, v);
                }
                bs[(m * supers + s) * (SUPER / sub) + j] = (int16_t)_mm512_reduce_add_epi32(sum);
            }
            xs[m * supers + s] = step;
        }
    }
}

static inline __attribute__((always_inline)) void tile_k4(
    int rows, const int8_t *xq, const float *xs, const int16_t *bs, int64_t K,
    const uint8_t *q, const uint8_t *sc, const uint8_t *mn, const uint16_t *units,
    const float *bias, void *y, int bf16, int64_t N, int64_t nb, int64_t m0) {
    int64_t supers = K / SUPER;
    const uint8_t *qb = q + nb * K * 8, *scb = sc + nb * (K / 32) * 16;
    const uint8_t *mnb = mn + nb * (K / 32) * 16;
    const uint16_t *ub = units + nb * supers * 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MR];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        __m512i isum[MR], part[MR];
        for (int r = 0; r < rows; r++) isum[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const uint8_t *w = qb + (s * 8 + j) * 256;
            for (int r = 0; r < rows; r++) part[r] = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                __m512i v = _mm512_loadu_si512((const void *)(w + t * 64));
                __m512i lo = _mm512_and_si512(v, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < rows; r++) {
                    const int8_t *xr = xq + (m0 + r) * K + s * SUPER + j * 32 + t * 8;
                    int32_t a, b;
                    memcpy(&a, xr, 4);
                    memcpy(&b, xr + 4, 4);
                    part[r] = _mm512_dpbusd_epi32(part[r], lo, _mm512_set1_epi32(a));
                    part[r] = _mm512_dpbusd_epi32(part[r], hi, _mm512_set1_epi32(b));
                }
            }
            __m512i scale = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(scb + (s * 8 + j) * 16)));
            for (int r = 0; r < rows; r++)
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(part[r], scale));
        }
        for (int r = 0; r < rows; r++) part[r] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __m512i m = _mm512_cvtepu8_epi16(
                _mm256_loadu_si256((const __m256i *)(mnb + (s * 4 + p) * 32)));
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, bs + ((m0 + r) * supers + s) * 8 + 2 * p, 4);
                part[r] = _mm512_dpwssd_epi32(part[r], m, _mm512_set1_epi32(pair));
            }
        }
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ub + s * 32)));
        __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ub + s * 32 + 16)));
        for (int r = 0; r < rows; r++) {
            __m512 step = _mm512_set1_ps(xs[(m0 + r) * supers + s]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dv, step), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(part[r]), _mm512_mul_ps(mv, step), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_row(y, bf16, bias, N, m0 + r, nb * 16, acc[r]);
}

#define KR 4 /* rows a K tile: two int32 sums a row besides its accumulator */

void block_gemm_k4(const int8_t *xq, const float *xs, const int16_t *bs, int64_t M, int64_t K,
                   const uint8_t *q, const uint8_t *sc, const uint8_t *mn,
                   const uint16_t *units, const float *bias, void *y, int bf16, int64_t N,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++) {
        int64_t m0 = 0;
        for (; m0 + KR <= M; m0 += KR)
            tile_k4(KR, xq, xs, bs, K, q, sc, mn, units, bias, y, bf16, N, nb, m0);
        switch (M - m0) {
#define REST(n) \
    case n: tile_k4(n, xq, xs, bs, K, q, sc, mn, units, bias, y, bf16, N, nb, m0); break;
            REST(1) REST(2) REST(3)
#undef REST
            default: break;
        }
    }
}

int block_linear_k4(const void *x, int bf16, int64_t M, int64_t K, const uint8_t *q,
                    const uint8_t *sc, const uint8_t *mn, const uint16_t *units,
                    const float *bias, void *y, int64_t N, int threads) {
    int64_t supers = K / SUPER;
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc((size_t)(M * supers) * sizeof(float));
    int16_t *bs = malloc((size_t)(M * supers * 8) * sizeof(int16_t));
    int ok = xq && xs && bs;
    if (ok) {
        quantize_rows_k(x, bf16, M, K, 32, xq, xs, bs, M > 1 ? threads : 1);
        block_gemm_k4(xq, xs, bs, M, K, q, sc, mn, units, bias, y, bf16, N, threads);
    }
    free(xq);
    free(xs);
    free(bs);
    return ok ? 0 : -1;
}

/* ---- 6-bit K blocks (Q6_K) in 6 bits: W[n, k] = d[n, s] * sc[n, j] * (q[n, k] - 32) over
 * super-blocks s of 256 inputs and sub-blocks j of 16, sc a signed 8-bit integer, d fp16:
 * the file's own numbers. A level's low 4 bits are kept as the 4-bit layout above, its top
 * 2 bits in a second plane, ``high``: [N/16][K/16][16][4] bytes, byte (n, t) of sub-block j
 * holding in its bits 2k, 2k + 1 the top bits of input 16j + 4k + t. Inputs are quantized
 * per 256 with the sums of each 16; |sc * (sum - 32 * sums)| < 2^31 / 16.
 * Layouts: sc int8 [N/16][K/16][16]; units fp16 [N/16][K/256][16] (d). */
static inline __attribute__((always_inline)) void tile_k6(
    int rows, const int8_t *xq, const float *xs, const int16_t *bs, int64_t K,
    const uint8_t *q, const uint8_t *high, const int8_t *sc, const uint16_t *units,
    const float *bias, void *y, int bf16, int64_t N, int64_t nb, int64_t m0) {
    int64_t supers = K / SUPER;
    const uint8_t *qb = q + nb * K * 8, *hb = high + nb * K * 4;
    const int8_t *scb = sc + nb * (K / 16) * 16;
    const uint16_t *ub = units + nb * supers * 16;
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512 acc[MR];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        __m512i isum[MR], part[MR];
        for (int r = 0; r < rows; r++) isum[r] = _mm512_setzero_si512();
        for (int j = 0; j < 16; j++) {
            int64_t unit = s * 16 + j; /* sub-block: 16 inputs, two nibble loads, one high */
            __m512i v0 = _mm512_loadu_si512((const void *)(qb + unit * 128));
            __m512i v1 = _mm512_loadu_si512((const void *)(qb + unit * 128 + 64));
            __m512i h = _mm512_loadu_si512((const void *)(hb + unit * 64));
            __m512i w[4];
            w[0] = _mm512_or_si512(_mm512_and_si512(v0, low),
                                   _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
            w[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), low),
                                   _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
            w[2] = _mm512_or_si512(_mm512_and_si512(v1, low), _mm512_and_si512(h, top));
            w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), low),
                                   _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + (m0 + r) * K + s * SUPER + j * 16;
                __m512i sum = _mm512_setzero_si512();
                for (int k = 0; k < 4; k++) {
                    int32_t four;
                    memcpy(&four, xr + 4 * k, 4);
                    sum = _mm512_dpbusd_epi32(sum, w[k], _mm512_set1_epi32(four));
                }
                part[r] = sum;
            }
            __m512i scale = _mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(scb + unit * 16)));
            for (int r = 0; r < rows; r++) {
                int32_t zero = 32 * (int32_t)bs[((m0 + r) * supers + s) * 16 + j];
                __m512i centred = _mm512_sub_epi32(part[r], _mm512_set1_epi32(zero));
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(centred, scale));
            }
        }
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ub + s * 16)));
        for (int r = 0; r < rows; r++) {
            __m512 step = _mm512_mul_ps(dv, _mm512_set1_ps(xs[(m0 + r) * supers + s]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), step, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_row(y, bf16, bias, N, m0 + r, nb * 16, acc[r]);
}

int block_linear_k6(const void *x, int bf16, int64_t M, int64_t K, const uint8_t *q,
                    const uint8_t *high, const int8_t *sc, const uint16_t *units,
                    const float *bias, void *y, int64_t N, int threads) {
    int64_t supers = K / SUPER;
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc((size_t)(M * supers) * sizeof(float));
    int16_t *bs = malloc((size_t)(M * supers * 16) * sizeof(int16_t));
    int ok = xq && xs && bs;
    if (ok) {
        quantize_rows_k(x, bf16, M, K, 16, xq, xs, bs, M > 1 ? threads : 1);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t nb = 0; nb < N / 16; nb++) {
            int64_t m0 = 0;
            for (; m0 + KR <= M; m0 += KR)
                tile_k6(KR, xq, xs, bs, K, q, high, sc, units, bias, y, bf16, N, nb, m0);
            switch (M - m0) {
#define REST(n) \
    case n: tile_k6(n, xq, xs, bs, K, q, high, sc, units, bias, y, bf16, N, nb, m0); break;
                REST(1) REST(2) REST(3)
#undef REST
                default: break;
            }
        }
    }
    free(xq);
    free(xs);
    free(bs);
    return ok ? 0 : -1;
}
