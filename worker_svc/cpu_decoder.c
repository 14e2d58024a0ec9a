/* The decoder's layers, all of them in one call and one parallel region
 * (worker_svc/cpu_decoder.py).
 *
 * Called layer by layer from Python, a step is ~12 kernel calls per layer, each with its
 * checks, its output allocated by torch and its own OpenMP team woken and joined; at a
 * decode step of SmolLM2 that Python between the kernels was a fifth of the main thread's
 * time, and the team's other thread spun at a barrier meanwhile (docs/worker.md). Here
 * one team runs every layer: each kernel is the `_part` of its own library (the calling
 * thread's share of a work-sharing loop, which binds to this region), its address handed
 * over by Python, and the barrier at the end of each loop orders the phases.
 *
 * Per layer, as TransformerBlock.forward computes it, with the same kernels on the same
 * rows, so the bits are the same as layer by layer:
 *   normed = rms_norm(x); qkv = normed @ wqkv (+ b); q = rotate(qkv), k and v to the cache;
 *   attn = attention(q); o = attn @ wo (+ b); o += x; normed = rms_norm(o);
 *   gu = normed @ w13 (+ b); act = silu(gate) * up; f = act @ w2 (+ b); x = f + o.
 */
#include <stdint.h>

typedef void (*gemm_fn)(const float *, const float *, float *, int, int, int);
typedef void (*norm_fn)(float *, const float *, const float *, float *, int64_t, int, float);
typedef void (*silu_fn)(const float *, float *, int64_t, int);
typedef int64_t (*rotate_fn)(const float *, const float *, const int64_t *, float *, float *,
                             float *, int64_t, int, int, int, int, int64_t);
typedef void (*attend_fn)(const float *, const float *, const float *, const int64_t *, float *,
                          float);

/* The kernels' addresses, in this order. */
enum { GEMM, NORM, SILU, ROTATE, ATTEND };
/* Each layer's addresses, in this order (a bias 0 where there is none). */
enum { ATTN_NORM, WQKV, BQKV, WO, BO, FFN_NORM, W13, B13, W2, B2, K_CACHE, V_CACHE, PER_LAYER };

static void add_bias_part(float *restrict y, const float *restrict b, int64_t rows, int n) {
  if (b == 0) return; /* the same for every thread: all skip the loop and its barrier */
#pragma omp for
  for (int64_t r = 0; r < rows; r++)
    for (int j = 0; j < n; j++) y[r * n + j] += b[j];
}

static void sum_part(float *restrict x, const float *restrict a, const float *restrict b,
                     int64_t n) {
#pragma omp for
  for (int64_t i = 0; i < n; i++) x[i] = a[i] + b[i];
}

/* x (tokens, dim), the residual stream, in place through `layers` layers. `work` holds
 * tokens * (3 dim + (3 hq + 2 hkv) hd + 3 inter) floats. Returns the number of slots out of
 * range in the first layer (their keys and values are not written); the caller refuses
 * the step on any. */
int64_t decoder_layers(const int64_t *restrict kernels, const int64_t *restrict weights,
                       int layers, float *restrict x, float *restrict work,
                       const float *restrict rot, const int64_t *restrict slots,
                       const int64_t *restrict plan, int64_t tokens, int dim, int hq, int hkv,
                       int hd, int inter, int bs, int64_t num_slots, float eps, float scale,
                       int threads) {
  const gemm_fn gemm = (gemm_fn)kernels[GEMM];
  const norm_fn norm = (norm_fn)kernels[NORM];
  const silu_fn silu = (silu_fn)kernels[SILU];
  const rotate_fn rotate = (rotate_fn)kernels[ROTATE];
  const attend_fn attend = (attend_fn)kernels[ATTEND];
  const int qkv_n = (hq + 2 * hkv) * hd, q_n = hq * hd;
  float *normed = work, *qkv = normed + tokens * dim, *q = qkv + tokens * qkv_n,
        *attn = q + tokens * q_n, *o = attn + tokens * q_n, *gu = o + tokens * dim,
        *act = gu + tokens * 2 * inter, *f = act + tokens * inter;
  int64_t bad = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad)
  for (int l = 0; l < layers; l++) {
    const int64_t *w = weights + (int64_t)l * PER_LAYER;
#define AT(i) ((float *)w[i])
    norm(x, 0, AT(ATTN_NORM), normed, tokens, dim, eps);
    gemm(normed, AT(WQKV), qkv, (int)tokens, qkv_n, dim);
    add_bias_part(qkv, AT(BQKV), tokens, qkv_n);
    const int64_t missed = rotate(qkv, rot, slots, q, AT(K_CACHE), AT(V_CACHE), tokens, hq,
                                  hkv, hd, bs, num_slots);
    if (l == 0) bad += missed;
    attend(q, AT(K_CACHE), AT(V_CACHE), plan, attn, scale);
    gemm(attn, AT(WO), o, (int)tokens, dim, q_n);
    add_bias_part(o, AT(BO), tokens, dim);
    norm(o, x, AT(FFN_NORM), normed, tokens, dim, eps);
    gemm(normed, AT(W13), gu, (int)tokens, 2 * inter, dim);
    add_bias_part(gu, AT(B13), tokens, 2 * inter);
    silu(gu, act, tokens, inter);
    gemm(act, AT(W2), f, (int)tokens, dim, inter);
    add_bias_part(f, AT(B2), tokens, dim);
    sum_part(x, f, o, tokens * dim);
#undef AT
  }
  return bad;
}
