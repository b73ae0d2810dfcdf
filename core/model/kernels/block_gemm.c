/* Products of activations with weights kept in a GGUF's own blocks (kvboost_rag's
 * ``model/blocks.py``): y = x W^T + b, W[n, k] = scale[n, g] * (q[n, k] - zero) + min[n, g]
 * over groups g of ``group`` inputs (16 or 32), q unsigned (4 bits: two per byte; 8 bits: a
 * byte). As llama.cpp does for its K- and legacy quants, each group of an input row is
 * quantized to int8 with its own scale first, so the product is integer arithmetic
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
#define VERSION 2

int block_gemm_version(void) { return VERSION; }

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
