/* out_of_memory.c — the C API when allocations fail: each call that fails for lack of memory
 * returns DION3_INTERNAL with a message (never aborts, even when every later allocation fails
 * too), and leaves the optimizer as it was, so that the same call retried with memory back
 * behaves as if it had never failed. Each call is swept over every allocation it makes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_tensor.h"
#include "dion3/dion3.h"
#include "fail_alloc.h"

/* The matrices: R x C, and C x R for the second of make_two; main() sets them larger for the
 * run with several threads (`threads` argument), so that the passes split over the team. */
static int R = 32, C = 48;
#define MAX_ELEMS (512 * 768)
static float wa[MAX_ELEMS], ga[MAX_ELEMS], wb[MAX_ELEMS], gb[MAX_ELEMS], want[MAX_ELEMS];
static float clean[MAX_ELEMS], before_a[MAX_ELEMS], before_b[MAX_ELEMS];
#define BYTES (sizeof(float) * (size_t)R * (size_t)C)
static int failures;

#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      printf("FAIL: " __VA_ARGS__);      \
      printf("\n");                      \
      ++failures;                        \
    }                                    \
  } while (0)

/* Fresh weights and gradients for "a" and "b" (fp32). */
static void fresh_values(void) {
  for (int i = 0; i < R * C; ++i) {
    wa[i] = wb[i] = 0.01f * (float)(i % 13);
    ga[i] = gb[i] = (float)(i % 7) - 3.0f;
  }
}

/* An optimizer with parameter "a"; fresh weights for "a" and "b". */
static dion3_optimizer* make(int* group) {
  fresh_values();
  dion3_optimizer* o = NULL;
  dion3_group_config cfg;
  dion3_group_config_default(&cfg);
  dion3_tensor t = f32_matrix(wa, R, C), g = f32_matrix(ga, R, C);
  if (dion3_create(&o, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE) != DION3_OK ||
      dion3_add_group(o, &cfg, group) != DION3_OK || dion3_add_param(o, *group, "a", &t, &g, NULL) != DION3_OK) {
    printf("FAIL: setup: %s\n", dion3_last_error());
    ++failures;
  }
  return o;
}

/* add_param("b") failing at each allocation: nothing registered; the retry steps as a clean run. */
static void add_param_is_all_or_nothing(void) {
  int group, points = 0;
  dion3_optimizer* o = make(&group);
  dion3_tensor t = f32_matrix(wb, R, C), g = f32_matrix(gb, R, C);
  dion3_add_param(o, group, "b", &t, &g, NULL);
  dion3_step(o, NULL);
  memcpy(want, wb, BYTES);
  dion3_destroy(o);
  for (long n = 1;; ++n) {
    o = make(&group);
    fail_alloc_arm(n, 0);
    const dion3_status s = dion3_add_param(o, group, "b", &t, &g, NULL);
    const long failed = fail_alloc_disarm();
    if (!failed) {
      CHECK(s == DION3_OK, "add_param with every allocation granted: %s", dion3_last_error());
      dion3_destroy(o);
      break;
    }
    ++points;
    int count = -1;
    dion3_num_params(o, &count);
    if (s != DION3_OK) {
      CHECK(s == DION3_INTERNAL && strstr(dion3_last_error(), "memory"), "allocation %ld: status %d '%s'", n, s,
            dion3_last_error());
      CHECK(count == 1, "allocation %ld: a failed add_param left %d parameters", n, count);
      CHECK(dion3_add_param(o, group, "b", &t, &g, NULL) == DION3_OK, "allocation %ld: the retry: %s", n,
            dion3_last_error());
    }
    CHECK(dion3_step(o, NULL) == DION3_OK && memcmp(wb, want, BYTES) == 0,
          "allocation %ld: the step after it differs from a run that never failed", n);
    dion3_destroy(o);
  }
  printf("add_param: %d allocations failed in turn\n", points);
}

