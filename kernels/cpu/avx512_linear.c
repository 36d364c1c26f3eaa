/* bf16 linear on AVX512-BF16 (vdpbf16ps), for CPUs without AMX (AMD Zen 4 and later, Intel Cooper Lake):
 * y[M, N] = x[M, K] . w[N, K]^T with fp32 accumulation, in the output modes of amx_linear.c.
 *
 * It reads the AMX kernel's packed weights (ih_amx_pack): each 64-byte row of a B tile holds one k pair of
 * 16 output columns, which is exactly the operand vdpbf16ps wants against a broadcast (x[r, k], x[r, k+1])
 * pair. So one packed copy serves both kernels.
 *
 * The product walks 32-column blocks (split between threads); for each it runs the rows in groups of up
 * to MR_MAX, with 2 x MR accumulators (two 16-column halves per row) held in registers over the whole
 * reduction: per k pair, 2 weight loads feed 2 x MR vdpbf16ps, each with its x pair broadcast from memory.
 * A column block (32 x K bf16: 40 KiB at K = 640) is read from memory by the first row group and from L2
 * by the next. Each row's sum runs in one fixed order whatever M is, so results are batch-invariant.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define MR_MAX 12
#ifndef PF_DIST
#define PF_DIST 4 /* k steps (2 KiB each) of the weight block prefetched ahead */
#endif

/* one k pair of mr rows of x (at xp, row stride ldx) against the operands of columns 0-15 (w0) and 16-31 (w1) */
static inline __attribute__((always_inline)) void pair_dots(__m512 acc[][2], const uint16_t *xp, int64_t ldx, int mr,
                                                            __m512bh w0, __m512bh w1) {
  for (int i = 0; i < mr; i++) {
    int32_t pair;
    memcpy(&pair, xp + i * ldx, 4);
    const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
  }
}

static inline __attribute__((always_inline)) void store_sums(__m512 acc[][2], int mr, float *out /* [mr][32] */) {
  for (int i = 0; i < mr; i++) {
    _mm512_storeu_ps(out + i * 32, acc[i][0]);
    _mm512_storeu_ps(out + i * 32 + 16, acc[i][1]);
  }
}

static inline __attribute__((always_inline)) void rows_block(const uint16_t *x, int64_t ldx, const uint16_t *b,
                                                             int64_t kbs, int mr, int fetch, float *out /* [mr][32] */) {
  __m512 acc[MR_MAX][2];
  for (int i = 0; i < mr; i++) { acc[i][0] = _mm512_setzero_ps(); acc[i][1] = _mm512_setzero_ps(); }
  for (int64_t kb = 0; kb < kbs; kb++, b += 1024) {
    for (int kp = 0; kp < 16; kp++) {
      if (fetch) { /* the first row group pulls the block PF_DIST k steps ahead into L2: 2 of its 32 lines a
                      k pair (into L2 rather than L1: 1.05-1.15x at 1-32 rows on Zen 4, measured) */
        _mm_prefetch((const char *)(b + PF_DIST * 1024) + kp * 128, _MM_HINT_T1);
        _mm_prefetch((const char *)(b + PF_DIST * 1024) + kp * 128 + 64, _MM_HINT_T1);
      }
      pair_dots(acc, x + kb * 32 + kp * 2, ldx, mr, (__m512bh)_mm512_loadu_si512(b + kp * 32),
                (__m512bh)_mm512_loadu_si512(b + 512 + kp * 32));
    }
  }
  store_sums(acc, mr, out);
}

/* one instance per row count, so every loop over rows above is unrolled with its accumulators in registers */
#define ROWS(n) \
  static void rows_##n(const uint16_t *x, int64_t ldx, const uint16_t *b, int64_t kbs, int fetch, float *out) { \
    rows_block(x, ldx, b, kbs, n, fetch, out); \
  }
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
typedef void (*rows_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int, float *);
static const rows_fn ROWS_FN[MR_MAX + 1] = {0,      rows_1, rows_2, rows_3,  rows_4,  rows_5, rows_6,
                                            rows_7, rows_8, rows_9, rows_10, rows_11, rows_12};

/* rows [r0, r0 + mr) of y, columns [c0, c0 + 32) clipped to n, from their fp32 sums [mr][32], in the output mode */
static inline void store_block(const float *sums, int mr, void *y, int mode, int64_t ldy, int64_t r0, int64_t c0,
                               int64_t n) {
  const int64_t left = n - c0;
  const __mmask16 m0 = tail_mask(left), m1 = tail_mask(left > 16 ? left - 16 : 0);
  for (int i = 0; i < mr; i++) {
    store_row(_mm512_loadu_ps(sums + i * 32), y, mode, ldy, r0 + i, c0, m0);
    if (m1) store_row(_mm512_loadu_ps(sums + i * 32 + 16), y, mode, ldy, r0 + i, c0 + 16, m1);
  }
}

