/* AVX-512 helpers shared by the CPU kernels: bf16 <-> fp32 lanes (round to nearest even, as torch casts)
 * and a vector e^x. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m512 round_bf16(__m512 v) { /* v rounded to bf16, back in fp32 */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }

/* the linears' output modes: bf16, fp32, or the bf16-rounded sums widened to fp32 (a bf16 model's logits) */
enum { OUT_BF16 = 0, OUT_F32 = 1, OUT_F32_OF_BF16 = 2 };

/* 16 fp32 sums -> columns [c, c + 16) of row r of y (mask m), in the output mode */
static inline void store_row(__m512 v, void *y, int mode, int64_t ldy, int64_t r, int64_t c, __mmask16 m) {
  if (mode == OUT_BF16)
    store_bf16((uint16_t *)y + r * ldy + c, v, m);
  else
    _mm512_mask_storeu_ps((float *)y + r * ldy + c, m, mode == OUT_F32_OF_BF16 ? round_bf16(v) : v);
}

/* e^x for fp32 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-7 Taylor polynomial
 * (relative error below 1e-8 there); x clamped to [-100, 100], where e^x is 0 or inf in fp32 anyway. */
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

