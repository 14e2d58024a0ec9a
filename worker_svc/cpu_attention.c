/* Decode attention over a paged KV cache, read in place (worker_svc/cpu_attention.py).
 *
 * Compiled at load for one cache geometry: HKV key heads, REP query heads per key head,
 * head size D, BS slots per block. The cache is (blocks, BS, HKV, D) float32 for keys and
 * for values; query b (H = HKV * REP heads of D) attends to slots 0..lengths[b]-1 of its
 * sequence, slot t living in block table[b][t / BS] at offset t % BS.
 *
 * One task is one sequence (or one key head of it when there are few sequences): it walks
 * the sequence's blocks once, each block's rows contiguous, with a running (online)
 * softmax per query head, so no context is gathered and no padding is read. The next
 * block is prefetched while this one is computed: the blocks of a sequence are scattered
 * over the pool, which defeats the hardware prefetcher at every block boundary.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define H (HKV * REP)
#define ROW (HKV * D) /* floats per slot */

void paged_decode(const float *restrict q, const float *restrict k_cache,
                  const float *restrict v_cache, const int64_t *restrict table,
                  int64_t table_stride, const int64_t *restrict lengths, float *restrict out,
                  int batch, int split, float scale, int threads) {
  const int heads_per_task = HKV / split; /* key heads */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int task = 0; task < batch * split; task++) {
    const int b = task / split, g0 = (task % split) * heads_per_task;
    const int h0 = g0 * REP, h1 = (g0 + heads_per_task) * REP;
    float m[H], l[H], acc[H][D], qs[H][D], p[REP][BS];
    for (int h = h0; h < h1; h++) {
      /* -FLT_MAX, not -INFINITY: the kernel is built with -ffast-math (finite math). */
      m[h] = -FLT_MAX;
      l[h] = 0.f;
      for (int d = 0; d < D; d++) {
        acc[h][d] = 0.f;
        qs[h][d] = q[((int64_t)b * H + h) * D + d] * scale;
      }
    }
    const int64_t len = lengths[b];
    const int64_t *blocks = table + (int64_t)b * table_stride;
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
      const int64_t i = t0 / BS;
      const int n = len - t0 < BS ? (int)(len - t0) : BS;
      if (t0 + BS < len) {
        const char *nk = (const char *)(k_cache + blocks[i + 1] * BS * ROW);
        const char *nv = (const char *)(v_cache + blocks[i + 1] * BS * ROW);
        for (int o = 0; o < BS * ROW * (int)sizeof(float); o += 64) {
          __builtin_prefetch(nk + o);
          __builtin_prefetch(nv + o);
        }
      }
      const float *kb = k_cache + blocks[i] * BS * ROW;
      const float *vb = v_cache + blocks[i] * BS * ROW;
      for (int g = g0; g < g0 + heads_per_task; g++) {
        for (int r = 0; r < REP; r++) {
          const int h = g * REP + r;
          float mx = m[h];
          for (int j = 0; j < n; j++) {
            const float *k = kb + j * ROW + g * D;
            float s = 0.f;
            for (int d = 0; d < D; d++) s += qs[h][d] * k[d];
            p[r][j] = s;
            mx = s > mx ? s : mx;
          }
          /* Rescale what was summed under the old maximum once per block, not per key. */
          const float corr = expf(m[h] - mx);
          float sum = 0.f;
          for (int j = 0; j < n; j++) {
            p[r][j] = expf(p[r][j] - mx);
            sum += p[r][j];
          }
          l[h] = l[h] * corr + sum;
          m[h] = mx;
          for (int d = 0; d < D; d++) acc[h][d] *= corr;
        }
        for (int j = 0; j < n; j++) {
          const float *v = vb + j * ROW + g * D;
          for (int r = 0; r < REP; r++) {
            float *a = acc[g * REP + r];
            const float w = p[r][j];
            for (int d = 0; d < D; d++) a[d] += w * v[d];
          }
        }
      }
    }
    for (int h = h0; h < h1; h++) {
      const float inv = 1.f / l[h];
      for (int d = 0; d < D; d++) out[((int64_t)b * H + h) * D + d] = acc[h][d] * inv;
    }
  }
}

/* Query rows of a tile in the prefill kernel: the K block each key head transposes is
 * shared by the tile's rows (and their REP heads). */
#define QT 8

/* The prefill kernel's work on one query row is in the two functions below, out of line
 * on purpose: each is then one body of instructions for every row. Inlined in the tile
 * loop, the compiler (-ffast-math) rewrote the last division differently with the tile's
 * row count, and a row's result depended, by an ulp, on the rows that shared its tile. */