/* x [m, k] bf16 (row stride ldx, k % 32 == 0), wp packed by ih_amx_pack for n columns, y [m, n] (row stride
 * ldy) in output mode `mode` (OUT_*, simd.h). Only the m rows are read: no padding is needed. */
void ih_avx512_linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *wp, int64_t n, void *y,
                      int64_t ldy, int mode) {
  const int64_t nbs = (n + 31) / 32, kbs = k / 32;
  const int groups = (int)((m + MR_MAX - 1) / MR_MAX);
#pragma omp parallel
  {
    float sums[MR_MAX * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < nbs; nb++) {
      const uint16_t *b = wp + nb * kbs * 1024;
      for (int g = 0; g < groups; g++) {
        /* even groups: 32 rows run as 11 + 11 + 10, not 12 + 12 + 8 */
        const int64_t r0 = m * g / groups, r1 = m * (g + 1) / groups;
        const int mr = (int)(r1 - r0);
        ROWS_FN[mr](x + r0 * ldx, ldx, b, kbs, g == 0, sums);
        store_block(sums, mr, y, mode, ldy, r0, nb * 32, n);
      }
    }
  }
}

/* ---- int8 block weights, dequantised in registers ----
 *
 * A GGUF weight of Q8_0, Q5_0, Q6_K or Q4_K blocks is, per output column and block of bk (16 or 32) k
 * values, small integers v with one fp32 scale a (and for Q4_K an fp32 offset o): the loader's fp32 weight
 * is fl(fl(v a) - o) (o = 0: fl(v a)). The kernel keeps v as int8 (1 byte a weight instead of 2), forms
 * those fp32 values with the same two roundings (no fused multiply-add: -ffp-contract=off), rounds them to
 * bf16 to nearest even as torch casts, and runs the bf16 product above on them: the result is bit-identical
 * to ih_avx512_linear over the bf16 weight. At a few rows the product is bound by reading weights, and the
 * unpacking (7 vector operations a k pair of 16 columns) fits in the time the halved bytes save.
 *
 * Packed layout (ih_q8_pack): per 32-column block, per k pair one 64-byte line: 16 columns x 2 k (column
 * 0's pair first) for columns 0-15, then for 16-31; scales (and offsets) [block][k / bk][32] fp32.
 */
#define Q8_FUSED_MAX 8 /* rows a pass: 2 x 8 accumulators, the operands and the scales fit the 32 registers */
#ifndef Q8_PF_LINES
#define Q8_PF_LINES 32 /* lines (k pairs) prefetched ahead: 1.08x over 16 at 1 row, measured */
#endif

typedef struct {
  __m512 s[2][2], o[2][2]; /* [half][lo: columns 0-7 of the half, hi: 8-15], each scale twice (the k pair) */
} q8_scales;

static inline __attribute__((always_inline)) void q8_load_scales(const float *sc, const float *of, q8_scales *q) {
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int h = 0; h < 2; h++) {
    const __m512 s = _mm512_loadu_ps(sc + 16 * h);
    q->s[h][0] = _mm512_permutexvar_ps(lo, s);
    q->s[h][1] = _mm512_permutexvar_ps(hi, s);
    if (of) {
      const __m512 o = _mm512_loadu_ps(of + 16 * h);
      q->o[h][0] = _mm512_permutexvar_ps(lo, o);
      q->o[h][1] = _mm512_permutexvar_ps(hi, o);
    }
  }
}

/* one half's k pair of 16 columns (32 int8) as the bf16 operand of vdpbf16ps */
static inline __attribute__((always_inline)) __m512bh q8_operand(const int8_t *v, const q8_scales *q, int h, int off) {
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)v)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + 16))));
  lo = _mm512_mul_ps(lo, q->s[h][0]);
  hi = _mm512_mul_ps(hi, q->s[h][1]);
  if (off) {
    lo = _mm512_sub_ps(lo, q->o[h][0]);
    hi = _mm512_sub_ps(hi, q->o[h][1]);
  }
  return _mm512_cvtne2ps_pbh(hi, lo); /* lo in the low 16 lanes */
}

