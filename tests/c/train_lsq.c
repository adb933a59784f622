/* tests/c/train_lsq.c — end-to-end test of the C API, written in plain C99.
 *
 * Fits Y = W* X + b* with a 16x32 matrix W (Dion3, fraction 0.5) and a bias b (AdamW group)
 * through dion3.h, and checks:
 *   - the loss drops by a large factor (the optimizer actually optimizes),
 *   - error paths: a 1-D tensor in a Dion3 group is refused with status 1 and a message naming
 *     the parameter; bad enums and NULL handles give status 1; a non-finite gradient gives
 *     status 2 (raise) or a skipped step (skip) and leaves the weights untouched,
 *   - state export/import: an optimizer rebuilt from exported state continues bit-identically
 *     to the original; corrupted, truncated or mismatching buffers are refused and change
 *     nothing,
 *   - dion3_version() is the repository's VERSION file.
 * Exit status 0 on success; every failed check prints a line and the test fails at the end.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_tensor.h"
#include "dion3/dion3.h"

#define M 16     /* rows of W (outputs) */
#define N 32     /* columns of W (inputs) */
#define B 64     /* samples */
#define STEPS 300
#define EXPORT_AT 120

static int g_failures = 0;

#define CHECK(cond, ...)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
      ++g_failures;                                                   \
    }                                                                 \
  } while (0)

