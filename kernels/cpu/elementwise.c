/* bf16 RMSNorm and gated activations with AVX-512: one pass over each row, fp32 inside, bf16 out.
 *
 * Compiled at run time with amx_linear.c into one library (inferhal.kernels.cpu.lib). Rounding follows
 * the reference ops step by step: the residual sum is rounded to bf16 before it is normalised, the norm
 * multiplies by rsqrt(mean + eps) and then by the fp32 scale, act(gate) is rounded to bf16 before the
 * product with up; every fp32 -> bf16 rounding is to nearest even (_mm512_cvtneps_pbh), as torch's cast.
 * Sums run in 16 fp32 lanes, so they differ from torch's by fp32 re-association only.
 */
#include <math.h>

#include "simd.h"

/* rows x d: h = x (+ res, rounded to bf16, written to h_out), y = bf16((h * rsqrt(mean(h^2) + eps)) * scale)
 * (scale: fp32 [d], or NULL for none). Row strides in elements. */
static void norm_row(int64_t r, const uint16_t *x, int64_t ldx, const uint16_t *res, int64_t ldr, const float *scale,
                     int64_t d, float eps, uint16_t *y, int64_t ldy, uint16_t *h_out, int64_t ldh) {
  {
    const uint16_t *xr = x + r * ldx;
    const uint16_t *hr = xr;
    if (res) {
      const uint16_t *rr = res + r * ldr;
      uint16_t *ho = h_out + r * ldh;
      for (int64_t c = 0; c < d; c += 16) {
        const __mmask16 m = tail_mask(d - c);
        store_bf16(ho + c, _mm512_add_ps(load_bf16(xr + c, m), load_bf16(rr + c, m)), m);
      }
      hr = ho;
    }
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 v = load_bf16(hr + c, tail_mask(d - c));
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)d + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    uint16_t *yr = y + r * ldy;
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 m = tail_mask(d - c);
      __m512 v = _mm512_mul_ps(load_bf16(hr + c, m), vinv);
      if (scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, scale + c));
      store_bf16(yr + c, v, m);
    }
  }
}

void ih_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *res, int64_t ldr, const float *scale, int64_t rows,
                      int64_t d, float eps, uint16_t *y, int64_t ldy, uint16_t *h_out, int64_t ldh) {
  if (rows * d >= (1 << 17)) { /* threads only where they pay: a parallel region costs microseconds */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(r, x, ldx, res, ldr, scale, d, eps, y, ldy, h_out, ldh);
  } else {
    for (int64_t r = 0; r < rows; r++) norm_row(r, x, ldx, res, ldr, scale, d, eps, y, ldy, h_out, ldh);
  }
}

/* y = bf16(bf16(act(gate)) * up), act = gelu_tanh (kind 0: x / (1 + e^(-2 sqrt(2/pi) (x + 0.044715 x^3))),
 * the same function as 0.5 x (1 + tanh(...))) or silu (kind 1: x / (1 + e^-x)). rows x n, row strides. */
void ih_act_gated_bf16(const uint16_t *gate, int64_t ldg, const uint16_t *up, int64_t ldu, int64_t rows, int64_t n,
                       int kind, uint16_t *y, int64_t ldy) {
  const __m512 one = _mm512_set1_ps(1.f), k0 = _mm512_set1_ps(-2.f * 0.7978845608028654f), k1 = _mm512_set1_ps(0.044715f);
#pragma omp parallel for schedule(static) if (rows * n >= (1 << 16))
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t c = 0; c < n; c += 16) {
      const __mmask16 m = tail_mask(n - c);
      const __m512 g = load_bf16(gate + r * ldg + c, m);
      __m512 z;
      if (kind == 0) z = _mm512_mul_ps(_mm512_mul_ps(k0, g), _mm512_fmadd_ps(_mm512_mul_ps(k1, g), g, one));
      else z = _mm512_sub_ps(_mm512_setzero_ps(), g);
      const __m512 a = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp512(z))));
      store_bf16(y + r * ldy + c, _mm512_mul_ps(a, load_bf16(up + r * ldu + c, m)), m);
    }
  }
}

/* NeoX rotary embedding over whole heads, in place of the reference's rope.apply (style neox, rotary_dim
 * = head dim): x [T, H, D] bf16 (row stride ldx, head stride ldh), cs [P, D] fp32 = [cos(D/2) | sin(D/2)],
 * row t at positions[t]; out [T, H, D] contiguous. a' = a cos - b sin, b' = b cos + a sin with sin negated
 * when inverse, each product and sum rounded in fp32 as torch's (built with -ffp-contract=off), then bf16. */
/* Returns -1, or the first row whose position is outside the table's rows [0, table_rows) (nothing written). */
int64_t ih_rope_neox_bf16(const uint16_t *x, int64_t ldx, int64_t ldh, int64_t t, int64_t h, int64_t d, const float *cs,
                          int64_t table_rows, const int64_t *positions, int inverse, uint16_t *out) {
  const int64_t half = d / 2;
  for (int64_t row = 0; row < t; row++)
    if (positions[row] < 0 || positions[row] >= table_rows) return row;
#pragma omp parallel for schedule(static) if (t * h * d >= (1 << 17))
  for (int64_t row = 0; row < t; row++) {
    const float *cr = cs + positions[row] * d, *sr = cr + half;
    for (int64_t hh = 0; hh < h; hh++) {
      const uint16_t *xa = x + row * ldx + hh * ldh, *xb = xa + half;
      uint16_t *oa = out + (row * h + hh) * d, *ob = oa + half;
      for (int64_t c = 0; c < half; c += 16) {
        const __mmask16 m = tail_mask(half - c);
        const __m512 a = load_bf16(xa + c, m), b = load_bf16(xb + c, m), cv = _mm512_maskz_loadu_ps(m, cr + c);
        __m512 sv = _mm512_maskz_loadu_ps(m, sr + c);
        if (inverse) sv = _mm512_sub_ps(_mm512_setzero_ps(), sv);
        store_bf16(oa + c, _mm512_sub_ps(_mm512_mul_ps(a, cv), _mm512_mul_ps(b, sv)), m);
        store_bf16(ob + c, _mm512_add_ps(_mm512_mul_ps(b, cv), _mm512_mul_ps(a, sv)), m);
      }
    }
  }
  return -1;
}
