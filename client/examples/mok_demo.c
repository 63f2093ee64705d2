/* mok_demo - the main job end to end: a layer with a shared expert runs forward
 * and backward through mokd; the results are checked bit for bit against the
 * CPU engine run in this process, and a second run against the first. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "mok.h"
#include "testbed.h"

static int same(const void *a, const void *b, size_t n, const char *what)
{
  if (memcmp(a, b, n) == 0)
    return 1;
  fprintf(stderr, "mok_demo: %s differs\n", what);
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

  if ((rc = mok_connect(path, "mok_demo", &c)) != 0 ||
      (rc = mok_testbed_setup(c, &d, T, 7, &tb)) != 0) {
    fprintf(stderr, "mok_demo: %s (%s)\n", mok_last_error(c), mok_strerror(rc));
    mok_close(c);
    return 1;
  }
  for (int run = 0; run < 2; run++) {
    if ((rc = mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f[run])) != 0 ||
        (rc = mok_backward(c, f[run].context, &tb.d_out, NULL, 0, &b[run])) != 0) {
      fprintf(stderr, "mok_demo: run %d: %s (%s)\n", run, mok_last_error(c), mok_strerror(rc));
      mok_close(c);
      return 1;
    }
  }

  /* the same step on the in-process engine, reading the same arena */
  mokk_backend *eng;
  mokk_shape s = {.H = d.hidden, .I = d.intermediate, .E = d.experts, .K = d.top_k,
                  .I_s = d.shared_intermediate, .P = 1};
  size_t TH = (size_t)(T * d.hidden);
  uint16_t *out = malloc(TH * 2), *dx = malloc(TH * 2), *g[MOK_NWEIGHTS];
  float *dtw = malloc((size_t)(T * d.top_k) * 4);
  mokk_fwd_rank fr = {mok_tensor_ptr(c, &tb.x), mok_tensor_ptr(c, &tb.ids),
                      mok_tensor_ptr(c, &tb.tw), {0}, out};
  mokk_bwd_rank br = {mok_tensor_ptr(c, &tb.d_out), dx, dtw, {0}, {0}};
  mokk_ctx *ctx;
  for (int w = 0; w < tb.nweights; w++) {
    fr.w[w] = mok_tensor_ptr(c, &tb.w[w]);
    br.g_bf16[w] = g[w] = malloc(mok_tensor_bytes(&tb.w[w]));
  }
  if (mokk_cpu_create(0, &eng, err) != 0 || mokk_forward(eng, &s, T, &fr, &ctx, err) != 0 ||
      mokk_backward(eng, ctx, MOKK_GRAD_BF16, &br, err) != 0) {
    fprintf(stderr, "mok_demo: in-process engine: %s\n", err);
    return 1;
  }
  ok &= same(f[0].out_ptr, out, TH * 2, "forward out vs the in-process engine");
  ok &= same(b[0].d_x_ptr, dx, TH * 2, "d_x vs the in-process engine");
  ok &= same(b[0].d_topk_weights_ptr, dtw, (size_t)(T * d.top_k) * 4,
             "d_topk_weights vs the in-process engine");
  for (int w = 0; w < tb.nweights; w++)
    ok &= same(b[0].grad_ptrs[w], g[w], mok_tensor_bytes(&tb.w[w]),
               "a weight gradient vs the in-process engine");
  int det = same(f[0].out_ptr, f[1].out_ptr, TH * 2, "out, run 2 vs run 1") &
            same(b[0].d_x_ptr, b[1].d_x_ptr, TH * 2, "d_x, run 2 vs run 1");
  for (int w = 0; w < tb.nweights; w++)
    det &= same(b[0].grad_ptrs[w], b[1].grad_ptrs[w], mok_tensor_bytes(&tb.w[w]),
                "a weight gradient, run 2 vs run 1");

  double fl = mok_testbed_flops(&tb);
  printf("mokd demo: layer T=%lld H=%lld I=%lld E=%lld K=%lld shared I_s=%lld, backend %s\n",
         (long long)T, (long long)d.hidden, (long long)d.intermediate, (long long)d.experts,
         (long long)d.top_k, (long long)d.shared_intermediate, mok_server_info(c)->backend);
  for (int run = 0; run < 2; run++)
    printf("  run %d: forward %.1f ms (%.1f GFLOP/s), backward %.1f ms (%.1f GFLOP/s)\n",
           run + 1, (double)f[run].timing.compute_ns * 1e-6,
           fl / (double)f[run].timing.compute_ns,
           (double)b[run].timing.compute_ns * 1e-6,
           2 * fl / (double)b[run].timing.compute_ns);
  printf("  matches the in-process engine bit for bit: %s\n", ok ? "yes" : "NO");
  printf("  determinism (run 2 == run 1, bitwise): %s\n", det ? "OK" : "FAILED");

  uint64_t ids[4] = {f[0].context, b[0].result, f[1].context, b[1].result};
  rc = mok_release(c, ids, 4);
  mokk_ctx_free(eng, ctx);
  mokk_backend_destroy(eng);
  for (int w = 0; w < tb.nweights; w++)
    free(g[w]);
  free(out), free(dx), free(dtw);
  mok_close(c);
  return ok && det && rc == 0 ? 0 : 1;
}
