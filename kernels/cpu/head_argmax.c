/* Greedy tokens from a bf16 LM head without its logits: each row's argmax of the bf16-rounded x . w^T that
 * avx512_linear.c computes (first index on ties), exactly, from an int8 screen and a few exact columns.
 *
 * Screen (AVX512-VNNI, vpdpbusd): the head is kept as int8 (one fp32 scale sw per vocabulary row, stored
 * +128 as uint8) and each activation row is quantised to int8 with one scale per GROUP channels. The
 * screen's estimate A of a logit comes with a rigorous bound B on |A - exact| (built by head.py:
 * Cauchy-Schwarz over the two quantisation residuals, the fp32 rounding of the exact product and of A
 * itself), so D = A - B <= exact <= A + B = U. Per row, lo = max D is a lower bound of the largest logit;
 * only columns with U >= lo - slack (slack covers bf16 rounding ties) can be the argmax. Each thread keeps
 * its rows' candidates (index, U) while it walks its columns, pruning them as lo rises.
 *
 * Exact step: every surviving candidate's dot product is recomputed with vdpbf16ps on its own lane, from
 * the head itself (row-major bf16: a candidate's k values are contiguous, so 16 candidates touch 16 runs
 * of 2 K bytes, where the AMX-layout copy would spread each over K / 2 cache lines), in avx512_linear.c's
 * order (k pairs ascending from zero), so its value is bit-identical to that kernel's, then rounded to
 * bf16 as the head's output is. A row whose candidates overflow the buffer is flagged for the caller,
 * which then runs the full head for it.
 *
 * Weights: wq [nb][k/4][32 columns][4 k] uint8 (32-column blocks, k in quads: one 64-byte load holds a k
 * quad of 16 columns, vpdpbusd's unsigned operand against a broadcast quad of signed activations).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define HR_MAX 6  /* rows per pass: 4 x HR_MAX accumulators (int and fp32, two 16-column halves) */
#define GROUP 64  /* activation channels per scale (head.py's GROUP) */
#define PF_QUADS 128 /* prefetch distance in k quads of 128 bytes: 16 KB, most of a 32-column block (k = 640: 20 KB) ahead */

static inline float bf16_value(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float v;
  memcpy(&v, &bits, 4);
  return v;
}

/* A [mr][32] for one 32-column block: sum over groups of sx[r, g] * (int32 sums of the group). Each k quad
 * prefetches two lines, pf + 64 * floor(j pfr / 2^16) for j = 2 kq, 2 kq + 1 (pfr = 2^16: the next two) */
static inline __attribute__((always_inline)) void screen_block(const int8_t *xq, int64_t k, const float *sx,
                                                               int64_t groups, const uint8_t *b, int mr,
                                                               const char *pf, int64_t pfr, float *out) {
  __m512 f[HR_MAX][2];
  for (int i = 0; i < mr; i++) { f[i][0] = _mm512_setzero_ps(); f[i][1] = _mm512_setzero_ps(); }
  for (int64_t g = 0; g < groups; g++) {
    __m512i t[HR_MAX][2];
    for (int i = 0; i < mr; i++) { t[i][0] = _mm512_setzero_si512(); t[i][1] = _mm512_setzero_si512(); }
#pragma GCC unroll 16 /* rolled, gcc 12 copies each accumulator twice a k quad (2 x mr moves per 2 x mr dots) */
    for (int q = 0; q < GROUP / 4; q++) {
      const int64_t kq = g * (GROUP / 4) + q;
      _mm_prefetch(pf + (((2 * kq) * pfr) >> 16) * 64, _MM_HINT_T1);
      _mm_prefetch(pf + (((2 * kq + 1) * pfr) >> 16) * 64, _MM_HINT_T1);
      const __m512i w0 = _mm512_loadu_si512(b + kq * 128), w1 = _mm512_loadu_si512(b + kq * 128 + 64);
      for (int i = 0; i < mr; i++) {
        int32_t quad;
        memcpy(&quad, xq + i * k + kq * 4, 4);
        const __m512i a = _mm512_set1_epi32(quad);
        t[i][0] = _mm512_dpbusd_epi32(t[i][0], w0, a);
        t[i][1] = _mm512_dpbusd_epi32(t[i][1], w1, a);
      }
    }
    for (int i = 0; i < mr; i++) {
      const __m512 s = _mm512_set1_ps(sx[i * groups + g]);
      f[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[i][0]), s, f[i][0]);
      f[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[i][1]), s, f[i][1]);
    }
  }
  for (int i = 0; i < mr; i++) {
    _mm512_storeu_ps(out + i * 32, f[i][0]);
    _mm512_storeu_ps(out + i * 32 + 16, f[i][1]);
  }
}

