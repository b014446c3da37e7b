/* A C99 program that trains a tiny model through the installed strata's C
 * API, as a trainer written in another language would: it fits w to a target
 * t under the loss |w - t| (summed) on the host-emulated device. Each step
 * it fetches w, reads the working copy, computes the gradient sign(w - t),
 * hands it over from device memory and lets the engine step.
 *
 * Adam moves each weight by exactly lr per step against a gradient of
 * constant magnitude and sign (m / sqrt(v) is then g / |g| after bias
 * correction), so with every target further than kSteps * kLr away the
 * master after kSteps steps is known to float precision. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <strata/c.h>

#define kN 8
#define kSteps 10
static const double kLr = 0.02;

static const char kConfig[] =
    "{\"strata\": {\"partition_bytes\": 65536, \"staging_buffer_bytes\": "
    "65536, \"device_budget_bytes\": 4194304, \"io_block_bytes\": 65536, "
    "\"optimizer\": {\"threads\": 1}}}";

/* Prints the failure and returns 1 when `code` is not STRATA_OK. */
static int failed(strata_code_t code, char* err, const char* what) {
  if (code == STRATA_OK) return 0;
  fprintf(stderr, "%s: %s: %s\n", what, strata_code_name(code),
          err ? err : "(no message)");
  strata_free(err);
  return 1;
}

#define CHECK(call, what)                    \
  do {                                       \
    char* err_ = NULL;                       \
    strata_code_t code_ = (call);            \
    if (failed(code_, err_, what)) return 1; \
  } while (0)

/* `err_` is what the calls write their message to. */
#define ERR (&err_)

static int train(strata_stream_t* stream, strata_engine_t* eng) {
  const int64_t shape[1] = {kN};
  uint32_t id = 0;
  float init[kN], target[kN], master[kN], w[kN], grad[kN];
  uint16_t working[kN];
  double loss0 = 0, loss = 0;
  int step, i;

  for (i = 0; i < kN; ++i) {
    init[i] = 0.1f * (float)(i - kN / 2);
    target[i] = init[i] + ((i % 2) ? 0.5f : -0.4f);
    loss0 += fabs(init[i] - target[i]);
  }
  CHECK(strata_engine_register(eng, "w", shape, 1, STRATA_BFLOAT16, &id, ERR),
        "register");
  CHECK(strata_engine_start(eng, ERR), "start");
  CHECK(strata_engine_set_initial_values(eng, id, init, kN, ERR),
        "set_initial_values");

  for (step = 1; step <= kSteps; ++step) {
    strata_param_pin_t* pin = NULL;
    strata_device_memory_t* g = NULL;
    int applied = 0;
    double norm = 0;
    int64_t done = 0;
    /* Forward: the working copy on the device, read back here. */
    CHECK(strata_engine_fetch(eng, id, &pin, ERR), "fetch");
    CHECK(strata_param_pin_wait_on(pin, stream, ERR), "wait_on");
    CHECK(strata_copy_async(stream, working, strata_param_pin_data(pin),
                            sizeof working, STRATA_DEVICE_TO_HOST, ERR),
          "copy working");
    CHECK(strata_stream_synchronize(stream, ERR), "synchronize");
    strata_param_pin_release(pin);
    CHECK(strata_convert(working, STRATA_BFLOAT16, w, STRATA_FLOAT32, kN, ERR),
          "convert");
    /* Backward: the gradient in device memory, handed over. */
    for (i = 0; i < kN; ++i) grad[i] = w[i] > target[i] ? 1.0f : -1.0f;
    CHECK(strata_device_memory_alloc(stream, sizeof grad, &g, ERR), "alloc");
    CHECK(strata_copy_async(stream, strata_device_memory_data(g), grad,
                            sizeof grad, STRATA_HOST_TO_DEVICE, ERR),
          "copy grad");
    CHECK(strata_engine_add_grad_owned(eng, id, g, STRATA_FLOAT32, stream, ERR),
          "add_grad");
    CHECK(strata_engine_step(eng, kLr, 1.0, 0.0, &applied, &norm, &done, ERR),
          "step");
    if (!applied || done != step || !(norm > 0)) {
      fprintf(stderr, "step %d: applied %d, step %lld, norm %g\n", step,
              applied, (long long)done, norm);
      return 1;
    }
  }

  CHECK(strata_engine_read_master(eng, id, master, kN, ERR), "read_master");
  for (i = 0; i < kN; ++i) {
    const double dir = target[i] > init[i] ? 1.0 : -1.0;
    const double want = init[i] + dir * kSteps * kLr;
    if (fabs(master[i] - want) > 1e-5) {
      fprintf(stderr, "master[%d] = %.7f, want %.7f\n", i, master[i], want);
      return 1;
    }
    loss += fabs(master[i] - target[i]);
  }
  if (!(loss < loss0)) {
    fprintf(stderr, "loss %g did not fall below %g\n", loss, loss0);
    return 1;
  }
  {
    char* json = NULL;
    CHECK(strata_engine_stats_json(eng, &json, ERR), "stats");
    if (strstr(json, "\"steps\":10") == NULL) {
      fprintf(stderr, "stats: %s\n", json);
      strata_free(json);
      return 1;
    }
    strata_free(json);
  }
  printf("c consumer ok: strata %s, loss %.4f -> %.4f in %d steps\n",
         strata_version_string(), loss0, loss, kSteps);
  return 0;
}

int main(void) {
  strata_device_t* dev = NULL;
  strata_stream_t* stream = NULL;
  strata_engine_options_t* options = NULL;
  strata_engine_t* eng = NULL;
  int rc;

  if (strcmp(strata_version_string(), STRATA_VERSION_STRING) != 0 ||
      strata_version_major() != STRATA_VERSION_MAJOR) {
    fprintf(stderr, "version mismatch: %s vs %s\n", strata_version_string(),
            STRATA_VERSION_STRING);
    return 1;
  }
  CHECK(strata_device_create("host", 16u << 20, &dev, ERR), "device");
  CHECK(strata_stream_create(dev, &stream, ERR), "stream");
  CHECK(
      strata_engine_options_from_json(kConfig, strlen(kConfig), &options, ERR),
      "options");
  CHECK(strata_engine_create(options, dev, &eng, ERR), "engine");
  strata_engine_options_destroy(options);

  rc = train(stream, eng);

  CHECK(strata_engine_destroy(eng, ERR), "engine destroy");
  CHECK(strata_stream_destroy(stream, ERR), "stream destroy");
  CHECK(strata_device_destroy(dev, ERR), "device destroy");
  return rc;
}
