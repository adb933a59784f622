/* A C program using an installed dion3 through its C API: one Dion3 step on one CPU parameter. */
#include <dion3/dion3.h>
#include <stdio.h>

int main(void) {
  float w[16] = {1, 2, 3, 4, 5, 6, 7, 8, 8, 7, 6, 5, 4, 3, 2, 1}, g[16] = {1, -1, 1, -1};
  dion3_tensor weight = {w, DION3_F32, DION3_DEVICE_CPU, 0, 2, {4, 4}}, grad = weight;
  grad.data = g;
  dion3_group_config cfg;
  dion3_group_config_default(&cfg);
  dion3_optimizer* opt = NULL;
  int group = -1, applied = 0;
  if (dion3_create(&opt, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE) != DION3_OK ||
      dion3_add_group(opt, &cfg, &group) != DION3_OK ||
      dion3_add_param(opt, group, "w", &weight, &grad, NULL) != DION3_OK || dion3_step(opt, &applied) != DION3_OK ||
      !applied || w[0] == 1.0f) {
    fprintf(stderr, "C consumer failed: %s\n", dion3_last_error());
    return 1;
  }
  dion3_destroy(opt);
  printf("C consumer: dion3 %s stepped\n", dion3_version());
  return 0;
}
