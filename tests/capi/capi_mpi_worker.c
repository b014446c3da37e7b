/* Runs under mpirun (capi_mpi_test.cc starts it), through the C API only:
 *   capi_mpi_worker <plugin> <dir> <stage>
 * makes an MPI communicator (backend "mpi", the MPI backend at <plugin>),
 * checks its rank and size against the environment mpirun sets, checks that
 * an engine whose config names another rank is refused, then trains
 * strata_capi_mpi_train's case over the ranks (zero_stage <stage>), with its
 * checkpoint round trip in <dir>/ckpt, and writes this rank's masters to
 * <dir>/rank-R.bin. Prints "rank R: ok" or
 * "FAIL ..."; exit 0 on success. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/c.h"
#include "tests/capi/capi_mpi_case.h"

static float masters[kCapiMpiW + kCapiMpiB];

int main(int argc, char** argv) {
  char* err = NULL;
  char why[1024] = "";
  char path[4096];
  char ckpt[4096];
  char json[256];
  strata_comm_t* comm = NULL;
  strata_engine_options_t* opts = NULL;
  strata_device_t* dev = NULL;
  strata_engine_t* eng = NULL;
  const char* env_rank = getenv("OMPI_COMM_WORLD_RANK");
  const char* env_size = getenv("OMPI_COMM_WORLD_SIZE");
  int rank, size, code;
  FILE* f;

  if (argc != 4 || (strcmp(argv[3], "2") != 0 && strcmp(argv[3], "3") != 0)) {
    fprintf(stderr, "usage: %s <plugin> <dir> 2|3\n", argv[0]);
    return 2;
  }
  if (strata_comm_create("mpi", 60, NULL, argv[1], &comm, &err) != STRATA_OK) {
    printf("FAIL comm_create: %s\n", err ? err : "(none)");
    return 1;
  }
  rank = strata_comm_rank(comm);
  size = strata_comm_size(comm);
  if (strcmp(strata_comm_backend(comm), "mpi") != 0 ||
      (env_rank != NULL && atoi(env_rank) != rank) ||
      (env_size != NULL && atoi(env_size) != size) || size < 2) {
    printf("FAIL rank %d of %d (backend %s; mpirun says %s of %s)\n", rank,
           size, strata_comm_backend(comm), env_rank ? env_rank : "?",
           env_size ? env_size : "?");
    return 1;
  }
  /* A config naming another rank: the engine refuses the pair. */
  snprintf(json, sizeof json,
           "{\"strata\": {\"world_size\": %d, \"rank\": %d, "
           "\"zero_stage\": 2}}",
           size, (rank + 1) % size);
  if (strata_engine_options_from_json(json, strlen(json), &opts, &err) !=
          STRATA_OK ||
      strata_engine_options_set_comm(opts, comm, &err) != STRATA_OK ||
      strata_device_create("host", 1u << 20, &dev, &err) != STRATA_OK) {
    printf("FAIL rank %d: setup: %s\n", rank, err ? err : "(none)");
    return 1;
  }
  code = strata_engine_create(opts, dev, &eng, &err);
  if (code != STRATA_INVALID_ARGUMENT || err == NULL ||
      strstr(err, "must agree") == NULL) {
    printf("FAIL rank %d: wrong rank: %s: %s\n", rank,
           strata_code_name((strata_code_t)code), err ? err : "(none)");
    return 1;
  }
  printf("rank %d: wrong rank refused: %s\n", rank, err);
  strata_free(err);
  err = NULL;
  strata_engine_options_destroy(opts);
  strata_device_destroy(dev, NULL);

  snprintf(ckpt, sizeof ckpt, "%s/ckpt", argv[2]);
  if (strata_capi_mpi_train(comm, atoi(argv[3]), ckpt, masters, why,
                            sizeof why) != 0) {
    printf("FAIL rank %d: %s\n", rank, why);
    return 1;
  }
  strata_comm_destroy(comm); /* the engine held its share until now */
  snprintf(path, sizeof path, "%s/rank-%d.bin", argv[2], rank);
  f = fopen(path, "wb");
  if (f == NULL || fwrite(masters, sizeof masters, 1, f) != 1 ||
      fclose(f) != 0) {
    printf("FAIL rank %d: cannot write %s\n", rank, path);
    return 1;
  }
  printf("rank %d: ok\n", rank);
  return 0;
}
