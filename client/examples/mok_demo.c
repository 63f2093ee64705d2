/* mok_demo - the main job end to end: a layer with a shared expert runs forward
 * and backward through mokd; the results are checked against the CPU engine
 * run in this process (bit for bit on the cpu backend), and a second run
 * against the first, bit for bit. On the cuda backend the engine check is
 * |gpu - cpu| <= tol |cpu| + 2 tol rms(cpu), with tol = 2^-7 for out and
 * d_topk_weights and 2^-5 for d_x and the weight gradients: the tolerances
 * of tests/gpu/check_gpu.c, with twice its rms term, because here a bf16
 * intermediate (an expert's or the shared expert's output, up to a few
 * times rms(out) with this data) that rounds one ulp apart moves an output
 * near zero by 2^-8 |y| (seen: 0.0039 at an element of -0.0022, rms 0.44).
 * Tensors are read with mok_tensor_read, so host and GPU arenas work alike. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "bf16.h"
#include "mok.h"
#include "testbed.h"

static int bitwise = 1; /* cpu backend: the engine's bits exactly */

static double now_ms(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void *fetch(mok_client *c, const mok_tensor *t)
{
  void *p = malloc(mok_tensor_bytes(t));
  if (p == NULL || mok_tensor_read(c, t, p) != 0) {
    fprintf(stderr, "mok_demo: reading a tensor: %s\n", mok_last_error(c));
    exit(1);
  }
  return p;
}

static double val(const void *p, size_t i, int f32)
{
  return f32 ? ((const float *)p)[i] : mokk_bf16_to_f32(((const uint16_t *)p)[i]);
}

/* engine vs daemon: bit for bit, or max |a-b| / (tol (|a| + 2 rms a)) <= 1 */
static int close_to(const void *eng, const void *got, size_t n, int f32, double tol,
                    const char *what)
{
  double ss = 0, worst = 0;
  if (bitwise || tol == 0) {
    if (memcmp(eng, got, n * (f32 ? 4 : 2)) == 0)
      return 1;
    fprintf(stderr, "mok_demo: %s differs\n", what);
    return 0;
  }
  for (size_t i = 0; i < n; i++)
    ss += val(eng, i, f32) * val(eng, i, f32);
  double rms = sqrt(ss / (double)(n ? n : 1));
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    double a = val(eng, i, f32), b = val(got, i, f32);
    double r = fabs(a - b) / (tol * (fabs(a) + 2 * rms) + 1e-30);
    if (r > worst)
      worst = r, at = i;
  }
  if (worst <= 1)
    return 1;
  fprintf(stderr, "mok_demo: %s: error %.3f x the tolerance (element %zu: %.6g here, %.6g "
          "from mokd; rms %.6g)\n", what, worst, at, val(eng, at, f32), val(got, at, f32), rms);
  return 0;
}