#define CHECK_OK(call)                                                                    \
  do {                                                                                    \
    dion3_status s_ = (call);                                                             \
    if (s_ != DION3_OK) {                                                                 \
      fprintf(stderr, "FAIL %s:%d: %s returned %d (%s): %s\n", __FILE__, __LINE__, #call, \
              (int)s_, dion3_status_name(s_), dion3_last_error());                        \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

/* ---- deterministic data ----------------------------------------------------------------- */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static double uniform01(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return ((g_rng >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static double gaussian(void) {
  double u = uniform01(), v = uniform01();
  return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static float X[N][B], Y[M][B];

static void make_problem(void) {
  float wstar[M][N], bstar[M];
  int i, j, s;
  for (i = 0; i < M; ++i)
    for (j = 0; j < N; ++j) wstar[i][j] = (float)(gaussian() / sqrt((double)N));
  for (i = 0; i < M; ++i) bstar[i] = (float)(0.5 * gaussian());
  for (j = 0; j < N; ++j)
    for (s = 0; s < B; ++s) X[j][s] = (float)gaussian();
  for (i = 0; i < M; ++i)
    for (s = 0; s < B; ++s) {
      double acc = bstar[i];
      for (j = 0; j < N; ++j) acc += (double)wstar[i][j] * X[j][s];
      Y[i][s] = (float)acc;
    }
}

/* loss = 1/(2B) sum (W X + b - Y)^2; writes dL/dW and dL/db. */
static double loss_and_grad(const float* w, const float* b, float* gw, float* gb) {
  double r[M][B], loss = 0.0;
  int i, j, s;
  for (i = 0; i < M; ++i)
    for (s = 0; s < B; ++s) {
      double acc = b[i] - Y[i][s];
      for (j = 0; j < N; ++j) acc += (double)w[i * N + j] * X[j][s];
      r[i][s] = acc;
      loss += acc * acc;
    }
  if (gw) {
    for (i = 0; i < M; ++i) {
      double acc_b = 0.0;
      for (j = 0; j < N; ++j) {
        double acc = 0.0;
        for (s = 0; s < B; ++s) acc += r[i][s] * X[j][s];
        gw[i * N + j] = (float)(acc / B);
      }
      for (s = 0; s < B; ++s) acc_b += r[i][s];
      gb[i] = (float)(acc_b / B);
    }
  }
  return loss / (2.0 * B);
}

/* ---- helpers ------------------------------------------------------------------------------ */

static dion3_tensor view1(float* data, int64_t n) {
  dion3_tensor t = f32_matrix(data, n, 1);
  t.ndim = 1;
  t.shape[1] = 0;
  return t;
}

/* The model: one Dion3 matrix and one AdamW bias, with their gradient buffers. */
typedef struct model {
  dion3_optimizer* opt;
  int g_matrix, g_bias;
  float w[M * N], b[M], gw[M * N], gb[M];
} model;

static double lr_at(int t) { return 0.08 * (1.0 - (double)t / STEPS); } /* linear decay */

static void model_init(model* md, dion3_nonfinite_policy policy) {
  dion3_group_config cfg;
  dion3_tensor w, gw, b, gb;
  memset(md, 0, sizeof *md);
  CHECK_OK(dion3_create(&md->opt, DION3_DEVICE_CPU, 0, NULL, policy));

  dion3_group_config_default(&cfg);
  cfg.algorithm = DION3_ALGO_DION3;
  cfg.fraction = 0.5;
  cfg.weight_decay = 0.0;
  cfg.lr = lr_at(0);
  CHECK_OK(dion3_add_group(md->opt, &cfg, &md->g_matrix));

  dion3_group_config_default(&cfg);
  cfg.algorithm = DION3_ALGO_ADAMW;
  cfg.lr = 0.05;
  cfg.weight_decay = 0.0;
  CHECK_OK(dion3_add_group(md->opt, &cfg, &md->g_bias));

  w = f32_matrix(md->w, M, N);
  gw = f32_matrix(md->gw, M, N);
  b = view1(md->b, M);
  gb = view1(md->gb, M);
  CHECK_OK(dion3_add_param(md->opt, md->g_matrix, "proj.weight", &w, &gw, NULL));
  CHECK_OK(dion3_add_param(md->opt, md->g_bias, "proj.bias", &b, &gb, NULL));
}

/* One training step at schedule position t; returns the loss before the step. */
static double model_step(model* md, int t) {
  int applied = -1;
  double loss = loss_and_grad(md->w, md->b, md->gw, md->gb);
  CHECK_OK(dion3_set_lr(md->opt, md->g_matrix, lr_at(t)));
  CHECK_OK(dion3_step(md->opt, &applied));
  CHECK(applied == 1, "step %d was not applied", t);
  return loss;
}

/* ---- checks --------------------------------------------------------------------------------- */

static void test_defaults(void) {
  dion3_group_config cfg, back;
  dion3_optimizer* opt = NULL;
  int g = -1;
  dion3_group_config_default(&cfg);
  CHECK(cfg.algorithm == DION3_ALGO_DION3, "default algorithm %d", cfg.algorithm);
  CHECK(cfg.lr == 0.01 && cfg.fraction == 0.25 && cfg.mu == 0.95 && cfg.muon_beta2 == 0.95,
        "defaults lr=%g fraction=%g mu=%g beta2=%g", cfg.lr, cfg.fraction, cfg.mu, cfg.muon_beta2);
  CHECK(cfg.weight_decay == 0.01 && cfg.epsilon == 1e-8, "wd=%g eps=%g", cfg.weight_decay, cfg.epsilon);
  CHECK(cfg.adjust_lr == DION3_ADJUST_LR_SPECTRAL_NORM && cfg.flatten == 0, "adjust_lr/flatten");
  CHECK(cfg.orth_num_restarts == 1 && cfg.orth_restarts[0] == 2, "restarts");

  CHECK_OK(dion3_create(&opt, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE));
  cfg.fraction = 0.125;
  cfg.orth_coefficients = DION3_COEFF_YOU;
  CHECK_OK(dion3_add_group(opt, &cfg, &g));
  CHECK_OK(dion3_get_group_config(opt, g, &back));
  CHECK(back.fraction == 0.125 && back.orth_coefficients == DION3_COEFF_YOU,
        "group config did not round-trip (fraction %g, coefficients %d)", back.fraction,
        back.orth_coefficients);
  cfg.orth_coefficients = DION3_COEFF_REFERENCE;
  CHECK_OK(dion3_add_group(opt, &cfg, &g));
  CHECK_OK(dion3_get_group_config(opt, g, &back));
  CHECK(back.orth_coefficients == DION3_COEFF_REFERENCE, "the reference set did not round-trip (%d)",
        back.orth_coefficients);
  cfg.orth_coefficients = 4;
  CHECK(dion3_add_group(opt, &cfg, &g) == DION3_INVALID_ARGUMENT, "coefficient set 4 was accepted");
  dion3_destroy(opt);
}

static void test_errors(void) {
  dion3_optimizer* opt = NULL;
  dion3_group_config cfg;
  float v[M], gv[M], w[M * N], gw[M * N];
  dion3_tensor tv, tgv, tw, tgw;
  dion3_status s;
  int g = -1, n = -1;

  /* NULL handles and bad enums. */
  CHECK(dion3_step(NULL, NULL) == DION3_INVALID_ARGUMENT, "step(NULL)");
  CHECK(dion3_create(&opt, 7, 0, NULL, DION3_NONFINITE_RAISE) == DION3_INVALID_ARGUMENT,
        "device 7 accepted");
  CHECK(opt == NULL, "handle set on failure");
  CHECK(strlen(dion3_last_error()) > 0, "no message after a failure");
  if (!dion3_cuda_available()) {
    s = dion3_create(&opt, DION3_DEVICE_CUDA, 0, NULL, DION3_NONFINITE_RAISE);
    CHECK(s == DION3_UNSUPPORTED || s == DION3_INTERNAL, "CUDA without CUDA gave %d", (int)s);
    if (s == DION3_OK) dion3_destroy(opt);
    opt = NULL;
  }

  CHECK_OK(dion3_create(&opt, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE));
  dion3_group_config_default(&cfg);
  cfg.algorithm = 42;
  CHECK(dion3_add_group(opt, &cfg, &g) == DION3_INVALID_ARGUMENT, "algorithm 42 accepted");
  dion3_group_config_default(&cfg);
  cfg.fraction = 1.5;
  CHECK(dion3_add_group(opt, &cfg, &g) == DION3_INVALID_ARGUMENT, "fraction 1.5 accepted");

  /* A 1-D tensor in a Dion3 group: refused (at registration or at the first step) with a
   * message naming the parameter. */
  dion3_group_config_default(&cfg);
  CHECK_OK(dion3_add_group(opt, &cfg, &g));
  memset(v, 0, sizeof v);
  memset(gv, 0, sizeof gv);
  memset(w, 0, sizeof w);
  memset(gw, 0, sizeof gw);
  tv = view1(v, M);
  tgv = view1(gv, M);
  tw = f32_matrix(w, M, N);
  tgw = f32_matrix(gw, M, N);
  CHECK_OK(dion3_add_param(opt, g, "ok.weight", &tw, &tgw, NULL));
  s = dion3_add_param(opt, g, "layer3.norm.scale", &tv, &tgv, NULL);
  if (s == DION3_OK) s = dion3_step(opt, NULL);
  CHECK(s == DION3_INVALID_ARGUMENT, "1-D tensor in a dion3 group gave status %d", (int)s);
  CHECK(strstr(dion3_last_error(), "layer3.norm.scale") != NULL,
        "message does not name the parameter: \"%s\"", dion3_last_error());
  printf("error path ok: %s\n", dion3_last_error());
  dion3_destroy(opt);
  opt = NULL;

  /* Mismatched gradient shape. */
  CHECK_OK(dion3_create(&opt, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE));
  dion3_group_config_default(&cfg);
  CHECK_OK(dion3_add_group(opt, &cfg, &g));
  tgw = f32_matrix(gw, N, M);
  s = dion3_add_param(opt, g, "transposed.grad", &tw, &tgw, NULL);
  if (s == DION3_OK) s = dion3_step(opt, NULL);
  CHECK(s == DION3_INVALID_ARGUMENT, "grad of shape [32, 16] for weight [16, 32] gave %d", (int)s);
  CHECK(dion3_set_lr(opt, 99, 0.1) == DION3_INVALID_ARGUMENT, "set_lr on group 99");
  CHECK(dion3_set_grad(opt, 99, &tgw) == DION3_INVALID_ARGUMENT, "set_grad on param 99");
  CHECK_OK(dion3_num_params(opt, &n));
  dion3_destroy(opt);
  dion3_destroy(NULL);

  /* A gradient bound after registration: stepping before set_grad is refused. */
  CHECK_OK(dion3_create(&opt, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE));
  dion3_group_config_default(&cfg);
  CHECK_OK(dion3_add_group(opt, &cfg, &g));
  CHECK_OK(dion3_add_param(opt, g, "late.grad", &tw, NULL, &n));
  s = dion3_step(opt, NULL);
  CHECK(s == DION3_INVALID_ARGUMENT && strstr(dion3_last_error(), "late.grad") != NULL,
        "step without a gradient gave %d: %s", (int)s, dion3_last_error());
  tgw = f32_matrix(gw, M, N);
  CHECK_OK(dion3_set_grad(opt, n, &tgw));
  gw[0] = 1.0f;
  CHECK_OK(dion3_step(opt, NULL));
  dion3_destroy(opt);
}

static void test_nonfinite(void) {
  model md;
  float w_before[M * N], b_before[M];
  int applied = -1;
  int64_t taken = -1, skipped = -1;
  dion3_status s;

  /* raise: status 2, nothing modified */
  model_init(&md, DION3_NONFINITE_RAISE);
  model_step(&md, 0);
  memcpy(w_before, md.w, sizeof w_before);
  memcpy(b_before, md.b, sizeof b_before);
  loss_and_grad(md.w, md.b, md.gw, md.gb);
  md.gw[5] = (float)NAN;
  s = dion3_step(md.opt, &applied);
  CHECK(s == DION3_NON_FINITE, "NaN gradient under raise gave %d", (int)s);
  CHECK(applied == 0, "applied=%d after a raised step", applied);
  CHECK(memcmp(w_before, md.w, sizeof w_before) == 0 && memcmp(b_before, md.b, sizeof b_before) == 0,
        "weights changed by a refused step");
  CHECK_OK(dion3_steps(md.opt, &taken, &skipped));
  CHECK(taken == 1 && skipped == 0, "a raised step changed the counters: taken %lld skipped %lld",
        (long long)taken, (long long)skipped);
  dion3_destroy(md.opt);

  /* skip: status 0, applied 0, counted, nothing modified; the next finite step applies */
  model_init(&md, DION3_NONFINITE_SKIP);
  model_step(&md, 0);
  memcpy(w_before, md.w, sizeof w_before);
  memcpy(b_before, md.b, sizeof b_before);
  loss_and_grad(md.w, md.b, md.gw, md.gb);
  md.gb[3] = (float)INFINITY;
  s = dion3_step(md.opt, &applied);
  CHECK(s == DION3_OK && applied == 0, "Inf gradient under skip gave status %d applied %d", (int)s,
        applied);
  CHECK(memcmp(w_before, md.w, sizeof w_before) == 0 && memcmp(b_before, md.b, sizeof b_before) == 0,
        "weights changed by a skipped step");
  CHECK_OK(dion3_steps(md.opt, &taken, &skipped));
  CHECK(skipped == 1, "steps taken %lld skipped %lld", (long long)taken, (long long)skipped);
  model_step(&md, 1);
  dion3_destroy(md.opt);
}

/* Re-seals a state buffer edited in place: the FNV-1a hash of all but its last 8 bytes. */
static void reseal(unsigned char* buf, size_t size) {
  uint64_t h = 14695981039346656037ull;
  size_t i;
  for (i = 0; i + 8 < size; ++i) h = (h ^ buf[i]) * 1099511628211ull;
  for (i = 0; i < 8; ++i) buf[size - 8 + i] = (unsigned char)(h >> (8 * i));
}

static void test_train_and_roundtrip(void) {
  static model a, b; /* static: keep the stack small */
  double first = 0.0, last = 0.0;
  unsigned char* buf = NULL;
  size_t size = 0, written = 0, state_bytes = 0;
  dion3_status s;
  int t;

  model_init(&a, DION3_NONFINITE_RAISE);
  for (t = 0; t < STEPS; ++t) {
    double loss;
    if (t == EXPORT_AT) {
      /* Snapshot weights and optimizer state; b continues from them below. */
      CHECK_OK(dion3_export_size(a.opt, &size));
      buf = (unsigned char*)malloc(size);
      CHECK(dion3_export_state(a.opt, buf, size - 1, &written) == DION3_INVALID_ARGUMENT,
            "export into a buffer one byte short was accepted");
      CHECK_OK(dion3_export_state(a.opt, buf, size, &written));
      CHECK(written == size, "wrote %lu of %lu bytes", (unsigned long)written, (unsigned long)size);
      model_init(&b, DION3_NONFINITE_RAISE);
      memcpy(b.w, a.w, sizeof a.w);
      memcpy(b.b, a.b, sizeof a.b);
    }
    loss = model_step(&a, t);
    if (t == 0) first = loss;
    last = loss;
  }
  last = loss_and_grad(a.w, a.b, NULL, NULL);
  printf("loss %.6g -> %.6g (x%.3g lower) after %d steps\n", first, last, first / last, STEPS);
  CHECK(last < first / 100.0, "loss only went from %g to %g", first, last);

  CHECK_OK(dion3_state_size(a.opt, &state_bytes));
  /* Dion3: momentum (M*N f32) + variance (M f32); AdamW: exp_avg + exp_avg_sq (2*M f32). */
  CHECK(state_bytes >= (size_t)(M * N + 3 * M) * 4, "state_size %lu too small",
        (unsigned long)state_bytes);
  printf("state: %lu bytes in memory, %lu bytes serialized\n", (unsigned long)state_bytes,
         (unsigned long)size);

  /* Refused imports leave b untouched: corrupted byte, truncated buffer, wrong magic. */
  buf[size / 2] ^= 0x5A;
  CHECK(dion3_import_state(b.opt, buf, size) == DION3_INVALID_ARGUMENT, "corrupted buffer accepted");
  buf[size / 2] ^= 0x5A;
  CHECK(dion3_import_state(b.opt, buf, size - 9) == DION3_INVALID_ARGUMENT, "truncated buffer accepted");
  CHECK(dion3_import_state(b.opt, "garbage", 8) == DION3_INVALID_ARGUMENT, "garbage accepted");
  {
    /* Well-sealed buffers with a set reserved field (bytes 12..15) or a step counter (bytes
     * 16..23) the next step would overflow are refused too, naming the field. */
    unsigned char* edited = (unsigned char*)malloc(size);
    int64_t taken = -1;
    memcpy(edited, buf, size);
    edited[12] = 1;
    reseal(edited, size);
    CHECK(dion3_import_state(b.opt, edited, size) == DION3_INVALID_ARGUMENT, "reserved field 1 accepted");
    CHECK(strstr(dion3_last_error(), "reserved") != NULL, "message: %s", dion3_last_error());
    memcpy(edited, buf, size);
    memset(edited + 16, 0xff, 7);
    edited[23] = 0x7f; /* INT64_MAX */
    reseal(edited, size);
    CHECK(dion3_import_state(b.opt, edited, size) == DION3_INVALID_ARGUMENT, "steps = INT64_MAX accepted");
    CHECK(strstr(dion3_last_error(), "'steps'") != NULL, "message: %s", dion3_last_error());
    CHECK_OK(dion3_steps(b.opt, &taken, NULL));
    CHECK(taken == 0, "a refused import changed the step counter to %lld", (long long)taken);
    free(edited);
  }
  {
    /* An optimizer whose parameter names differ refuses the buffer. */
    dion3_optimizer* other = NULL;
    dion3_group_config cfg;
    dion3_tensor tw = f32_matrix(b.w, M, N), tg = f32_matrix(b.gw, M, N);
    int g;
    CHECK_OK(dion3_create(&other, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE));
    dion3_group_config_default(&cfg);
    CHECK_OK(dion3_add_group(other, &cfg, &g));
    CHECK_OK(dion3_add_param(other, g, "another.weight", &tw, &tg, NULL));
    s = dion3_import_state(other, buf, size);
    CHECK(s == DION3_INVALID_ARGUMENT, "import into a different model gave %d", (int)s);
    dion3_destroy(other);
  }

  CHECK_OK(dion3_import_state(b.opt, buf, size));
  for (t = EXPORT_AT; t < STEPS; ++t) model_step(&b, t);
  CHECK(memcmp(a.w, b.w, sizeof a.w) == 0, "imported optimizer diverged on the matrix");
  CHECK(memcmp(a.b, b.b, sizeof a.b) == 0, "imported optimizer diverged on the bias");
  if (memcmp(a.w, b.w, sizeof a.w) == 0 && memcmp(a.b, b.b, sizeof a.b) == 0)
    printf("export at step %d + import: %d further steps bit-identical\n", EXPORT_AT, STEPS - EXPORT_AT);
  {
    int64_t ta = 0, tb = 0;
    CHECK_OK(dion3_steps(a.opt, &ta, NULL));
    CHECK_OK(dion3_steps(b.opt, &tb, NULL));
    CHECK(ta == tb && ta == STEPS, "step counters %lld vs %lld", (long long)ta, (long long)tb);
  }
  free(buf);
  dion3_destroy(a.opt);
  dion3_destroy(b.opt);
}

int main(void) {
  printf("dion3 C API %s (API version %d)\n", dion3_version(), DION3_C_API_VERSION);
  CHECK(strcmp(dion3_version(), DION3_EXPECTED_VERSION) == 0, "dion3_version() is \"%s\", VERSION says \"%s\"",
        dion3_version(), DION3_EXPECTED_VERSION);
  CHECK(dion3_api_version() == DION3_C_API_VERSION, "library API version %d, header %d", dion3_api_version(),
        DION3_C_API_VERSION);
  make_problem();
  test_defaults();
  test_errors();
  test_nonfinite();
  test_train_and_roundtrip();
  if (g_failures) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("all C API checks passed\n");
  return 0;
}
