/* Paged attention over a bf16 KV cache with AVX-512: every row of a step (prefill or decode), fp32 inside.
 *
 * Cache [blocks, block_size, 2, Hk, D] (K then V per slot; blocks may be strided, slots packed). Row t of sequence b (query_start_loc) at
 * position qpos sees keys [first, qpos], first = qpos - window + 1 clipped at 0 (window 0: from 0), found
 * through block_table[b]. Query head h reads KV head h / (H / Hk). For each row and KV head: logits =
 * (q . k) * scale, soft-capped (cap * tanh(l / cap)) when cap > 0, softmax, sum of p * v; the output is
 * rounded to bf16 once. The reference gathers keys to fp32 and runs the same steps as batched products,
 * so results differ by fp32 re-association only. Rows x KV heads are split between OpenMP threads.
 *
 * With 1, 2, 4 or 8 query heads per KV head and D % 16 == 0 (every model here), a row's keys go in tiles:
 * 16 / rep keys at a time against all rep heads (16 accumulators, summed by one transpose-and-add tree),
 * then p . v over 16 / rep column chunks at a time, all in registers; each key's address is found once
 * (no division per key), and past PF_MIN keys the key and value lines PF_TILES tiles ahead are prefetched,
 * since a step's layers together hold far more KV than the caches do. Other shapes take the plain loop.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_REP 8
#define MAX_D 512
#define PF_MIN 128  /* keys from which a row prefetches ahead (1.24-1.33x at 128-2048 keys over 6 layers' caches) */
#define PF_TILES 4  /* how many key tiles ahead */

/* softmax numerators of one head's logits in place (e^(l - max)); returns 1 / their sum */
static inline float softmax_row(float *lr, int64_t span) {
  float m = lr[0];
  for (int64_t s = 1; s < span; s++) m = lr[s] > m ? lr[s] : m;
  __m512 vs = _mm512_setzero_ps();
  for (int64_t s = 0; s < span; s += 16) {
    const __mmask16 mk = tail_mask(span - s);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, lr + s), _mm512_set1_ps(m)));
    _mm512_mask_storeu_ps(lr + s, mk, e);
    vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(mk, e));
  }
  return 1.f / _mm512_reduce_add_ps(vs);
}

/* lane i = the sum of v[i]'s 16 lanes, for i < 16: a transpose-and-add tree (45 operations, where 16
 * separate reductions take about 130) */
static inline __m512 sum16(const __m512 *v) {
  __m512 w[8], x[4];
  for (int k = 0; k < 8; k++) /* per 128-bit lane: (a0 + a2, b0 + b2, a1 + a3, b1 + b3) of a = v[2k], b = v[2k+1] */
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; k++) /* per 128-bit lane: that lane's sums of v[4k .. 4k+3] */
    x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], 0x44), _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], 0xEE));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* One row and KV head, rep query heads (1, 2, 4 or 8), d % 16 == 0. qf: the rep query rows in fp32 [rep][d];
 * kp[s]: the address of visible key s (its value vofs elements after it); logit: [rep][span] scratch; out:
 * the rep output rows (row stride ldo). */
static inline __attribute__((always_inline)) void tiled_row(const float *qf, const uint16_t *const *kp,
                                                            int64_t vofs, int64_t span, int64_t d, float scale,
                                                            float softcap, float *logit, uint16_t *out, int64_t ldo,
                                                            const int rep) {
  const int tp = 16 / rep, gc = 16 / rep; /* keys per tile; 16-column chunks per pass over the values */
  const int64_t nd = d / 16;
  const int pf = span >= PF_MIN;
  for (int64_t s0 = 0; s0 < span; s0 += tp) {
    const int n = span - s0 < tp ? (int)(span - s0) : tp; /* a short last tile repeats its first key */
    const uint16_t *k[16];
    for (int j = 0; j < tp; j++) k[j] = kp[s0 + (j < n ? j : 0)];
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t pj = s0 + PF_TILES * tp, pl = 0; /* the next line to prefetch: key pj, line pl of its nd (key, value) */
    for (int64_t c = 0; c < nd; c++) {
      __m512 qc[MAX_REP];
      for (int r = 0; r < rep; r++) qc[r] = _mm512_loadu_ps(qf + r * d + c * 16);
      if (pf) /* the tile PF_TILES ahead: tp keys x nd lines over the nd chunks, tp lines a chunk */
        for (int u = 0; u < tp; u++) {
          if (pj < span) _mm_prefetch((const char *)(kp[pj] + (pl < nd / 2 ? pl * 32 : vofs + (pl - nd / 2) * 32)), _MM_HINT_T0);
          if (++pl == nd) { pl = 0; pj++; }
        }
      for (int j = 0; j < tp; j++) {
        const __m512 kv = load_bf16(k[j] + c * 16, 0xffff);
        for (int r = 0; r < rep; r++) acc[r * tp + j] = _mm512_fmadd_ps(qc[r], kv, acc[r * tp + j]);
      }
    }
    float sums[16];
    _mm512_storeu_ps(sums, sum16(acc));
    for (int r = 0; r < rep; r++)
      for (int j = 0; j < n; j++) {
        float l = sums[r * tp + j] * scale;
        if (softcap > 0) l = softcap * tanhf(l / softcap);
        logit[r * span + s0 + j] = l;
      }
  }
  float inv[MAX_REP];
  for (int r = 0; r < rep; r++) inv[r] = softmax_row(logit + r * span, span);
  for (int64_t c0 = 0; c0 < nd; c0 += gc) {
    __mmask16 live[16]; /* chunks past d load as zeros and are not stored */
    for (int g = 0; g < gc; g++) live[g] = c0 + g < nd ? (__mmask16)0xffff : (__mmask16)0;
    __m512 o[16];
    for (int i = 0; i < 16; i++) o[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < span; s++) { /* each output lane sums over the keys in order, as the plain loop */
      const uint16_t *v = kp[s] + vofs + c0 * 16;
      __m512 pr[MAX_REP];
      for (int r = 0; r < rep; r++) pr[r] = _mm512_set1_ps(logit[r * span + s]);
      for (int g = 0; g < gc; g++) {
        const __m512 vv = load_bf16(v + g * 16, live[g]);
        for (int r = 0; r < rep; r++) o[r * gc + g] = _mm512_fmadd_ps(pr[r], vv, o[r * gc + g]);
      }
    }
    for (int r = 0; r < rep; r++)
      for (int g = 0; g < gc && c0 + g < nd; g++)
        store_bf16(out + r * ldo + (c0 + g) * 16, _mm512_mul_ps(o[r * gc + g], _mm512_set1_ps(inv[r])), 0xffff);
  }
}

