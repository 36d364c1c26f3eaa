/* Paged attention over a bf16 KV cache with AVX-512: every row of a step (prefill or decode), fp32 inside.
 *
 * Cache [blocks, block_size, 2, Hk, D] (K then V per slot; blocks may be strided, slots packed). Row t of sequence b (query_start_loc) at
 * position qpos sees keys [first, qpos], first = qpos - window + 1 clipped at 0 (window 0: from 0), found
 * through block_table[b]. Query head h reads KV head h / (H / Hk). For each row and KV head: logits =
 * (q . k) * scale, soft-capped (cap * tanh(l / cap)) when cap > 0, softmax, sum of p * v; the output is
 * rounded to bf16 once. The reference gathers keys to fp32 and runs the same steps as batched products,
 * so results differ by fp32 re-association only. Rows x KV heads are split between OpenMP threads.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_REP 8
#define MAX_D 512

/* Returns -1; or the first row whose visible keys reach an unallocated block (-1 or past the table); or -2
 * when a row's logits could not be allocated (out is then not valid). */
int64_t ih_attn_paged_bf16(const uint16_t *q, int64_t ldq_t, int64_t ldq_h, int64_t t, int64_t h, int64_t d,
                           const uint16_t *cache, int64_t bs, int64_t block_stride, int64_t hk, const int32_t *block_table, int64_t bt_width,
                           const int32_t *qsl, int64_t nseq, const int64_t *positions, int64_t window, float scale,
                           float softcap, uint16_t *out) {
  const int64_t rep = h / hk, entry = 2 * hk * d, nd = (d + 15) / 16;
  int64_t bad = -1;
  int oom = 0;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t job = 0; job < t * hk; job++) {
    const int64_t row = job / hk, g = job % hk;
    int64_t lo = 0, hi = nseq; /* the sequence holding row: qsl[b] <= row < qsl[b + 1] */
    while (hi - lo > 1) { const int64_t mid = (lo + hi) / 2; if (qsl[mid] <= row) lo = mid; else hi = mid; }
    const int64_t b = lo, qpos = positions[row];
    const int64_t first = window > 0 && qpos - window + 1 > 0 ? qpos - window + 1 : 0, span = qpos - first + 1;
    const int32_t *bt = block_table + b * bt_width;
    int ok = 1;
    for (int64_t blk = first / bs; blk <= qpos / bs; blk++) ok &= blk < bt_width && bt[blk] >= 0;
    if (!ok) {
#pragma omp critical
      if (bad < 0 || row < bad) bad = row;
      continue;
    }
    __m512 qf[MAX_REP][MAX_D / 16], acc[MAX_REP];
    for (int64_t r = 0; r < rep; r++)
      for (int64_t c = 0; c < nd; c++) qf[r][c] = load_bf16(q + row * ldq_t + (g * rep + r) * ldq_h + c * 16, tail_mask(d - c * 16));
    float *logit = (float *)malloc(sizeof(float) * rep * span);
    if (!logit) {
#pragma omp atomic write
      oom = 1;
      continue;
    }
    for (int64_t s = 0; s < span; s++) {
      const int64_t pos = first + s;
      const uint16_t *k = cache + (int64_t)bt[pos / bs] * block_stride + (pos % bs) * entry + g * d;
      for (int64_t r = 0; r < rep; r++) acc[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < nd; c++) {
        const __m512 kv = load_bf16(k + c * 16, tail_mask(d - c * 16));
        for (int64_t r = 0; r < rep; r++) acc[r] = _mm512_fmadd_ps(qf[r][c], kv, acc[r]);
      }
      for (int64_t r = 0; r < rep; r++) {
        float l = _mm512_reduce_add_ps(acc[r]) * scale;
        if (softcap > 0) l = softcap * tanhf(l / softcap);
        logit[r * span + s] = l;
      }
    }
    float inv[MAX_REP];
    for (int64_t r = 0; r < rep; r++) {
      float *lr = logit + r * span, m = lr[0], sum = 0.f;
      for (int64_t s = 1; s < span; s++) m = lr[s] > m ? lr[s] : m;
      __m512 vs = _mm512_setzero_ps();
      for (int64_t s = 0; s < span; s += 16) {
        const __mmask16 mk = tail_mask(span - s);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, lr + s), _mm512_set1_ps(m)));
        _mm512_mask_storeu_ps(lr + s, mk, e);
        vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(mk, e));
      }
      sum = _mm512_reduce_add_ps(vs);
      inv[r] = 1.f / sum;
    }
    for (int64_t r = 0; r < rep; r++)
      for (int64_t c = 0; c < nd; c++) qf[r][c] = _mm512_setzero_ps(); /* reused as the output accumulator */
    for (int64_t s = 0; s < span; s++) {
      const int64_t pos = first + s;
      const uint16_t *v = cache + (int64_t)bt[pos / bs] * block_stride + (pos % bs) * entry + hk * d + g * d;
      for (int64_t c = 0; c < nd; c++) {
        const __m512 vv = load_bf16(v + c * 16, tail_mask(d - c * 16));
        for (int64_t r = 0; r < rep; r++) qf[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(logit[r * span + s]), vv, qf[r][c]);
      }
    }
    free(logit);
    for (int64_t r = 0; r < rep; r++)
      for (int64_t c = 0; c < nd; c++)
        store_bf16(out + (row * h + g * rep + r) * d + c * 16, _mm512_mul_ps(qf[r][c], _mm512_set1_ps(inv[r])), tail_mask(d - c * 16));
  }
  return oom ? -2 : bad;
}

/* kv.write for a bf16 cache: row i of values (row stride ldv, slot_elems contiguous elements) to slot
 * slots[i] (-1: skipped) of cache [blocks, bs, slot] with block stride block_stride and slot stride
 * slot_elems (elements). Returns -1, or the first i whose slot is past the cache's nblocks * bs slots; then
 * nothing is written. */
int64_t ih_kv_write_bf16(const uint16_t *values, int64_t ldv, int64_t t, int64_t slot_elems, const int64_t *slots,
                         uint16_t *cache, int64_t nblocks, int64_t bs, int64_t block_stride) {
  for (int64_t i = 0; i < t; i++)
    if (slots[i] >= nblocks * bs) return i;
  for (int64_t i = 0; i < t; i++) {
    const int64_t s = slots[i];
    if (s < 0) continue;
    memcpy(cache + (s / bs) * block_stride + (s % bs) * slot_elems, values + i * ldv, slot_elems * 2);
  }
  return -1;
}
