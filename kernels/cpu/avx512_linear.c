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
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + kp * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b + 512 + kp * 32);
      const uint16_t *xp = x + kb * 32 + kp * 2;
      for (int i = 0; i < mr; i++) {
        int32_t pair;
        memcpy(&pair, xp + i * ldx, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
      }
    }
  }
  for (int i = 0; i < mr; i++) {
    _mm512_storeu_ps(out + i * 32, acc[i][0]);
    _mm512_storeu_ps(out + i * 32 + 16, acc[i][1]);
  }
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
      const int nc0 = n - nb * 32 >= 16 ? 16 : (int)(n - nb * 32);
      const int nc1 = n - nb * 32 - 16 >= 16 ? 16 : (int)(n - nb * 32 - 16 > 0 ? n - nb * 32 - 16 : 0);
      for (int g = 0; g < groups; g++) {
        /* even groups: 32 rows run as 11 + 11 + 10, not 12 + 12 + 8 */
        const int64_t r0 = m * g / groups, r1 = m * (g + 1) / groups;
        const int mr = (int)(r1 - r0);
        ROWS_FN[mr](x + r0 * ldx, ldx, b, kbs, g == 0, sums);
        for (int i = 0; i < mr; i++) {
          store_row(_mm512_loadu_ps(sums + i * 32), y, mode, ldy, r0 + i, nb * 32, tail_mask(nc0));
          if (nc1) store_row(_mm512_loadu_ps(sums + i * 32 + 16), y, mode, ldy, r0 + i, nb * 32 + 16, tail_mask(nc1));
        }
      }
    }
  }
}