/* set_group_config failing at each allocation: the group keeps its settings. */
static void set_group_config_is_all_or_nothing(void) {
  int group, points = 0;
  for (long n = 1;; ++n) {
    dion3_optimizer* o = make(&group);
    dion3_group_config before, next, after;
    dion3_get_group_config(o, group, &before);
    next = before;
    next.fraction = 0.5;
    next.num_heads = 2;
    next.orth_num_restarts = 0;
    fail_alloc_arm(n, 0);
    const dion3_status s = dion3_set_group_config(o, group, &next);
    const long failed = fail_alloc_disarm();
    dion3_get_group_config(o, group, &after);
    if (!failed) {
      CHECK(s == DION3_OK && after.fraction == 0.5, "set_group_config with every allocation granted: %s",
            dion3_last_error());
      dion3_destroy(o);
      break;
    }
    ++points;
    if (s != DION3_OK)
      CHECK(after.fraction == before.fraction && after.num_heads == before.num_heads &&
                after.orth_num_restarts == before.orth_num_restarts,
            "allocation %ld: a failed set_group_config changed the group", n);
    dion3_destroy(o);
  }
  printf("set_group_config: %d allocations failed in turn\n", points);
}

static int second_bf16; /* make_two's second parameter in bf16 (element-wise rules load chunks) */
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

/* Two groups of one matrix each, the second matrix of the other shape (C x R), with the settings
 * `setup` gives them. */
typedef void (*setup_fn)(dion3_group_config* first, dion3_group_config* second);
static dion3_optimizer* make_two(setup_fn setup) {
  fresh_values();
  dion3_group_config first, second;
  dion3_group_config_default(&first);
  dion3_group_config_default(&second);
  setup(&first, &second);
  dion3_optimizer* o = NULL;
  int g0, g1;
  dion3_tensor t = f32_matrix(wa, R, C), g = f32_matrix(ga, R, C);
  dion3_tensor t2 = f32_matrix(wb, C, R), g2 = f32_matrix(gb, C, R);
  if (second_bf16) { /* the same values in bf16, in the front half of the arrays */
    uint16_t *w16 = (uint16_t*)wb, *g16 = (uint16_t*)gb;
    for (int i = 0; i < R * C; ++i) {
      w16[i] = to_bf16(0.01f * (float)(i % 13));
      g16[i] = to_bf16((float)(i % 7) - 3.0f);
    }
    t2.dtype = g2.dtype = DION3_BF16;
  }
  if (dion3_create(&o, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE) != DION3_OK ||
      dion3_add_group(o, &first, &g0) != DION3_OK || dion3_add_group(o, &second, &g1) != DION3_OK ||
      dion3_add_param(o, g0, "a", &t, &g, NULL) != DION3_OK || dion3_add_param(o, g1, "b", &t2, &g2, NULL) != DION3_OK) {
    printf("FAIL: setup: %s\n", dion3_last_error());
    ++failures;
  }
  return o;
}
static void dion3_halves(dion3_group_config* a, dion3_group_config* b) { a->fraction = b->fraction = 0.5; }
static void stored_in_out_and_adamw(dion3_group_config* a, dion3_group_config* b) {
  a->transposed = 1;
  b->algorithm = DION3_ALGO_ADAMW;
}
static void normuon_and_lion(dion3_group_config* a, dion3_group_config* b) {
  a->algorithm = DION3_ALGO_NORMUON;
  b->algorithm = DION3_ALGO_LION;
}
static void muon_and_dion2_columns(dion3_group_config* a, dion3_group_config* b) {
  a->algorithm = DION3_ALGO_MUON;
  b->algorithm = DION3_ALGO_DION2;  /* a tall matrix: it selects columns */
}

/* A step failing at each allocation: the weights and the state stay as they were, so that the
 * step retried with memory back gives what a run that never failed gives (two more steps
 * compared, so that a momentum or second moment left half updated would show in the weights).
 * The step swept is the second one: the first of a plan reserves its scratch as it goes (see
 * src/cpu/cpu_scratch.hpp), so it can fail part way. */