#define SCREEN(n) \
  static void screen_##n(const int8_t *xq, int64_t k, const float *sx, int64_t groups, const uint8_t *b, const char *pf, int64_t pfr, float *out) { \
    screen_block(xq, k, sx, groups, b, n, pf, pfr, out); \
  }
SCREEN(1) SCREEN(2) SCREEN(3) SCREEN(4) SCREEN(5) SCREEN(6)
typedef void (*screen_fn)(const int8_t *, int64_t, const float *, int64_t, const uint8_t *, const char *, int64_t, float *);
static const screen_fn SCREEN_FN[HR_MAX + 1] = {0, screen_1, screen_2, screen_3, screen_4, screen_5, screen_6};

/* how far below lo a column's upper bound may lie and still round to the same bf16 as the largest logit */
static inline float slack(float lo) { return fabsf(lo) * 0x1p-5f + 0x1p-100f; }

typedef struct {
  int32_t *idx;
  float *up;
  int64_t n;
  float lo;              /* this thread's lower bound of the row's largest logit: the max of its columns' D */
  float thr;             /* lo - slack(lo) for some lo no larger than the latest (the candidates' cut) */
  volatile float *los;   /* every thread's lo for this row (thread t at los[t * stride]) */
  int64_t stride;
  int tid, nt;
  int overflow;
} cands;

/* the best lower bound any thread has published for this row: each bounds the row's largest logit, so a
 * stale read only keeps more candidates */
static inline float row_lo(const cands *c) {
  float lo = c->lo;
  for (int t = 0; t < c->nt; t++) lo = fmaxf(lo, c->los[t * c->stride]);
  return lo;
}

/* keep only the entries that can still win under lo */
static void prune(cands *c) {
  const float lo = row_lo(c), thr = lo - slack(lo);
  int64_t j = 0;
  for (int64_t i = 0; i < c->n; i++)
    if (c->up[i] >= thr) { c->idx[j] = c->idx[i]; c->up[j] = c->up[i]; j++; }
  c->n = j;
}

/* one row's 32 columns of a block: bounds, lo, and the candidates they leave. Most blocks hold none: they
 * are rejected against c->thr, a threshold from an earlier (so no larger) lo, which only keeps more. */
