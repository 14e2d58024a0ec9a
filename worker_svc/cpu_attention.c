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