/* one instance per head count, so the loops over heads, keys of a tile and chunks unroll into registers */
#define TILED(n)                                                                                                     \
  static void tiled_##n(const float *qf, const uint16_t *const *kp, int64_t vofs, int64_t span, int64_t d,         \
                        float scale, float softcap, float *logit, uint16_t *out, int64_t ldo) {                     \
    tiled_row(qf, kp, vofs, span, d, scale, softcap, logit, out, ldo, n);                                           \
  }
TILED(1) TILED(2) TILED(4) TILED(8)

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
    /* the row's logits, then (tiled path) each visible key's address */
    float *lg = (float *)malloc(sizeof(float) * rep * span + sizeof(uint16_t *) * span);
    if (!lg) {
#pragma omp atomic write
      oom = 1;
      continue;
    }
    if (d % 16 == 0 && (rep == 1 || rep == 2 || rep == 4 || rep == 8)) {
      float qrow[MAX_REP * MAX_D] __attribute__((aligned(64)));
      for (int64_t r = 0; r < rep; r++)
        for (int64_t c = 0; c < d; c += 16)
          _mm512_store_ps(qrow + r * d + c, load_bf16(q + row * ldq_t + (g * rep + r) * ldq_h + c, 0xffff));
      /* the block table walked once: no division per key */
      const uint16_t **kp = (const uint16_t **)(lg + rep * span);
      for (int64_t s = 0, blk = first / bs, off = first % bs; s < span; s++) {
        kp[s] = cache + (int64_t)bt[blk] * block_stride + off * entry + g * d;
        if (++off == bs) { off = 0; blk++; }
      }
      uint16_t *o = out + (row * h + g * rep) * d;
      switch (rep) {
        case 1: tiled_1(qrow, kp, hk * d, span, d, scale, softcap, lg, o, d); break;
        case 2: tiled_2(qrow, kp, hk * d, span, d, scale, softcap, lg, o, d); break;
        case 4: tiled_4(qrow, kp, hk * d, span, d, scale, softcap, lg, o, d); break;
        default: tiled_8(qrow, kp, hk * d, span, d, scale, softcap, lg, o, d); break;
      }
      free(lg);
      continue;
    }
    __m512 qf[MAX_REP][MAX_D / 16], acc[MAX_REP];
    for (int64_t r = 0; r < rep; r++)
      for (int64_t c = 0; c < nd; c++) qf[r][c] = load_bf16(q + row * ldq_t + (g * rep + r) * ldq_h + c * 16, tail_mask(d - c * 16));
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
        lg[r * span + s] = l;
      }
    }
    float inv[MAX_REP];
    for (int64_t r = 0; r < rep; r++) inv[r] = softmax_row(lg + r * span, span);
    for (int64_t r = 0; r < rep; r++)
      for (int64_t c = 0; c < nd; c++) qf[r][c] = _mm512_setzero_ps(); /* reused as the output accumulator */
    for (int64_t s = 0; s < span; s++) {
      const int64_t pos = first + s;
      const uint16_t *v = cache + (int64_t)bt[pos / bs] * block_stride + (pos % bs) * entry + hk * d + g * d;
      for (int64_t c = 0; c < nd; c++) {
        const __m512 vv = load_bf16(v + c * 16, tail_mask(d - c * 16));
        for (int64_t r = 0; r < rep; r++) qf[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(lg[r * span + s]), vv, qf[r][c]);
      }
    }
    free(lg);
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