static inline __attribute__((always_inline)) void q8_rows_block(const uint16_t *x, int64_t ldx, const int8_t *b,
                                                                const float *sc, const float *of, int64_t k,
                                                                int64_t bk, int mr, float *out) {
  __m512 acc[Q8_FUSED_MAX][2];
  for (int i = 0; i < mr; i++) { acc[i][0] = _mm512_setzero_ps(); acc[i][1] = _mm512_setzero_ps(); }
  q8_scales q;
  for (int64_t j = 0; j < k / bk; j++) {
    q8_load_scales(sc + j * 32, of ? of + j * 32 : 0, &q);
    for (int64_t p = j * bk / 2; p < (j + 1) * bk / 2; p++) {
      _mm_prefetch((const char *)(b + (p + Q8_PF_LINES) * 64), _MM_HINT_T0);
      pair_dots(acc, x + 2 * p, ldx, mr, q8_operand(b + p * 64, &q, 0, of != 0), q8_operand(b + p * 64 + 32, &q, 1, of != 0));
    }
  }
  store_sums(acc, mr, out);
}

#define Q8_ROWS(n) \
  static void q8_rows_##n(const uint16_t *x, int64_t ldx, const int8_t *b, const float *sc, const float *of, int64_t k, \
                          int64_t bk, float *out) { \
    q8_rows_block(x, ldx, b, sc, of, k, bk, n, out); \
  }
Q8_ROWS(1) Q8_ROWS(2) Q8_ROWS(3) Q8_ROWS(4) Q8_ROWS(5) Q8_ROWS(6) Q8_ROWS(7) Q8_ROWS(8)
typedef void (*q8_rows_fn)(const uint16_t *, int64_t, const int8_t *, const float *, const float *, int64_t, int64_t, float *);
static const q8_rows_fn Q8_ROWS_FN[Q8_FUSED_MAX + 1] = {0,        q8_rows_1, q8_rows_2, q8_rows_3, q8_rows_4,
                                                        q8_rows_5, q8_rows_6, q8_rows_7, q8_rows_8};

int64_t ih_q8_packed_bytes(int64_t n, int64_t k) { return ((n + 31) / 32) * 32 * k; }

/* v [n, k] int8 (row stride ldv), sc and of [n, k / bk] fp32 (row stride k / bk; of may be NULL) -> wq
 * (ih_q8_packed_bytes), scp and ofp [(n + 31) / 32][k / bk][32] (padding columns: v = 0, scale 0, offset 0) */
void ih_q8_pack(const int8_t *v, int64_t ldv, const float *sc, const float *of, int64_t n, int64_t k, int64_t bk,
                int8_t *wq, float *scp, float *ofp) {
  const int64_t nbs = (n + 31) / 32, nj = k / bk;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < nbs; nb++)
    for (int c = 0; c < 32; c++) {
      const int64_t col = nb * 32 + c;
      int8_t *dst = wq + nb * 32 * k + (c / 16) * 32 + (c % 16) * 2;
      for (int64_t p = 0; p < k / 2; p++) {
        dst[p * 64] = col < n ? v[col * ldv + 2 * p] : 0;
        dst[p * 64 + 1] = col < n ? v[col * ldv + 2 * p + 1] : 0;
      }
      for (int64_t j = 0; j < nj; j++) {
        scp[(nb * nj + j) * 32 + c] = col < n ? sc[col * nj + j] : 0.f;
        if (of) ofp[(nb * nj + j) * 32 + c] = col < n ? of[col * nj + j] : 0.f;
      }
    }
}

/* x [m, k] bf16 (row stride ldx, k % 32 == 0) . w^T for w packed by ih_q8_pack (bk 16 or 32; ofp may be
 * NULL) over n columns -> y [m, n] (row stride ldy) in output mode `mode`: bit-identical to ih_avx512_linear
 * over the bf16 weight bf16(fl(fl(v a) - o)). Rows run in groups of up to Q8_FUSED_MAX, each unpacking the
 * weights again: past a few rows the bf16 packed weight is faster (int_block.py picks). */
void ih_q8_linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *wq, const float *scp,
                  const float *ofp, int64_t bk, int64_t n, void *y, int64_t ldy, int mode) {
  const int64_t nbs = (n + 31) / 32, nj = k / bk, groups = (m + Q8_FUSED_MAX - 1) / Q8_FUSED_MAX;
#pragma omp parallel
  {
    float sums[Q8_FUSED_MAX * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < nbs; nb++) {
      const int8_t *b = wq + nb * 32 * k;
      const float *sc = scp + nb * nj * 32, *of = ofp ? ofp + nb * nj * 32 : 0;
      for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = m * g / groups, r1 = m * (g + 1) / groups;
        const int mr = (int)(r1 - r0);
        Q8_ROWS_FN[mr](x + r0 * ldx, ldx, b, sc, of, k, bk, sums);
        store_block(sums, mr, y, mode, ldy, r0, nb * 32, n);
      }
    }
  }
}
