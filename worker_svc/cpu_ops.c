/* The decoder's elementwise work around its GEMMs, one pass each (worker_svc/cpu_ops.py).
 *
 * torch spells each of these as several ops, and each op walks the whole activation again
 * through memory and pays its dispatch: an RMSNorm is seven, a SwiGLU three, rotating q and
 * k and writing the cache ten. Here each is one loop over the rows, a row at a time while
 * it is in L1. Every row is computed alone, in a fixed order, so a row's result does not
 * depend on the rows beside it (the batch).
 */
#include <math.h>
#include <stdint.h>

#define VW 16 /* lanes of the sum of squares: one AVX-512 vector, two AVX2 ones */
/* Below this many floats a call runs on one thread: waking the team costs more. */
#define PARALLEL_FLOATS 32768

typedef float vec __attribute__((vector_size(VW * 4), aligned(4)));

/* Each op below is a `_part`, the calling thread's share of the rows (its work-sharing loop
 * binds to the enclosing parallel region: the op's own, or the decoder's in cpu_decoder.c),
 * and a function that runs it on a team of its own. */

/* out = rmsnorm(x) * w, row by row; with residual, x += residual first (x then holds the
 * sum, the residual stream of the next block). */
void rms_norm_part(float *restrict x, const float *restrict residual, const float *restrict w,
                   float *restrict out, int64_t rows, int dim, float eps) {
#pragma omp for
  for (int64_t r = 0; r < rows; r++) {
    float *xr = x + r * dim;
    if (residual != 0)
      for (int i = 0; i < dim; i++) xr[i] += residual[r * dim + i];
    /* The sum of squares in VW lanes, then the lanes in order: a fixed order per row. */
    vec lanes = {0};
    int i = 0;
    for (; i + VW <= dim; i += VW) {
      vec v;
      __builtin_memcpy(&v, xr + i, sizeof v);
      lanes += v * v;
    }
    float ss = 0.f;
    for (int j = 0; j < VW; j++) ss += lanes[j];
    for (; i < dim; i++) ss += xr[i] * xr[i];
    const float scale = 1.f / sqrtf(ss / (float)dim + eps);
    for (int j = 0; j < dim; j++) out[r * dim + j] = xr[j] * scale * w[j];
  }
}

void rms_norm(float *restrict x, const float *restrict residual, const float *restrict w,
              float *restrict out, int64_t rows, int dim, float eps, int threads) {
#pragma omp parallel num_threads(threads) if (rows * dim >= PARALLEL_FLOATS)
  rms_norm_part(x, residual, w, out, rows, dim, eps);
}

/* out (rows, inter) = silu(gate) * up of a fused gate/up GEMM's output gu (rows, 2 inter),
 * gate columns first. */
void silu_mul_part(const float *restrict gu, float *restrict out, int64_t rows, int inter) {
#pragma omp for
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gu + r * 2 * inter, *u = g + inter;
    float *o = out + r * inter;
    /* exp's argument is capped so that 1 + e stays finite (the kernel is built with
     * -ffast-math, which assumes no infinities): silu(-88) is -1e-37, i.e. 0. */
    for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(fminf(-g[i], 88.f))) * u[i];
  }
}

void silu_mul(const float *restrict gu, float *restrict out, int64_t rows, int inter,
              int threads) {
#pragma omp parallel num_threads(threads) if (rows * inter >= PARALLEL_FLOATS)
  silu_mul_part(gu, out, rows, inter);
}

static inline void rotate(const float *restrict x, const float *restrict cs, float *restrict y,
                          int dim, int64_t stride) {
  for (int p = 0; p < dim / 2; p++) {
    const float x0 = x[2 * p], x1 = x[2 * p + 1], c = cs[2 * p], s = cs[2 * p + 1];
    y[2 * p * stride] = x0 * c - x1 * s;
    y[(2 * p + 1) * stride] = x1 * c + x0 * s;
  }
}

/* One step's new tokens into the cache: row t of qkv (q heads, k heads, v heads, each
 * `dim` floats) has its q and k heads rotated by rot[t] (dim/2 (cos, sin) pairs, turning
 * interleaved pairs (2i, 2i+1)); q goes to q_out (t, hq, dim), k and v to slot slots[t]:
 * the key cache (blocks, hkv, dim, bs) keeps a block's keys of a head as rows of slots
 * (worker_svc/cpu_attention.c), the value cache is (blocks, bs, hkv, dim). Returns the
 * number of this thread's slots out of range (their rows are not written); the caller
 * refuses the step on any. */
int64_t rotate_into_cache_part(const float *restrict qkv, const float *restrict rot,
                               const int64_t *restrict slots, float *restrict q_out,
                               float *restrict k_cache, float *restrict v_cache,
                               int64_t tokens, int hq, int hkv, int dim, int bs,
                               int64_t num_slots) {
  const int64_t row = (int64_t)(hq + 2 * hkv) * dim, kv = (int64_t)hkv * dim;
  int64_t bad = 0;
#pragma omp for
  for (int64_t t = 0; t < tokens; t++) {
    const float *src = qkv + t * row, *cs = rot + t * dim;
    const int64_t slot = slots[t];
    const int cached = slot >= 0 && slot < num_slots;
    bad += !cached;
    for (int h = 0; h < hq; h++)
      rotate(src + (int64_t)h * dim, cs, q_out + (t * hq + h) * dim, dim, 1);
    if (!cached) continue;
    float *keys = k_cache + slot / bs * kv * bs + slot % bs;
    for (int h = 0; h < hkv; h++)
      rotate(src + (int64_t)(hq + h) * dim, cs, keys + (int64_t)h * dim * bs, dim, bs);
    for (int64_t i = 0; i < kv; i++) v_cache[slot * kv + i] = src[(int64_t)(hq + hkv) * dim + i];
  }
  return bad;
}

int64_t rotate_into_cache(const float *restrict qkv, const float *restrict rot,
                          const int64_t *restrict slots, float *restrict q_out,
                          float *restrict k_cache, float *restrict v_cache, int64_t tokens,
                          int hq, int hkv, int dim, int bs, int64_t num_slots, int threads) {
  int64_t bad = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad) \
    if (tokens * (hq + 2 * hkv) * dim >= PARALLEL_FLOATS)
  bad += rotate_into_cache_part(qkv, rot, slots, q_out, k_cache, v_cache, tokens, hq, hkv, dim,
                                bs, num_slots);
  return bad;
}