static inline void admit(cands *c, const float *a32, const float *rc, const float *col, int64_t npad, int64_t c0,
                         int64_t n, int64_t cap) {
  const __m512 cr = _mm512_set1_ps(rc[0]), ar = _mm512_set1_ps(rc[1]), br = _mm512_set1_ps(rc[2]),
               er = _mm512_set1_ps(rc[3]);
  __m512 u[2], d[2];
  __mmask16 valid[2], nonfinite = 0;
  for (int h = 0; h < 2; h++) {
    const int64_t cc = c0 + h * 16;
    valid[h] = tail_mask(n - cc > 0 ? n - cc : 0);
    const __m512 sw = _mm512_loadu_ps(col + cc), p = _mm512_loadu_ps(col + npad + cc),
                 q = _mm512_loadu_ps(col + 2 * npad + cc);
    const __m512 a = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(a32 + h * 16), cr), sw);
    __m512 bnd = _mm512_fmadd_ps(ar, p, _mm512_fmadd_ps(br, q, _mm512_mul_ps(er, sw)));
    /* the fp32 rounding of the bound and of A +- B, with room to spare; 2^-40 covers the bf16 kernels'
       denormals-are-zero and flush-to-zero (< 2 K 2^-126 2^60 with every |x|, |w| <= 2^60: head.py) */
    bnd = _mm512_fmadd_ps(bnd, _mm512_set1_ps(1.f + 0x1p-10f),
                          _mm512_fmadd_ps(_mm512_abs_ps(a), _mm512_set1_ps(0x1p-20f), _mm512_set1_ps(0x1p-40f)));
    u[h] = _mm512_add_ps(a, bnd);
    d[h] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[h], _mm512_sub_ps(a, bnd));
    const __m512 span = _mm512_sub_ps(u[h], d[h]);
    nonfinite |= _mm512_mask_cmp_ps_mask(valid[h], _mm512_sub_ps(span, span), _mm512_setzero_ps(), _CMP_NEQ_UQ);
  }
  /* a logit or bound past fp32's range (huge inputs): no bound holds, the caller runs the full head */
  if (nonfinite) { c->overflow = 1; return; }
  const __m512 dmax = _mm512_max_ps(d[0], d[1]);
  if (_mm512_cmp_ps_mask(dmax, _mm512_set1_ps(c->lo), _CMP_GT_OQ)) {
    c->lo = _mm512_reduce_max_ps(dmax);
    c->los[c->tid * c->stride] = c->lo;
    c->thr = fmaxf(c->thr, c->lo - slack(c->lo)); /* it may already hold another thread's larger lo */
  }
  __mmask16 keep[2];
  for (int h = 0; h < 2; h++) keep[h] = _mm512_mask_cmp_ps_mask(valid[h], u[h], _mm512_set1_ps(c->thr), _CMP_GE_OQ);
  if (!(keep[0] | keep[1])) return;
  const float lo = row_lo(c), thr = lo - slack(lo); /* the other threads' lo too */
  c->thr = thr;
  for (int h = 0; h < 2; h++) {
    keep[h] &= _mm512_cmp_ps_mask(u[h], _mm512_set1_ps(thr), _CMP_GE_OQ);
    if (!keep[h]) continue;
    if (c->n + 16 > cap) {
      prune(c);
      if (c->n + 16 > cap) { c->overflow = 1; return; }
    }
    const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(c0 + h * 16)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    _mm512_mask_compressstoreu_epi32(c->idx + c->n, keep[h], ids);
    _mm512_mask_compressstoreu_ps(c->up + c->n, keep[h], u[h]);
    c->n += _mm_popcnt_u32(keep[h]);
  }
}

/* the bf16-rounded exact logits of up to 16 columns (lanes past cnt repeat column ids[0]) of one row, from
 * the row-major head w (row stride ldw; every dword index c ldw / 2 + k / 2 below 2^31: head.py) */
static __m512 exact16(const uint16_t *x, int64_t k, const uint16_t *w, int64_t ldw, const int32_t *ids, int cnt) {
  int32_t base[16];
  for (int j = 0; j < 16; j++) {
    const int64_t c = ids[j < cnt ? j : 0];
    base[j] = (int32_t)(c * (ldw / 2));
  }
  const __m512i vb = _mm512_loadu_si512(base);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; p++) {
    int32_t pair;
    memcpy(&pair, x + 2 * p, 4);
    const __m512i off = _mm512_add_epi32(vb, _mm512_set1_epi32((int32_t)p));
    const __m512bh wv = (__m512bh)_mm512_i32gather_epi32(off, (const void *)w, 4);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), wv);
  }
  return round_bf16(acc);
}

/* xq [m, k] int8 and sx [m, k / GROUP] fp32: the quantised rows; rowc [m, 4] fp32: (C, a, b, e) per row
 * (head.py); x [m, k] bf16 (row stride ldx): the rows themselves; wq: the int8 head for n columns, col
 * [3, npad] fp32: (sw, p, q) per column (npad = n rounded up to 32); w [n, k]: the bf16 head (row stride
 * ldw, even).
 * Writes tokens[m]; overflow[r] = 1 where row r's candidates did not fit in cap, or none survived (logits
 * past fp32's range), and its token is then not written. Returns the number of such rows, or -1 when out
 * of memory. */
