/* Compiled as C99 with -pedantic-errors: strata/c.h must be plain C. The
 * function is called from capi_test.cc, so the calls it makes run too. */
#include <stdio.h>
#include <string.h>

#include "strata/c.h"

int strata_c_smoke(char* why, size_t why_len);

/* Four fp32 elements and fp32 state arrays (exp_avg may be NULL). */
static strata_cpu_tensors_t four_floats(float* master, const float* grad,
                                        float* exp_avg, float* exp_avg_sq) {
  strata_cpu_tensors_t t;
  memset(&t, 0, sizeof t);
  t.n = 4;
  t.master = master;
  t.grad = grad;
  t.grad_dtype = STRATA_FLOAT32;
  t.exp_avg = exp_avg;
  t.exp_avg_sq = exp_avg_sq;
  t.moment_dtype = STRATA_FLOAT32;
  return t;
}

/* Adafactor over a 2 x 2 matrix, its state sized by the footprint. */
static int factored_smoke(char* why, size_t why_len) {
  char* err = NULL;
  strata_cpu_optimizer_options_t* o = NULL;
  strata_cpu_optimizer_t* opt = NULL;
  strata_cpu_step_shape_t shape;
  strata_cpu_step_footprint_t f;
  strata_cpu_tensors_t t;
  strata_cpu_step_args_t args = strata_cpu_step_args_default();
  strata_cpu_step_result_t res;
  float master[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  float grad[4] = {1.0f, -1.0f, 1.0f, -1.0f};
  float stats[4] = {0, 0, 0, 0};
  int ok;

  memset(&shape, 0, sizeof shape);
  shape.n = 4;
  shape.rows = 2;
  shape.cols = 2;
  shape.grad_dtype = STRATA_FLOAT32;
  shape.moment_dtype = STRATA_FLOAT32;
  t = four_floats(master, grad, NULL, stats);
  ok = strata_cpu_optimizer_options_create(&o, &err) == STRATA_OK &&
       strata_cpu_optimizer_options_set_algo_name(o, "adafactor", &err) ==
           STRATA_OK &&
       strata_cpu_step_footprint_of(o, &shape, &f, &err) == STRATA_OK &&
       f.exp_avg_sq_bytes == sizeof stats &&
       strata_cpu_optimizer_create(o, &opt, &err) == STRATA_OK &&
       strata_cpu_optimizer_step_shaped(opt, &t, 2, 2, &args, &res, &err) ==
           STRATA_OK &&
       res.applied && res.param_sq > 0.0 && master[0] < 1.0f &&
       master[1] > 1.0f;
  if (!ok) snprintf(why, why_len, "adafactor: %s", err ? err : "no update");
  strata_free(err);
  strata_cpu_optimizer_destroy(opt);
  strata_cpu_optimizer_options_destroy(o);
  return ok ? 0 : 1;
}

/* 0 on success; otherwise 1 and a reason in `why`. */
int strata_c_smoke(char* why, size_t why_len) {
  char* err = NULL;
  strata_device_t* dev = NULL;
  strata_stream_t* stream = NULL;
  strata_cpu_optimizer_t* opt = NULL;
  strata_comm_t* comm = NULL;
  strata_cpu_tensors_t t;
  float master[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  float grad[4] = {1.0f, -1.0f, 1.0f, -1.0f};
  float m[4] = {0, 0, 0, 0}, v[4] = {0, 0, 0, 0};
  int applied = 0;

  if (strcmp(strata_version_string(), STRATA_VERSION_STRING) != 0) {
    snprintf(why, why_len, "version %s", strata_version_string());
    return 1;
  }
  if (strata_device_create("host", 1u << 20, &dev, &err) != STRATA_OK ||
      strata_stream_create(dev, &stream, &err) != STRATA_OK ||
      strata_stream_synchronize(stream, &err) != STRATA_OK ||
      strata_stream_destroy(stream, &err) != STRATA_OK ||
      strata_device_destroy(dev, &err) != STRATA_OK) {
    snprintf(why, why_len, "device: %s", err ? err : "?");
    strata_free(err);
    return 1;
  }
  if (strata_comm_create("single", 0.0, NULL, NULL, &comm, &err) != STRATA_OK ||
      strata_comm_size(comm) != 1 || strata_comm_rank(comm) != 0) {
    snprintf(why, why_len, "comm: %s", err ? err : "not 1 rank");
    strata_free(err);
    strata_comm_destroy(comm);
    return 1;
  }
  strata_comm_destroy(comm);
  if (strata_cpu_optimizer_create(NULL, &opt, &err) != STRATA_OK) {
    snprintf(why, why_len, "optimizer: %s", err ? err : "?");
    strata_free(err);
    return 1;
  }
  t = four_floats(master, grad, m, v);
  if (strata_cpu_optimizer_step(opt, &t, 1, 0.5, 1.0, 1.0, 1, &applied, &err) !=
          STRATA_OK ||
      !applied || !(master[0] < 1.0f) || !(master[1] > 1.0f)) {
    snprintf(why, why_len, "step: %s", err ? err : "master did not move");
    strata_free(err);
    strata_cpu_optimizer_destroy(opt);
    return 1;
  }
  strata_cpu_optimizer_destroy(opt);
  return factored_smoke(why, why_len);
}