/* One query row (its REP heads of key head g) against the first n keys of a block: kt the
 * block's keys transposed (D, BS), vb its values (row stride ROW). */
__attribute__((noinline)) static void row_block(const float qs[restrict REP][D],
                                                const float kt[restrict D][BS],
                                                const float *restrict vb, int n,
                                                float m[restrict REP], float l[restrict REP],
                                                float acc[restrict REP][D]) {
  /* The scores of the REP heads at once, d in two halves (even, odd): six or more
   * independent sums in flight rather than one chain of D dependent multiply-adds. */
  float even[REP][BS] = {{0}}, odd[REP][BS] = {{0}}, p[REP][BS];
  for (int d = 0; d < D; d += 2)
    for (int e = 0; e < REP; e++)
      for (int j = 0; j < BS; j++) {
        even[e][j] += qs[e][d] * kt[d][j];
        odd[e][j] += qs[e][d + 1] * kt[d + 1][j];
      }
  for (int e = 0; e < REP; e++) {
    float s[BS];
    for (int j = 0; j < BS; j++) s[j] = even[e][j] + odd[e][j];
    /* The keys past n: -FLT_MAX, whose exp is 0 (finite, for -ffast-math). */
    for (int j = n; j < BS; j++) s[j] = -FLT_MAX;
    float mx = m[e];
    for (int j = 0; j < BS; j++) mx = s[j] > mx ? s[j] : mx;
    const float corr = expf(m[e] - mx);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < BS; j++) {
      p[e][j] = expf(s[j] - mx);
      sum += p[e][j];
    }
    l[e] = l[e] * corr + sum;
    m[e] = mx;
    for (int d = 0; d < D; d++) acc[e][d] *= corr;
  }
  for (int j = 0; j < n; j++) {
    const float *v = vb + j * ROW;
    for (int e = 0; e < REP; e++)
      for (int d = 0; d < D; d++) acc[e][d] += p[e][j] * v[d];
  }
}

/* The row's REP heads, normalized, to out. */
__attribute__((noinline)) static void row_out(const float acc[REP][D], const float l[REP],
                                              float *restrict out) {
  for (int e = 0; e < REP; e++) {
    const float inv = 1.f / l[e];
    for (int d = 0; d < D; d++) out[e * D + d] = acc[e][d] * inv;
  }
}

/* A prefill chunk of one sequence: query row i (H heads of D) sees slots 0..lengths[i]-1
 * of the blocks in `table`. One task is a tile of QT rows against one key head. Each K
 * block is transposed once per task, so the scores of a query against the block's BS keys
 * are BS lanes summed over d, with no horizontal sums; the decode kernel above takes one
 * key at a time instead, which suits its single query per sequence. */
void paged_prefill(const float *restrict q, const float *restrict k_cache,
                   const float *restrict v_cache, const int64_t *restrict table,
                   const int64_t *restrict lengths, float *restrict out, int rows, float scale,
                   int threads) {
  const int tiles = (rows + QT - 1) / QT;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int task = 0; task < tiles * HKV; task++) {
    const int r0 = task / HKV * QT, g = task % HKV;
    const int nr = rows - r0 < QT ? rows - r0 : QT;
    float m[QT][REP], l[QT][REP], acc[QT][REP][D], qs[QT][REP][D], kt[D][BS];
    int64_t longest = 0;
    for (int r = 0; r < nr; r++) {
      const int64_t len = lengths[r0 + r];
      longest = len > longest ? len : longest;
      for (int e = 0; e < REP; e++) {
        m[r][e] = -FLT_MAX;
        l[r][e] = 0.f;
        for (int d = 0; d < D; d++) {
          acc[r][e][d] = 0.f;
          qs[r][e][d] = q[((int64_t)(r0 + r) * H + g * REP + e) * D + d] * scale;
        }
      }
    }
    for (int64_t t0 = 0; t0 < longest; t0 += BS) {
      const int64_t i = t0 / BS;
      const float *kb = k_cache + table[i] * BS * ROW + g * D;
      const float *vb = v_cache + table[i] * BS * ROW + g * D;
      for (int j = 0; j < BS; j++)
        for (int d = 0; d < D; d++) kt[d][j] = kb[j * ROW + d];
      for (int r = 0; r < nr; r++) {
        const int64_t left = lengths[r0 + r] - t0;
        if (left > 0) row_block(qs[r], kt, vb, left < BS ? (int)left : BS, m[r], l[r], acc[r]);
      }
    }
    for (int r = 0; r < nr; r++)
      row_out(acc[r], l[r], out + ((int64_t)(r0 + r) * H + g * REP) * D);
  }
}
