/* Attention over a paged KV cache, read in place (worker_svc/cpu_attention.py).
 *
 * Compiled at load for one cache geometry: HKV key heads, REP query heads per key head,
 * head size D, BS slots per block. Keys are cached (blocks, HKV, D, BS): a block's keys of
 * one head are D rows of BS slots, so a query's scores against the block are BS vector
 * lanes summed over d, with no horizontal sum per key and no transpose. Values are cached
 * (blocks, BS, HKV, D). A query row (H = HKV * REP heads of D) attends to slots
 * 0..length-1 of its sequence, slot t living in block table[t / BS] at offset t % BS.
 *
 * Decodes and prefill chunks run the same per-row code (row_block, row_out) in the same
 * order, so a position computed in a prefill chunk and the same position decoded get the
 * same bits, whatever the rows beside them. The two functions are out of line on purpose:
 * each is then one body of instructions for every row. Inlined in a tile loop, GCC (with
 * -ffast-math) rewrote the final division with the tile's row count, and a row's result
 * depended, by an ulp, on the rows that shared its tile.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define H (HKV * REP)
#define ROW (HKV * D)      /* floats per slot of the value cache */
#define KBLOCK (HKV * D * BS) /* floats per block of either cache */
/* Query rows of a prefill tile: they share each block's reads. */
#define QT 8

/* One query row (its REP heads of one key head) against the first n slots of a block: kt
 * the block's keys of that head (D, BS), vb its values of that head (row stride ROW); m, l
 * and acc the running (online) softmax. */
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
    /* The slots past n: -FLT_MAX, whose exp is 0 (finite, for -ffast-math). */
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

/* Rows r0..r0+nr-1 of q, sharing one block table, against key head g: each walks its
 * blocks once, the next block prefetched while this one is computed (a sequence's
 * blocks are scattered over the pool, which defeats the hardware prefetcher at every
 * block boundary). */
static void attend_rows(const float *restrict q, const float *restrict k_cache,
                        const float *restrict v_cache, const int64_t *restrict table,
                        const int64_t *restrict lengths, float *restrict out, int r0, int nr,
                        int g, float scale) {
  float m[QT][REP], l[QT][REP], acc[QT][REP][D], qs[QT][REP][D];
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
    if (t0 + BS < longest) {
      const char *nk = (const char *)(k_cache + table[i + 1] * KBLOCK + g * D * BS);
      const float *nv = v_cache + table[i + 1] * KBLOCK + g * D;
      for (int o = 0; o < D * BS * (int)sizeof(float); o += 64) __builtin_prefetch(nk + o);
      for (int j = 0; j < BS; j++)
        for (int o = 0; o < D * (int)sizeof(float); o += 64)
          __builtin_prefetch((const char *)(nv + j * ROW) + o);
    }
    const float(*kt)[BS] = (const float(*)[BS])(k_cache + table[i] * KBLOCK + g * D * BS);
    const float *vb = v_cache + table[i] * KBLOCK + g * D;
    for (int r = 0; r < nr; r++) {
      const int64_t left = lengths[r0 + r] - t0;
      if (left > 0) row_block(qs[r], kt, vb, left < BS ? (int)left : BS, m[r], l[r], acc[r]);
    }
  }
  for (int r = 0; r < nr; r++)
    row_out(acc[r], l[r], out + ((int64_t)(r0 + r) * H + g * REP) * D);
}

/* Decodes: query b against the first lengths[b] slots of the blocks in row b of table
 * (row stride table_stride). One task is one sequence and key head. */
void paged_decode(const float *restrict q, const float *restrict k_cache,
                  const float *restrict v_cache, const int64_t *restrict table,
                  int64_t table_stride, const int64_t *restrict lengths, float *restrict out,
                  int batch, float scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int task = 0; task < batch * HKV; task++) {
    const int b = task / HKV;
    attend_rows(q, k_cache, v_cache, table + (int64_t)b * table_stride, lengths, out, b, 1,
                task % HKV, scale);
  }
}

/* A prefill chunk of one sequence: query row i sees slots 0..lengths[i]-1 of the blocks in
 * `table`. One task is a tile of QT rows and one key head: the tile's rows share each
 * block's reads. */
void paged_prefill(const float *restrict q, const float *restrict k_cache,
                   const float *restrict v_cache, const int64_t *restrict table,
                   const int64_t *restrict lengths, float *restrict out, int rows, float scale,
                   int threads) {
  const int tiles = (rows + QT - 1) / QT;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int task = 0; task < tiles * HKV; task++) {
    const int r0 = task / HKV * QT;
    attend_rows(q, k_cache, v_cache, table, lengths, out, r0,
                rows - r0 < QT ? rows - r0 : QT, task % HKV, scale);
  }
}

/* The calling thread's share of a whole step's attention (called by every thread of the
 * decoder's team, cpu_decoder.c): prefill chunks and decodes in one work-sharing loop, so
 * that neither waits for the other at a barrier. `plan` (int64, built by
 * worker_svc/cpu_decoder.py):
 *   [0] chunks C, [1] decodes B, [2] the decodes' table row stride, [3] their block table
 *   (B rows), [4] their lengths (B), [5] their rows of q (B), then per chunk: first row of
 *   q, rows, block table (its blocks), lengths (one per row);
 * tables, lengths and rows as addresses. A chunk's tiles and a decode are the tasks of
 * paged_prefill and paged_decode, on the same rows: the same bits. */
void paged_attention_part(const float *restrict q, const float *restrict k_cache,
                          const float *restrict v_cache, const int64_t *restrict plan,
                          float *restrict out, float scale) {
  const int64_t chunks = plan[0], decodes = plan[1], stride = plan[2];
  const int64_t *table = (const int64_t *)plan[3], *lengths = (const int64_t *)plan[4],
                *rows = (const int64_t *)plan[5], *chunk = plan + 6;
  int64_t chunk_tasks = 0;
  for (int64_t c = 0; c < chunks; c++) chunk_tasks += (chunk[4 * c + 1] + QT - 1) / QT * HKV;
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < chunk_tasks + decodes * HKV; task++) {
    if (task >= chunk_tasks) {
      const int64_t b = (task - chunk_tasks) / HKV, row = rows[b] * H * D;
      attend_rows(q + row, k_cache, v_cache, table + b * stride, lengths + b, out + row, 0, 1,
                  (int)((task - chunk_tasks) % HKV), scale);
      continue;
    }
    int64_t c = 0, first = 0; /* the chunk holding this task, and its first task */
    while (first + (chunk[4 * c + 1] + QT - 1) / QT * HKV <= task)
      first += (chunk[4 * c++ + 1] + QT - 1) / QT * HKV;
    const int64_t start = chunk[4 * c] * H * D, n = chunk[4 * c + 1];
    const int r0 = (int)((task - first) / HKV * QT);
    attend_rows(q + start, k_cache, v_cache, (const int64_t *)chunk[4 * c + 2],
                (const int64_t *)chunk[4 * c + 3], out + start, r0,
                n - r0 < QT ? (int)(n - r0) : QT, (int)((task - first) % HKV), scale);
  }
}
