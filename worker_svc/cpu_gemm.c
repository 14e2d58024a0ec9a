/* y = x @ w^T over a weight laid out in column panels (worker_svc/cpu_linear.py).
 *
 * The weight (N, K) is stored as N/PW panels of (K, PW): panel p holds columns
 * p*PW .. p*PW+PW-1 of w^T, row k of the panel contiguous. A tile of TW output columns
 * and its rows of x (all of them up to ONE_PASS, a decode batch; MT at a time above) keeps
 * rows x NV vector accumulators; each step of k loads NV weight vectors once and
 * multiplies them by one broadcast scalar of x per row. So every weight float is read once
 * per tile, in order, from one stream per panel, and no horizontal sums are needed. Each output is a sum over k
 * in order, the same whatever the number of rows: a row's result does not depend on the
 * batch it came in.
 */
#include <stdint.h>
#include <string.h>

#define PW 16 /* panel width (floats): the layout, the same on every CPU */
#if defined(__AVX512F__)
#define VW 16 /* floats per vector */
#define MT 12 /* rows of x per tile: MT * NV accumulators + NV weights + 1 broadcast (27 of 32) */
#define NV 2  /* vectors per tile row */
#else
#define VW 8
#define MT 4
#define NV 3
#endif
#define TW (NV * VW) /* tile width (floats) */
#define ONE_PASS 16 /* rows: a decode batch; the switch below has a case for each count */
#define PREFETCH 32 /* k steps: 2 KB ahead in each panel */

typedef float vec __attribute__((vector_size(VW * 4), aligned(4)));

/* The unit N is padded to: a multiple of both the panel and the tile width. */
int gemm_columns_multiple(void) {
  int a = PW, b = TW;
  while (b) {
    const int r = a % b;
    a = b;
    b = r;
  }
  return PW / a * TW;
}

/* The calling thread's share of y = x @ w^T: called by every thread of a team (the
 * work-sharing loop binds to the enclosing parallel region, here or the decoder's in
 * cpu_decoder.c), or alone by one thread. */
void panel_gemm_part(const float *restrict x, const float *restrict wp, float *restrict y,
                     int m, int n, int k) {
/* Dynamic: a thread that shares its core with another job takes fewer tiles instead of
 * holding the others at the barrier. */
#pragma omp for schedule(dynamic, 1)
  for (int t = 0; t < n / TW; t++) {
    const int n0 = t * TW;
    const float *w[NV]; /* this tile's vectors of row 0 of their panels */
    for (int j = 0; j < NV; j++) {
      const int c = n0 + j * VW;
      w[j] = wp + (int64_t)(c / PW) * k * PW + c % PW;
    }
    /* Up to ONE_PASS rows are one tile: each weight vector is read once per call. */
    const int step = m <= ONE_PASS ? m : MT;
    for (int m0 = 0; m0 < m; m0 += step) {
      const int rows = m - m0 < step ? m - m0 : step;
      const float *xr = x + (int64_t)m0 * k;
      float *yr = y + (int64_t)m0 * n + n0;
/* A tile of ROWS rows (a constant, so that the accumulators can stay in registers). The
 * weights a few k ahead are prefetched: the hardware prefetcher alone kept a decode
 * step's weight stream at ~14 GB/s of the ~23 this machine reads (measured, 16 rows). */
#define TILE(ROWS)                                                                         \
  {                                                                                        \
    vec acc[ROWS][NV];                                                                     \
    memset(acc, 0, sizeof acc);                                                            \
    for (int kk = 0; kk < k; kk++) {                                                       \
      vec wv[NV];                                                                          \
      for (int j = 0; j < NV; j++) {                                                       \
        wv[j] = *(const vec *)(w[j] + (int64_t)kk * PW);                                   \
        if (kk + PREFETCH < k) __builtin_prefetch(w[j] + (int64_t)(kk + PREFETCH) * PW);   \
      }                                                                                    \
      for (int i = 0; i < (ROWS); i++) {                                                   \
        const float s = xr[(int64_t)i * k + kk];                                           \
        for (int j = 0; j < NV; j++) acc[i][j] += wv[j] * s;                               \
      }                                                                                    \
    }                                                                                      \
    for (int i = 0; i < (ROWS); i++)                                                       \
      for (int j = 0; j < NV; j++) memcpy(yr + (int64_t)i * n + j * VW, &acc[i][j], sizeof(vec)); \
  }                                                                                        \
  break;
      switch (rows) {
        case 1: TILE(1)
        case 2: TILE(2)
        case 3: TILE(3)
        case 4: TILE(4)
        case 5: TILE(5)
        case 6: TILE(6)
        case 7: TILE(7)
        case 8: TILE(8)
        case 9: TILE(9)
        case 10: TILE(10)
        case 11: TILE(11)
        case 12: TILE(12)
        case 13: TILE(13)
        case 14: TILE(14)
        case 15: TILE(15)
        default: TILE(ONE_PASS)
      }
    }
  }
}

void panel_gemm(const float *restrict x, const float *restrict wp, float *restrict y, int m,
                int n, int k, int threads) {
#pragma omp parallel num_threads(threads)
  panel_gemm_part(x, wp, y, m, n, k);
}