int64_t ih_head_argmax_i8(const int8_t *xq, const float *sx, const float *rowc, const uint16_t *x, int64_t ldx,
                          int64_t m, int64_t k, const uint8_t *wq, const float *col, const uint16_t *w, int64_t ldw,
                          int64_t n, int64_t cap, int64_t *tokens, int32_t *overflow) {
  const int64_t nbs = (n + 31) / 32, npad = nbs * 32, groups = k / GROUP, rgroups = (m + HR_MAX - 1) / HR_MAX;
  const int nt = omp_get_max_threads();
  cands *all = calloc((size_t)(nt * m), sizeof(cands));
  int32_t *idx = malloc((size_t)(nt * m * cap) * sizeof(int32_t));
  float *up = malloc((size_t)(nt * m * cap) * sizeof(float));
  float *los = malloc((size_t)(nt * m) * sizeof(float));
  if (!all || !idx || !up || !los) { free(all); free(idx); free(up); free(los); return -1; }
  for (int64_t i = 0; i < nt * m; i++) {
    all[i] = (cands){idx + i * cap, up + i * cap, 0, -INFINITY, -INFINITY, los + i % m, m, (int)(i / m), nt, 0};
    los[i] = -INFINITY;
  }
#pragma omp parallel num_threads(nt)
  {
    cands *mine = all + omp_get_thread_num() * m;
    float a[HR_MAX * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < nbs; nb++) {
      const uint8_t *b = wq + nb * (k / 4) * 128;
      for (int64_t g = 0; g < rgroups; g++) {
        const int64_t r0 = m * g / rgroups, r1 = m * (g + 1) / rgroups;
        /* one pass streams PF_QUADS ahead; several share the next block's lines between them, so its memory
           reads spread over all passes instead of bunching in the first (1.07-1.18x at 8-32 rows, measured) */
        const int64_t lines = k / 2, l0 = lines * g / rgroups, l1 = lines * (g + 1) / rgroups;
        const char *pf = rgroups == 1 ? (const char *)(b + PF_QUADS * 128) : (const char *)(b + (k / 4) * 128) + l0 * 64;
        const int64_t pfr = rgroups == 1 ? (int64_t)1 << 16 : ((l1 - l0) << 16) / lines;
        SCREEN_FN[r1 - r0](xq + r0 * k, k, sx + r0 * groups, groups, b, pf, pfr, a);
        for (int64_t r = r0; r < r1; r++) admit(&mine[r], a + (r - r0) * 32, rowc + r * 4, col, npad, nb * 32, n, cap);
      }
    }
  }
  int64_t flagged = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : flagged)
  for (int64_t r = 0; r < m; r++) {
    int ovf = 0;
    for (int t = 0; t < nt; t++) ovf |= all[t * m + r].overflow;
    overflow[r] = ovf;
    if (ovf) { flagged++; continue; }
    float best = -INFINITY;
    int64_t arg = -1;
    for (int t = 0; t < nt; t++) {
      cands *c = &all[t * m + r];
      prune(c); /* under every thread's final lo */
      for (int64_t i = 0; i < c->n; i += 16) {
        const int cnt = c->n - i < 16 ? (int)(c->n - i) : 16;
        float v[16];
        _mm512_storeu_ps(v, exact16(x + r * ldx, k, w, ldw, c->idx + i, cnt));
        for (int j = 0; j < cnt; j++)
          if (v[j] > best || (v[j] == best && c->idx[i + j] < arg) || arg < 0) { best = v[j]; arg = c->idx[i + j]; }
      }
    }
    if (arg < 0) { /* no candidate survived: logits past fp32's range make the bounds inf or NaN */
      overflow[r] = 1;
      flagged++;
    } else {
      tokens[r] = arg;
    }
  }
  free(all); free(idx); free(up); free(los);
  return flagged;
}

/* The screen's copy of a bf16 head w [n, k] (row stride ldw): wq packed as above (int8 + 128; padding
 * columns 128), col [3, npad] = (sw, ||dw|| + gamma_K ||w||, ||wh||) per row, rounded up (head.py). Returns
 * -1, or the first row holding a value that is not finite or past 2^60 in magnitude (head.py's MAX_ABS:
 * no bound is kept then). */