static void step_is_all_or_nothing(const char* name, setup_fn setup) {
  int points = 0;
  for (long n = 0;; ++n) {
    dion3_optimizer* o = make_two(setup);
    dion3_step(o, NULL);
    memcpy(before_a, wa, BYTES);
    memcpy(before_b, wb, BYTES);
    if (n > 0) fail_alloc_arm(n, 0);
    const dion3_status s = dion3_step(o, NULL);
    const long failed = n > 0 ? fail_alloc_disarm() : 0;
    if (n > 0 && !failed) {
      CHECK(s == DION3_OK, "%s: step with every allocation granted: %s", name, dion3_last_error());
      dion3_destroy(o);
      break;
    }
    if (n > 0) {
      ++points;
      if (s != DION3_OK) {
        CHECK(s == DION3_INTERNAL && strstr(dion3_last_error(), "memory"), "%s, allocation %ld: status %d '%s'", name,
              n, s, dion3_last_error());
        CHECK(memcmp(wa, before_a, BYTES) == 0 && memcmp(wb, before_b, BYTES) == 0,
              "%s, allocation %ld: a failed step changed the weights", name, n);
        CHECK(dion3_step(o, NULL) == DION3_OK, "%s, allocation %ld: the retry: %s", name, n, dion3_last_error());
      }
    }
    CHECK(dion3_step(o, NULL) == DION3_OK && dion3_step(o, NULL) == DION3_OK, "%s, allocation %ld: the steps after: %s",
          name, n, dion3_last_error());
    if (n == 0)
      memcpy(clean, wb, BYTES);
    else
      CHECK(memcmp(wb, clean, BYTES) == 0, "%s, allocation %ld: the steps after differ from a run that never failed",
            name, n);
    dion3_destroy(o);
  }
  printf("step (%s): %d allocations failed in turn\n", name, points);
}

/* With no memory at all from some point on, calls still return (an error, or OK where they need
 * none); the defaults need no allocation. */
static void no_memory_at_all(void) {
  int group;
  dion3_optimizer* o = make(&group);
  dion3_tensor t = f32_matrix(wb, R, C), g = f32_matrix(gb, R, C);
  dion3_group_config cfg;
  memset(&cfg, 0, sizeof cfg);
  fail_alloc_arm(1, 1);
  dion3_group_config_default(&cfg);
  const dion3_status added = dion3_add_param(o, group, "b", &t, &g, NULL);
  const dion3_status stepped = dion3_step(o, NULL);
  const dion3_status bad = dion3_set_lr(o, 99, 0.1);  /* refused, for the group or for memory */
  fail_alloc_disarm();
  CHECK(cfg.lr > 0, "group_config_default filled nothing without memory");
  CHECK(added == DION3_INTERNAL, "add_param without memory: %d", added);
  CHECK(stepped == DION3_INTERNAL || stepped == DION3_OK, "step without memory: %d", stepped);
  CHECK(bad != DION3_OK && dion3_last_error()[0] != '\0', "a refusal without memory: %d '%s'", bad,
        dion3_last_error());
  dion3_destroy(o);
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "threads") == 0) {
    R = 512;
    C = 768;
    step_is_all_or_nothing("Dion3, fraction 1/2, larger", dion3_halves);
    step_is_all_or_nothing("Dion3 stored (in, out), AdamW, larger", stored_in_out_and_adamw);
    second_bf16 = 1;
    step_is_all_or_nothing("Dion3 stored (in, out), AdamW in bf16, larger", stored_in_out_and_adamw);
    step_is_all_or_nothing("NorMuon, Lion in bf16, larger", normuon_and_lion);
    printf(failures ? "%d failures\n" : "ok\n", failures);
    return failures != 0;
  }
  add_param_is_all_or_nothing();
  set_group_config_is_all_or_nothing();
  step_is_all_or_nothing("Dion3, fraction 1/2", dion3_halves);
  step_is_all_or_nothing("Dion3 stored (in, out), AdamW", stored_in_out_and_adamw);
  step_is_all_or_nothing("NorMuon, Lion", normuon_and_lion);
  step_is_all_or_nothing("Muon, Dion2 on columns", muon_and_dion2_columns);
  no_memory_at_all();
  printf(failures ? "%d failures\n" : "ok\n", failures);
  return failures != 0;
}
