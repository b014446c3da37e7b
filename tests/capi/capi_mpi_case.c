/* See capi_mpi_case.h. */
#include "tests/capi/capi_mpi_case.h"

#include <stdio.h>
#include <string.h>

static float Init(size_t i) { return (float)((int)(i % 11) - 5) / 16.0f; }
static float Base(size_t i) { return (float)((int)(i % 13) - 6) / 64.0f; }
static float Alt(size_t i) { return (float)((i % 7) + 1) / 8.0f; }

#define CHECK(call)                                                  \
  do {                                                               \
    if ((call) != STRATA_OK) {                                       \
      snprintf(why, why_len, "%s: %s", #call, err ? err : "(none)"); \
      goto out;                                                      \
    }                                                                \
  } while (0)

/* Fetches both tensors and checks that each rank's device copy is the
 * master rounded to bf16 (with zero_stage 3 a gather of the ranks'
 * shards). */
static strata_code_t CheckWorking(strata_engine_t* eng, strata_stream_t* st,
                                  const uint32_t* ids, const float* masters,
                                  int* same, char** err) {
  static uint16_t want[kCapiMpiW], got[kCapiMpiW];
  const size_t numel[2] = {kCapiMpiW, kCapiMpiB};
  strata_param_pin_t* pin = NULL;
  strata_code_t c = STRATA_OK;
  int t;
  *same = 1;
  for (t = 0; t < 2 && c == STRATA_OK; ++t) {
    c = strata_engine_fetch(eng, ids[t], &pin, err);
    if (c == STRATA_OK) c = strata_param_pin_wait(pin, err);
    if (c == STRATA_OK) {
      c = strata_copy_async(st, got, strata_param_pin_data(pin), numel[t] * 2,
                            STRATA_DEVICE_TO_HOST, err);
    }
    if (c == STRATA_OK) c = strata_stream_synchronize(st, err);
    strata_param_pin_release(pin);
    pin = NULL;
    if (c == STRATA_OK) {
      c = strata_convert(masters + (t == 0 ? 0 : kCapiMpiW), STRATA_FLOAT32,
                         want, STRATA_BFLOAT16, numel[t], err);
    }
    if (c == STRATA_OK && memcmp(want, got, numel[t] * 2) != 0) *same = 0;
  }
  return c;
}

static strata_code_t ReadMasters(strata_engine_t* eng, const uint32_t* ids,
                                 float* out, char** err) {
  strata_code_t c = strata_engine_read_master(eng, ids[0], out, kCapiMpiW, err);
  if (c != STRATA_OK) return c;
  return strata_engine_read_master(eng, ids[1], out + kCapiMpiW, kCapiMpiB,
                                   err);
}

int strata_capi_mpi_train(strata_comm_t* comm, int stage, const char* ckpt_dir,
                          float* masters, char* why, size_t why_len) {
  static float w[kCapiMpiW], g[kCapiMpiW], loaded[kCapiMpiW + kCapiMpiB];
  const int rank = comm != NULL ? strata_comm_rank(comm) : 0;
  const int size = comm != NULL ? strata_comm_size(comm) : 1;
  const float sign = (float)(2 * rank - (size - 1));
  const int64_t w_shape[2] = {30, 100};
  const int64_t b_shape[1] = {kCapiMpiB};
  const size_t numel[2] = {kCapiMpiW, kCapiMpiB};
  char json[512];
  char* err = NULL;
  char* saved_path = NULL;
  char* loaded_path = NULL;
  int rc = 1, s, t, applied = 0, same = 1;
  size_t i;
  uint32_t ids[2] = {0, 0};
  strata_device_t* dev = NULL;
  strata_stream_t* stream = NULL;
  strata_engine_options_t* opts = NULL;
  strata_engine_t* eng = NULL;
  strata_device_memory_t* mem = NULL;

  snprintf(json, sizeof json,
           "{\"strata\": {\"world_size\": %d, \"rank\": %d, "
           "\"zero_stage\": %d, \"params\": \"%s\", "
           "\"partition_bytes\": 65536, "
           "\"staging_buffer_bytes\": 65536, \"io_block_bytes\": 65536, "
           "\"device_budget_bytes\": 8388608, "
           "\"persistence_threshold_bytes\": 0, \"optimizer\": "
           "{\"threads\": 1}}}",
           size, rank, size > 1 ? stage : 3, stage == 3 ? "host" : "device");
  CHECK(strata_device_create("host", 64u << 20, &dev, &err));
  CHECK(strata_stream_create(dev, &stream, &err));
  CHECK(strata_engine_options_from_json(json, strlen(json), &opts, &err));
  CHECK(strata_engine_options_set_comm(opts, comm, &err));
  CHECK(strata_engine_create(opts, dev, &eng, &err));
  CHECK(strata_engine_register(eng, "w", w_shape, 2, STRATA_BFLOAT16, &ids[0],
                               &err));
  CHECK(strata_engine_register(eng, "b", b_shape, 1, STRATA_BFLOAT16, &ids[1],
                               &err));
  CHECK(strata_engine_start(eng, &err));
  for (t = 0; t < 2; ++t) {
    for (i = 0; i < numel[t]; ++i) w[i] = Init(i + (size_t)t);
    CHECK(strata_engine_set_initial_values(eng, ids[t], w, numel[t], &err));
  }
  /* With a checkpoint: saved after kCapiMpiSteps steps, one more step,
   * then loaded back. */
  for (s = 0; s < kCapiMpiSteps + (ckpt_dir != NULL ? 1 : 0); ++s) {
    if (s == kCapiMpiSteps) {
      CHECK(ReadMasters(eng, ids, masters, &err));
      CHECK(strata_engine_save_checkpoint(eng, ckpt_dir, s, 0, 0, &saved_path,
                                          &err));
    }
    for (t = 0; t < 2; ++t) {
      for (i = 0; i < numel[t]; ++i) g[i] = Base(i + (size_t)s) + sign * Alt(i);
      CHECK(strata_device_memory_alloc(stream, numel[t] * 4, &mem, &err));
      /* Pageable host memory: the copy has read `g` once it returns. */
      CHECK(strata_copy_async(stream, strata_device_memory_data(mem), g,
                              numel[t] * 4, STRATA_HOST_TO_DEVICE, &err));
      CHECK(strata_engine_add_grad_owned(eng, ids[t], mem, STRATA_FLOAT32,
                                         stream, &err));
      mem = NULL; /* the engine's now, whatever the outcome */
    }
    CHECK(strata_engine_step(eng, 1e-2, 0.0, 0.0, &applied, NULL, NULL, &err));
    if (!applied) {
      snprintf(why, why_len, "step %d was skipped", s);
      goto out;
    }
    CHECK(ReadMasters(eng, ids, loaded, &err));
    CHECK(CheckWorking(eng, stream, ids, loaded, &same, &err));
    if (!same) {
      snprintf(why, why_len,
               "after step %d the fetched working copy is not the master "
               "rounded to bf16",
               s);
      goto out;
    }
  }
  if (ckpt_dir == NULL) {
    CHECK(ReadMasters(eng, ids, masters, &err));
  } else {
    CHECK(ReadMasters(eng, ids, loaded, &err));
    if (memcmp(loaded, masters, sizeof loaded) == 0) {
      snprintf(why, why_len, "the step after the save changed nothing");
      goto out;
    }
    CHECK(strata_engine_load_checkpoint(eng, ckpt_dir, &loaded_path, &err));
    CHECK(ReadMasters(eng, ids, loaded, &err));
    if (strcmp(saved_path, loaded_path) != 0) {
      snprintf(why, why_len, "saved %s, loaded %s", saved_path, loaded_path);
      goto out;
    }
    if (memcmp(loaded, masters, sizeof loaded) != 0) {
      snprintf(why, why_len,
               "the masters loaded from %s are not the saved ones",
               loaded_path);
      goto out;
    }
  }
  rc = 0;
out:
  strata_free(saved_path);
  strata_free(loaded_path);
  strata_free(err);
  err = NULL;
  strata_device_memory_free(mem);
  if (strata_engine_destroy(eng, &err) != STRATA_OK && rc == 0) {
    snprintf(why, why_len, "engine_destroy: %s", err ? err : "(none)");
    rc = 1;
  }
  strata_free(err);
  err = NULL;
  strata_engine_options_destroy(opts);
  strata_stream_destroy(stream, NULL);
  strata_device_destroy(dev, NULL);
  return rc;
}