int64_t ih_head_quantize(const uint16_t *w, int64_t n, int64_t k, int64_t ldw, uint8_t *wq, float *col) {
  const int64_t nbs = (n + 31) / 32, npad = nbs * 32;
  const double u = 0x1p-24, gamma = k * u / (1 - k * u), up = 1 + 0x1p-20;
  int64_t bad = n;
  memset(col, 0, (size_t)(3 * npad) * sizeof(float));
#pragma omp parallel for schedule(static) reduction(min : bad)
  for (int64_t r = 0; r < npad; r++) {
    uint8_t *dst = wq + (r / 32) * (k / 4) * 128 + (r % 32) * 4; /* (block, quad 0, column, k 0) */
    if (r >= n) {
      for (int64_t q = 0; q < k / 4; q++) memset(dst + q * 128, 128, 4);
      continue;
    }
    const uint16_t *row = w + r * ldw;
    double amax = 0;
    for (int64_t j = 0; j < k; j++) {
      const float v = bf16_value(row[j]);
      if (!(fabsf(v) <= 0x1p60f)) { bad = r < bad ? r : bad; amax = NAN; break; } /* see head.py: MAX_ABS */
      amax = fmax(amax, fabs((double)v));
    }
    if (isnan(amax)) continue;
    const float sw = (float)(amax / 127);
    double dw2 = 0, w2 = 0, wh2 = 0;
    for (int64_t j = 0; j < k; j++) {
      const float v = bf16_value(row[j]);
      double q = sw > 0 ? nearbyint((double)v / sw) : 0;
      q = q > 127 ? 127 : (q < -127 ? -127 : q);
      const double wh = q * (double)sw, d = (double)v - wh;
      dw2 += d * d; w2 += (double)v * v; wh2 += wh * wh;
      dst[(j / 4) * 128 + (j % 4)] = (uint8_t)((int)q + 128);
    }
    col[r] = sw;
    col[npad + r] = (float)((sqrt(dw2) + gamma * sqrt(w2)) * up);
    col[2 * npad + r] = (float)(sqrt(wh2) * up);
  }
  return bad < n ? bad : -1;
}

/* The screen's copy of bf16 activation rows x [m, k] (row stride ldx): xq [m, k] int8, one scale per GROUP
 * channels sx [m, k / GROUP] = (fp32) (max |x| / 127) (round half to even, as torch.round), and per row
 * rowc [4] = (C, ||x||, ||dx||, e), the last three rounded up (head.py's bound: C = sum_g sx_g 128 sum xq,
 * P = sum_g sx_g 255 sum |xq|, e = (groups + 6) u 1.02 (P + |C|)), all in float64. A row holding a value that
 * is not finite or past 2^60 in magnitude (head.py's MAX_ABS) gets bad[r] = 1 and zeros. Returns the number
 * of such rows. */
int64_t ih_head_rows(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, int8_t *xq, float *sx, float *rowc,
                     int32_t *bad) {
  const int64_t groups = k / GROUP;
  const double u = 0x1p-24, up = 1 + 0x1p-20;
  int64_t nbad = 0;
  for (int64_t r = 0; r < m; r++) {
    const uint16_t *row = x + r * ldx;
    int8_t *q8 = xq + r * k;
    float *s8 = sx + r * groups, *rc = rowc + r * 4;
    bad[r] = 0;
    for (int64_t j = 0; j < k; j++)
      if (!(fabsf(bf16_value(row[j])) <= 0x1p60f)) { bad[r] = 1; break; }
    if (bad[r]) {
      nbad++;
      memset(q8, 0, (size_t)k);
      memset(s8, 0, (size_t)groups * sizeof(float));
      memset(rc, 0, 4 * sizeof(float));
      continue;
    }
    double c = 0, p = 0, x2 = 0, dx2 = 0;
    for (int64_t g = 0; g < groups; g++) {
      const uint16_t *v = row + g * GROUP;
      double amax = 0;
      for (int j = 0; j < GROUP; j++) amax = fmax(amax, fabs((double)bf16_value(v[j])));
      const float sf = (float)(amax / 127);
      const double s = sf;
      double sq = 0, sa = 0;
      for (int j = 0; j < GROUP; j++) {
        const double xf = bf16_value(v[j]);
        double q = s > 0 ? nearbyint(xf / s) : 0;
        q = q > 127 ? 127 : (q < -127 ? -127 : q);
        const double d = xf - q * s;
        sq += q; sa += fabs(q); x2 += xf * xf; dx2 += d * d;
        q8[g * GROUP + j] = (int8_t)q;
      }
      s8[g] = sf;
      c += s * 128 * sq;
      p += s * 255 * sa;
    }
    rc[0] = (float)c;
    rc[1] = (float)(sqrt(x2) * up);
    rc[2] = (float)(sqrt(dx2) * up);
    rc[3] = (float)((groups + 6) * u * 1.02 * (p + fabs(c)) * up);
  }
  return nbad;
}
