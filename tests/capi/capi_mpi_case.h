/* One small training run through the C API only, shared by the MPI worker
 * (each rank of an MPI communicator) and capi_mpi_test.cc (one engine alone,
 * the reference). Plain C99. */
#ifndef STRATA_TESTS_CAPI_CAPI_MPI_CASE_H_
#define STRATA_TESTS_CAPI_CAPI_MPI_CASE_H_

#include <stddef.h>

#include "strata/c.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { kCapiMpiW = 3000, kCapiMpiB = 100, kCapiMpiSteps = 3 };

/* Trains tensors "w" (kCapiMpiW elements) and "b" (kCapiMpiB) for
 * kCapiMpiSteps steps on the host-emulated device with `comm` (NULL: one
 * engine alone, world_size 1) and zero_stage `stage` (2 or 3; 3 keeps the
 * parameters in host memory) when the communicator has several ranks.
 * After each step every rank fetches both tensors: their device copies
 * must be the masters rounded to bf16. Rank r of n hands over Base(i) + (2r -
 * (n - 1)) * Alt(i), whose mean over the ranks is Base(i), exactly in fp32.
 * Writes the fp32 masters, w's then b's, to `masters` (kCapiMpiW + kCapiMpiB
 * floats). With `ckpt_dir` not NULL, then saves a checkpoint there (every rank,
 * rank 0 writing), steps once more and loads it back: the masters loaded must
 * be those saved bit for bit, and the paths saved and loaded the same. Returns
 * 0, or 1 with the reason in `why`. */
int strata_capi_mpi_train(strata_comm_t* comm, int stage, const char* ckpt_dir,
                          float* masters, char* why, size_t why_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_TESTS_CAPI_CAPI_MPI_CASE_H_ */
