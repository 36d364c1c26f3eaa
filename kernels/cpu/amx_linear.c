/* bf16 linear on Intel AMX: y[M, N] = x[M, K] . w[N, K]^T, fp32 accumulation; the output is bf16 (OUT_BF16),
 * fp32 (OUT_F32) or the bf16-rounded sums widened to fp32 (OUT_F32_OF_BF16: a bf16 model's logits written
 * straight into an fp32 buffer).
 *
 * Compiled at run time by inferhal.kernels.cpu.amx (gcc, -fopenmp); called through ctypes. Threads
 * come from the process's OpenMP runtime: torch's libgomp.so.1 is already loaded, so its pool is shared.
 *
 * Packed weight layout (ih_amx_pack): for each block of 32 output columns nb, for each block of 32
 * reduction elements kb, two AMX B tiles of 16 rows (k pairs) x 16 columns x 2 (the pair): 2 KiB per
 * (nb, kb), contiguous in kb order, so a column block streams as one run. N is zero-padded to 32.
 *
 * The product walks column blocks (split between threads); for each it runs every 32-row block of x
 * through the 20-odd kb steps with 4 C tiles (2 row tiles x 2 column tiles), 2 A tiles and 2 B tiles.
 * Each C tile goes through a per-thread fp32 scratch, so tails of M and N and the bf16 rounding
 * (round to nearest even, _mm512_cvtneps_pbh, as torch's fp32 -> bf16 cast) are handled in one place.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#ifndef PF_DIST
#define PF_DIST 4 /* (nb, kb) steps of B prefetched ahead */
#endif

typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed, aligned(64))) tilecfg_t;

/* 0 when this process may use AMX tile data (Linux asks each process to request it). */
int ih_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

static void config_tiles(void) {
  tilecfg_t c;
  memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int t = 0; t < 8; t++) { c.colsb[t] = 64; c.rows[t] = 16; }
  _tile_loadconfig(&c);
}

int64_t ih_amx_packed_elems(int64_t n, int64_t k) { return ((n + 31) / 32) * 32 * k; }

/* w [n, k] bf16 (row stride ldw elements, k % 32 == 0) -> out, ih_amx_packed_elems(n, k) elements. */
void ih_amx_pack(const uint16_t *w, int64_t n, int64_t k, int64_t ldw, uint16_t *out) {
  const int64_t nbs = (n + 31) / 32, kbs = k / 32;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < nbs; nb++)
    for (int64_t kb = 0; kb < kbs; kb++)
      for (int t = 0; t < 2; t++) {
        uint16_t *tile = out + ((nb * kbs + kb) * 2 + t) * 512;
        for (int c = 0; c < 16; c++) {
          const int64_t col = nb * 32 + t * 16 + c;
          const uint16_t *src = w + col * ldw + kb * 32;
          for (int kp = 0; kp < 16; kp++) {
            tile[kp * 32 + c * 2] = col < n ? src[kp * 2] : 0;
            tile[kp * 32 + c * 2 + 1] = col < n ? src[kp * 2 + 1] : 0;
          }
        }
      }
}

/* rows [r0, r0 + nr) x columns [c0, c0 + nc) of one 16 x 16 fp32 tile in scratch -> y */
static void write_tile(const float *s, void *y, int mode, int64_t ldy, int64_t r0, int nr, int64_t c0, int nc) {
  const __mmask16 m = tail_mask(nc);
  for (int r = 0; r < nr; r++) store_row(_mm512_loadu_ps(s + r * 16), y, mode, ldy, r0 + r, c0, m);
}

/* x [m, k] bf16 (row stride ldx, k % 32 == 0, m a multiple of 16 rows readable: callers pad), wp packed
 * for n columns, y [m, n] (row stride ldy) in output mode `mode`. m_valid rows are written. */
void ih_amx_linear(const uint16_t *x, int64_t m, int64_t m_valid, int64_t k, int64_t ldx, const uint16_t *wp,
                   int64_t n, void *y, int64_t ldy, int mode) {
  const int64_t nbs = (n + 31) / 32, kbs = k / 32;
#pragma omp parallel
  {
    float scratch[4][256] __attribute__((aligned(64)));
    config_tiles();
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < nbs; nb++) {
      const uint16_t *b0 = wp + nb * kbs * 1024;
      const int nc0 = n - nb * 32 >= 16 ? 16 : (int)(n - nb * 32);
      const int nc1 = n - nb * 32 - 16 >= 16 ? 16 : (int)(n - nb * 32 - 16 > 0 ? n - nb * 32 - 16 : 0);
      for (int64_t mb = 0; mb < m; mb += 32) {
        const int two = mb + 16 < m; /* a second row tile */
        const uint16_t *a = x + mb * ldx, *b = b0;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kb = 0; kb < kbs; kb++, b += 1024, a += 32) {
          if (mb == 0)
            for (int l = 0; l < 32; l++) _mm_prefetch((const char *)(b + PF_DIST * 1024) + l * 64, _MM_HINT_T0);
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 512, 64);
          _tile_loadd(4, a, ldx * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, a + 16 * ldx, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, scratch[0], 64);
        _tile_stored(1, scratch[1], 64);
        if (two) { _tile_stored(2, scratch[2], 64); _tile_stored(3, scratch[3], 64); }
        for (int rt = 0; rt < (two ? 2 : 1); rt++) {
          const int64_t r0 = mb + rt * 16;
          const int nr = m_valid - r0 >= 16 ? 16 : (int)(m_valid - r0 > 0 ? m_valid - r0 : 0);
          if (nr == 0) continue;
          write_tile(scratch[rt * 2], y, mode, ldy, r0, nr, nb * 32, nc0);
          if (nc1) write_tile(scratch[rt * 2 + 1], y, mode, ldy, r0, nr, nb * 32 + 16, nc1);
        }
      }
    }
    _tile_release();
  }
}