int main(int argc, char **argv)
{
  const char *path = argc > 1 ? argv[1] : NULL;
  mok_layer_desc d = {.hidden = 512, .intermediate = 1024, .experts = 16, .top_k = 4,
                      .shared_intermediate = 1024};
  const int64_t T = 2048;
  mok_client *c;
  mok_testbed tb;
  mok_forward_result f[2];
  mok_backward_result b[2];
  char err[MOK_ERRLEN];
  int rc, ok = 1;

  if ((rc = mok_connect(path, "mok_demo", &c)) != 0) {
    fprintf(stderr, "mok_demo: %s (%s)\n", mok_last_error(c), mok_strerror(rc));
    mok_close(c);
    return 1;
  }
  if ((rc = mok_testbed_setup(c, &d, T, 7, &tb)) != 0) {
    fprintf(stderr, "mok_demo: %s (%s)\n", tb.err, mok_strerror(rc));
    mok_close(c);
    return 1;
  }
  double fms[2], bms[2];
  for (int run = 0; run < 2; run++) {
    double t0 = now_ms(), t1;
    if ((rc = mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f[run])) != 0 ||
        (t1 = now_ms(), rc = mok_backward(c, f[run].context, &tb.d_out, NULL, 0, &b[run])) != 0) {
      fprintf(stderr, "mok_demo: run %d: %s (%s)\n", run, mok_last_error(c), mok_strerror(rc));
      mok_close(c);
      return 1;
    }
    fms[run] = t1 - t0, bms[run] = now_ms() - t1;
  }
  bitwise = strcmp(mok_server_info(c)->backend, "cpu") == 0;

  /* the same step on the in-process engine, from the same inputs */
  mokk_backend *eng;
  mokk_shape s = {.H = d.hidden, .I = d.intermediate, .E = d.experts, .K = d.top_k,
                  .I_s = d.shared_intermediate, .P = 1};
  size_t TH = (size_t)(T * d.hidden), TK = (size_t)(T * d.top_k);
  uint16_t *out = malloc(TH * 2), *dx = malloc(TH * 2), *g[MOK_NWEIGHTS];
  float *dtw = malloc(TK * 4);
  void *in[4 + MOK_NWEIGHTS];
  mokk_fwd_rank fr = {in[0] = fetch(c, &tb.x), in[1] = fetch(c, &tb.ids),
                      in[2] = fetch(c, &tb.tw), {0}, out, NULL};
  mokk_bwd_rank br = {in[3] = fetch(c, &tb.d_out), dx, dtw, {0}, {0}, {0}, NULL};
  mokk_ctx *ctx;
  for (int w = 0; w < tb.nweights; w++) {
    fr.w[w] = in[4 + w] = fetch(c, &tb.w[w]);
    br.g_bf16[w] = g[w] = malloc(mok_tensor_bytes(&tb.w[w]));
  }
  if (mokk_cpu_create(0, &eng, err) != 0 || mokk_forward(eng, &s, T, &fr, &ctx, err) != 0 ||
      mokk_backward(eng, ctx, MOKK_GRAD_BF16, &br, err) != 0) {
    fprintf(stderr, "mok_demo: in-process engine: %s\n", err);
    return 1;
  }
  void *o[2][3 + MOK_NWEIGHTS];
  for (int run = 0; run < 2; run++) {
    o[run][0] = fetch(c, &f[run].out);
    o[run][1] = fetch(c, &b[run].d_x);
    o[run][2] = fetch(c, &b[run].d_topk_weights);
    for (int w = 0; w < tb.nweights; w++)
      o[run][3 + w] = fetch(c, &b[run].grads[w]);
  }
  ok &= close_to(out, o[0][0], TH, 0, 1.0 / 128, "forward out vs the in-process engine");
  ok &= close_to(dx, o[0][1], TH, 0, 1.0 / 32, "d_x vs the in-process engine");
  ok &= close_to(dtw, o[0][2], TK, 1, 1.0 / 128, "d_topk_weights vs the in-process engine");
  for (int w = 0; w < tb.nweights; w++)
    ok &= close_to(g[w], o[0][3 + w], mok_tensor_bytes(&tb.w[w]) / 2, 0, 1.0 / 32,
                   "a weight gradient vs the in-process engine");
  int det = close_to(o[0][0], o[1][0], TH, 0, 0, "out, run 2 vs run 1") &
            close_to(o[0][1], o[1][1], TH, 0, 0, "d_x, run 2 vs run 1");
  for (int w = 0; w < tb.nweights; w++)
    det &= close_to(o[0][3 + w], o[1][3 + w], mok_tensor_bytes(&tb.w[w]) / 2, 0, 0,
                    "a weight gradient, run 2 vs run 1");

  double fl = mok_testbed_flops(&tb);
  printf("mokd demo: layer T=%lld H=%lld I=%lld E=%lld K=%lld shared I_s=%lld, backend %s\n",
         (long long)T, (long long)d.hidden, (long long)d.intermediate, (long long)d.experts,
         (long long)d.top_k, (long long)d.shared_intermediate, mok_server_info(c)->backend);
  for (int run = 0; run < 2; run++)
    printf("  run %d: forward %.1f ms (%.1f GFLOP/s), backward %.1f ms (%.1f GFLOP/s), "
           "request round trips\n", run + 1, fms[run], fl / fms[run] * 1e-6, bms[run],
           2 * fl / bms[run] * 1e-6);
  if (bitwise)
    printf("  matches the in-process engine bit for bit: %s\n", ok ? "yes" : "NO");
  else
    printf("  matches the in-process CPU engine within the GPU tolerances: %s\n",
           ok ? "yes" : "NO");
  printf("  determinism (run 2 == run 1, bitwise): %s\n", det ? "OK" : "FAILED");

  uint64_t ids[4] = {f[0].context, b[0].result, f[1].context, b[1].result};
  rc = mok_release(c, ids, 4);
  mokk_ctx_free(eng, ctx);
  mokk_backend_destroy(eng);
  for (int w = 0; w < tb.nweights; w++)
    free(g[w]);
  for (int i = 0; i < 4 + tb.nweights; i++)
    free(in[i]);
  for (int run = 0; run < 2; run++)
    for (int i = 0; i < 3 + tb.nweights; i++)
      free(o[run][i]);
  free(out), free(dx), free(dtw);
  mok_close(c);
  return ok && det && rc == 0 ? 0 : 1;
}
