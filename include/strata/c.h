/* strata's C API: the engine and its checkpoints, the device and its
 * streams, the communicator of data-parallel ranks, and the CPU optimizer on
 * caller memory, for callers that are not C++ (a Python binding, another
 * trainer's runtime). It compiles as C99 and as C++; every call is a thin
 * wrapper of the C++ API (strata/engine.h, strata/checkpoint.h,
 * strata/device.h, strata/comm.h, strata/cpu_adam.h) and nothing it does
 * throws. docs/c_api.md has the conventions at length.
 *
 * Errors: every call that can fail returns a strata_code_t (STRATA_OK, 0, on
 * success; the values mirror strata::StatusCode) and takes a last argument
 * `char** errptr`. When errptr is not NULL the call always writes *errptr:
 * NULL on success, on failure a NUL-terminated message that names the call
 * and the thing at fault (a JSON path, a tensor, a byte count), allocated
 * with malloc; the caller frees it with strata_free. A message that cannot
 * be allocated leaves *errptr NULL; the code is returned all the same. A
 * NULL handle or out-pointer where one is required is STRATA_INVALID_ARGUMENT,
 * never a crash. Out-of-memory inside the library (std::bad_alloc) is
 * STRATA_OUT_OF_MEMORY. Calls that cannot fail (accessors, frees) return
 * their value directly; given a NULL handle they return 0 or NULL.
 *
 * Ownership: every object a `*_create`, `*_wrap_*`, `*_alloc`, `*_fetch` or
 * `*_register_*` call hands out is the caller's and is given back by its
 * own `*_destroy`, `*_free`, `*_release` or `*_unregister`, which accept
 * NULL. Strings the library returns are the caller's (strata_free) where a
 * call says so, and otherwise live as long as the object they came from.
 * Arrays passed in are borrowed for the call only, except where a call says
 * otherwise (a gradient handed to strata_engine_add_grad).
 *
 * Lifetimes, checked where a count can tell: a device outlives its streams,
 * device memory and engines; an engine outlives its pins; a stream outlives
 * the pins that waited on it and the device memory allocated on it. A
 * destroy that would break this fails with STRATA_FAILED_PRECONDITION and
 * destroys nothing. A handle used after it was destroyed cannot be told
 * apart from a live one: that is undefined behaviour, as free() twice is.
 *
 * Threads: devices, streams, communicators and engines are thread-safe
 * (as their C++ objects); a pin, an engine options object and a CPU optimizer
 * must not be used by two threads at once. A destroy must not overlap another
 * call on the same object.
 */
#ifndef STRATA_C_H_
#define STRATA_C_H_

#include <stddef.h>
#include <stdint.h>

#include "strata/export.h"
#include "strata/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Codes, types, memory, version ----------------------------------- */

/* The values of strata::StatusCode (strata/status.h), one for one. */
typedef enum strata_code {
  STRATA_OK = 0,
  STRATA_INVALID_ARGUMENT = 1,
  STRATA_NOT_FOUND = 2,
  STRATA_ALREADY_EXISTS = 3,
  STRATA_OUT_OF_MEMORY = 4,
  STRATA_NO_SPACE = 5,
  STRATA_IO_ERROR = 6,
  STRATA_CORRUPTION = 7,
  STRATA_UNAVAILABLE = 8,
  STRATA_NOT_SUPPORTED = 9,
  STRATA_BUSY = 10,
  STRATA_PERMISSION_DENIED = 11,
  STRATA_FAILED_PRECONDITION = 12,
  STRATA_OUT_OF_RANGE = 13,
  STRATA_ABORTED = 14,
  STRATA_INTERNAL = 15
} strata_code_t;

/* Element types. BLOCK8 is an optimizer-state type only (8-bit codes with
 * one fp32 scale per 2048 elements, strata_cpu_state_bytes). */
typedef enum strata_dtype {
  STRATA_FLOAT32 = 0,
  STRATA_FLOAT16 = 1,
  STRATA_BFLOAT16 = 2,
  STRATA_BLOCK8 = 3
} strata_dtype_t;

typedef enum strata_copy_kind {
  STRATA_HOST_TO_DEVICE = 0,
  STRATA_DEVICE_TO_HOST = 1,
  STRATA_DEVICE_TO_DEVICE = 2
} strata_copy_kind_t;

typedef struct strata_device strata_device_t;
typedef struct strata_stream strata_stream_t;
typedef struct strata_device_memory strata_device_memory_t;
typedef struct strata_external_memory strata_external_memory_t;
typedef struct strata_comm strata_comm_t;
typedef struct strata_engine_options strata_engine_options_t;
typedef struct strata_engine strata_engine_t;
typedef struct strata_param_pin strata_param_pin_t;
typedef struct strata_cpu_optimizer_options strata_cpu_optimizer_options_t;
typedef struct strata_cpu_optimizer strata_cpu_optimizer_t;

/* A short stable name of a code, e.g. "InvalidArgument"; "Unknown" for a
 * value outside the enum. Static storage. */
STRATA_EXPORT const char* strata_code_name(strata_code_t code);

/* Frees what the library allocated for the caller (error messages, JSON
 * strings). NULL is a no-op. */
STRATA_EXPORT void strata_free(void* p);

/* "MAJOR.MINOR.PATCH" of the library loaded, and its parts; compare with
 * STRATA_VERSION_STRING and STRATA_VERSION_MAJOR/MINOR/PATCH of the headers
 * compiled against. Static storage. */
STRATA_EXPORT const char* strata_version_string(void);
STRATA_EXPORT int strata_version_major(void);
STRATA_EXPORT int strata_version_minor(void);
STRATA_EXPORT int strata_version_patch(void);

/* The level of strata's log on stderr: "trace", "debug", "info", "warn",
 * "error" or "off". */
STRATA_EXPORT strata_code_t strata_set_log_level(const char* level,
                                                 char** errptr);

/* ---- Devices ---------------------------------------------------------- */

/* A device. `choice`: "auto" (or NULL: CUDA when a GPU works, else the
 * host-emulated device; the environment variable STRATA_DEVICE may decide),
 * "cuda" or "cuda:N" (GPU N, or STRATA_UNAVAILABLE with the reason), "host"
 * (the host-emulated device, which stands in for a GPU with host memory).
 * `memory_budget_bytes`: what the device may hand out; 0 = automatic (the
 * free GPU memory less 1 GiB; 1 GiB for the host-emulated device). */
STRATA_EXPORT strata_code_t strata_device_create(const char* choice,
                                                 uint64_t memory_budget_bytes,
                                                 strata_device_t** out,
                                                 char** errptr);
/* STRATA_FAILED_PRECONDITION while streams, device memory or engines made
 * with it live. */
STRATA_EXPORT strata_code_t strata_device_destroy(strata_device_t* device,
                                                  char** errptr);
/* "host-emulated" or "cuda"; static storage. */
STRATA_EXPORT const char* strata_device_kind(const strata_device_t* device);
/* Human-readable identity, e.g. "cuda:0 (NVIDIA H100, sm_90)"; lives as long
 * as the device. */
STRATA_EXPORT const char* strata_device_name(const strata_device_t* device);

/* ---- Streams ---------------------------------------------------------- */

/* A new in-order queue of device work; its destroy waits for its work. */
STRATA_EXPORT strata_code_t strata_stream_create(strata_device_t* device,
                                                 strata_stream_t** out,
                                                 char** errptr);
/* A stream on a native queue made elsewhere, not owned: destroying it
 * neither waits for the queue nor destroys it. CUDA: a cudaStream_t of the
 * device's GPU (NULL: the legacy default stream), e.g. PyTorch's current
 * stream. Host-emulated: strata_stream_native_handle of a live stream of
 * the same device. REQUIRES: the native queue outlives the wrapper. */
STRATA_EXPORT strata_code_t strata_stream_wrap_native(strata_device_t* device,
                                                      void* native,
                                                      strata_stream_t** out,
                                                      char** errptr);
/* CUDA: the cudaStream_t. Host-emulated: an opaque handle that only
 * strata_stream_wrap_native of the same device accepts. */
STRATA_EXPORT void* strata_stream_native_handle(const strata_stream_t* stream);
/* Blocks until the work enqueued on `stream` so far is done. */
STRATA_EXPORT strata_code_t strata_stream_synchronize(strata_stream_t* stream,
                                                      char** errptr);
/* STRATA_FAILED_PRECONDITION while a pin that waited on it or device memory
 * allocated on it lives. */
STRATA_EXPORT strata_code_t strata_stream_destroy(strata_stream_t* stream,
                                                  char** errptr);

/* ---- Device memory ---------------------------------------------------- */

/* `bytes` of device memory (256-byte aligned) whose first user is `stream`,
 * from the device's budget (STRATA_OUT_OF_MEMORY saying what was free). */
STRATA_EXPORT strata_code_t
strata_device_memory_alloc(strata_stream_t* stream, size_t bytes,
                           strata_device_memory_t** out, char** errptr);
STRATA_EXPORT void* strata_device_memory_data(
    const strata_device_memory_t* memory);
STRATA_EXPORT size_t
strata_device_memory_size(const strata_device_memory_t* memory);
/* Frees in stream order: the block is reused only after the work enqueued
 * on its stream before this call is done. */
STRATA_EXPORT void strata_device_memory_free(strata_device_memory_t* memory);

/* Admits [data, data + bytes), device memory strata did not allocate (a
 * PyTorch tensor's storage; on the host-emulated device, host memory the
 * caller declares device memory), to the device's copies and to
 * strata_engine_add_grad. REQUIRES: the memory stays allocated while
 * registered and until work enqueued on it is done. */
STRATA_EXPORT strata_code_t strata_device_register_external(
    strata_device_t* device, void* data, size_t bytes,
    strata_external_memory_t** out, char** errptr);
STRATA_EXPORT void strata_external_memory_unregister(
    strata_external_memory_t* memory);

/* Enqueues a copy of `bytes` on `stream`. Device ends are device memory
 * (allocated or registered); host memory must stay valid until the copy is
 * done (strata_stream_synchronize). */
STRATA_EXPORT strata_code_t strata_copy_async(strata_stream_t* stream,
                                              void* dst, const void* src,
                                              size_t bytes,
                                              strata_copy_kind_t kind,
                                              char** errptr);

/* ---- Communicator ----------------------------------------------------- */

/* A data-parallel group of ranks for an engine (docs/c_api.md,
 * "Communicator"). `backend`: "single" (or NULL: one rank, no dependency)
 * or "mpi" (STRATA_UNAVAILABLE with the reason where MPI cannot be loaded).
 * `timeout_s`: seconds a collective may wait for the other ranks before it
 * fails with STRATA_UNAVAILABLE, in (0, 1e6]; 0 = the default, 300.
 * MPI only (ignored otherwise): `mpi_comm` NULL = MPI_COMM_WORLD (MPI is
 * initialized when the process has not done so), or a pointer to the
 * caller's communicator, an `MPI_Comm*`, read once during the call and
 * duplicated (the caller may free its own afterwards; MPI initialized by the
 * caller at MPI_THREAD_SERIALIZED or above); `mpi_library` NULL = strata's
 * MPI backend (libstrata_comm_mpi.so) beside the library, else its path.
 * Every rank must make this call. */
STRATA_EXPORT strata_code_t strata_comm_create(const char* backend,
                                               double timeout_s, void* mpi_comm,
                                               const char* mpi_library,
                                               strata_comm_t** out,
                                               char** errptr);
/* An NCCL communicator, for an engine whose collectives run on CUDA devices
 * (docs/c_api.md, "Communicator"). Either `nccl_comm`, the caller's
 * ncclComm_t (not owned, never destroyed by strata), with `ranks`, the
 * global ranks of its members in NCCL rank order (`num_ranks` entries, for
 * messages; NULL and 0: 0 .. size - 1); or `bootstrap`, a communicator of
 * the same ranks (MPI, or "single" for one rank) whose rank 0 makes the
 * NCCL id and broadcasts it (used during this call only). Not both.
 * `cuda_ordinal`: the GPU (>= 0). `timeout_s` as for strata_comm_create.
 * STRATA_UNAVAILABLE with the reason where NCCL or a GPU is missing. */
STRATA_EXPORT strata_code_t
strata_comm_create_nccl(void* nccl_comm, const int* ranks, size_t num_ranks,
                        strata_comm_t* bootstrap, int cuda_ordinal,
                        double timeout_s, strata_comm_t** out, char** errptr);
/* This rank (0 .. size - 1) and the number of ranks. */
STRATA_EXPORT int strata_comm_rank(const strata_comm_t* comm);
STRATA_EXPORT int strata_comm_size(const strata_comm_t* comm);
/* "single", "mpi" or "nccl"; static storage. */
STRATA_EXPORT const char* strata_comm_backend(const strata_comm_t* comm);
/* Drops the caller's share: options and engines given the communicator keep
 * it alive until they are destroyed too. */
STRATA_EXPORT void strata_comm_destroy(strata_comm_t* comm);

/* ---- Engine options --------------------------------------------------- */

/* Engine options from a JSON config: strata's keys under "strata" and a
 * DeepSpeed config as it is ("zero_optimization", "aio", "fp16", "bf16",
 * "optimizer", ...; docs/config.md). `json` holds `length` bytes (no NUL
 * needed). Strict: an unknown key, a wrong type or a value out of range is
 * STRATA_INVALID_ARGUMENT naming its JSON path; invalid JSON names its line
 * and column. */
STRATA_EXPORT strata_code_t
strata_engine_options_from_json(const char* json, size_t length,
                                strata_engine_options_t** out, char** errptr);
/* The same, from a file; errors name the file. */
STRATA_EXPORT strata_code_t strata_engine_options_from_file(
    const char* path, strata_engine_options_t** out, char** errptr);
/* "<json path>: <why>" for each key accepted but not acted on and each
 * coercion; the caller shows them. NULL past the end; lives as long as
 * `options`. */
STRATA_EXPORT size_t
strata_engine_options_num_warnings(const strata_engine_options_t* options);
STRATA_EXPORT const char* strata_engine_options_warning(
    const strata_engine_options_t* options, size_t index);
/* Gives engines created from `options` the communicator `comm` (NULL: none,
 * one rank), sharing its ownership: `comm` may be destroyed right after.
 * The config's world_size, rank and zero_stage stay as the JSON set them;
 * strata_engine_create checks them against the communicator (world_size
 * above 1 needs one whose size and rank are world_size and rank, and
 * zero_stage 1 or 2). Each engine needs a communicator of its own: nothing
 * else may run collectives on it while the engine lives. */
STRATA_EXPORT strata_code_t strata_engine_options_set_comm(
    strata_engine_options_t* options, strata_comm_t* comm, char** errptr);
STRATA_EXPORT void strata_engine_options_destroy(
    strata_engine_options_t* options);

/* ---- Engine ----------------------------------------------------------- */

/* An engine over `device` (which must outlive it) with a copy of `options`
 * (which may be destroyed at once). */
STRATA_EXPORT strata_code_t strata_engine_create(
    const strata_engine_options_t* options, strata_device_t* device,
    strata_engine_t** out, char** errptr);
/* Before start: a trainable parameter of `ndim` dimensions (each > 0) whose
 * working copy is `dtype` (STRATA_FLOAT16 or STRATA_BFLOAT16). `name` must
 * be unique. Writes its id, 0, 1, 2... in order of registration. */
STRATA_EXPORT strata_code_t strata_engine_register(
    strata_engine_t* engine, const char* name, const int64_t* shape,
    size_t ndim, strata_dtype_t dtype, uint32_t* id, char** errptr);
/* Lays the tensors out and reserves every tier (STRATA_OUT_OF_MEMORY or
 * STRATA_NO_SPACE saying what was asked and what is free). */
STRATA_EXPORT strata_code_t strata_engine_start(strata_engine_t* engine,
                                                char** errptr);
STRATA_EXPORT size_t strata_engine_num_tensors(const strata_engine_t* engine);
/* Elements of tensor `id`. */
STRATA_EXPORT strata_code_t strata_engine_tensor_numel(strata_engine_t* engine,
                                                       uint32_t id,
                                                       uint64_t* numel,
                                                       char** errptr);
/* After start, before the first step: `count` (= numel) fp32 values of
 * tensor `id`, written to its master and working copy. */
STRATA_EXPORT strata_code_t strata_engine_set_initial_values(
    strata_engine_t* engine, uint32_t id, const float* values, size_t count,
    char** errptr);
/* The fp32 master of tensor `id` into `out` (`count` = numel floats). */
STRATA_EXPORT strata_code_t strata_engine_read_master(strata_engine_t* engine,
                                                      uint32_t id, float* out,
                                                      size_t count,
                                                      char** errptr);

/* Fetches tensor `id` to the device and pins it there: returns at once with
 * a pin whose data may still be arriving (strata_param_pin_wait_on makes a
 * stream wait for it, strata_param_pin_wait the host). The device copy stays
 * put until strata_param_pin_release. */
STRATA_EXPORT strata_code_t strata_engine_fetch(strata_engine_t* engine,
                                                uint32_t id,
                                                strata_param_pin_t** out,
                                                char** errptr);
/* The device address of the working copy (valid while pinned), its bytes
 * and its type. */
STRATA_EXPORT void* strata_param_pin_data(const strata_param_pin_t* pin);
STRATA_EXPORT size_t strata_param_pin_bytes(const strata_param_pin_t* pin);
STRATA_EXPORT strata_dtype_t
strata_param_pin_dtype(const strata_param_pin_t* pin);
/* Blocks the host until the data is on the device. */
STRATA_EXPORT strata_code_t strata_param_pin_wait(strata_param_pin_t* pin,
                                                  char** errptr);
/* Work enqueued on `consumer` (a stream of the engine's device) after this
 * call runs once the data has arrived; that use lasts until the release.
 * Does not block the host where the device allows. */
STRATA_EXPORT strata_code_t strata_param_pin_wait_on(strata_param_pin_t* pin,
                                                     strata_stream_t* consumer,
                                                     char** errptr);
/* Drops the pin (the device copy may then be evicted). NULL is a no-op. */
STRATA_EXPORT void strata_param_pin_release(strata_param_pin_t* pin);

/* Hands over the gradient of tensor `id`: numel elements of `dtype` at
 * device address `grad` (device memory, allocated or registered),
 * multiplied by the loss scale, produced by the work enqueued on `producer`
 * so far. Copied to the host without blocking `producer` and accumulated in
 * fp32. REQUIRES: `grad` stays unchanged until strata_engine_wait_grads (or
 * a step) returns. */
STRATA_EXPORT strata_code_t strata_engine_add_grad(
    strata_engine_t* engine, uint32_t id, const void* grad,
    strata_dtype_t dtype, strata_stream_t* producer, char** errptr);
/* The same, taking `grad` over whatever the outcome: the engine frees it
 * in stream order once copied, so the caller may forget it at once. */
STRATA_EXPORT strata_code_t strata_engine_add_grad_owned(
    strata_engine_t* engine, uint32_t id, strata_device_memory_t* grad,
    strata_dtype_t dtype, strata_stream_t* producer, char** errptr);
/* Blocks until every gradient handed over has been accumulated. */
STRATA_EXPORT strata_code_t strata_engine_wait_grads(strata_engine_t* engine,
                                                     char** errptr);
/* Optional, before the backward of the step's last micro-batch, with the
 * arguments strata_engine_step will get (max_grad_norm 0: clipping needs
 * the whole gradient's norm first): the next gradient handed over for each
 * tensor is its last before the step, and the engine may update a unit,
 * or take its gradient's statistics, as soon as the last gradients of all
 * its tensors are in, while backward still runs; the step then does the
 * rest, to the same results (docs/memtier.md, "Updates during backward").
 * Until the step returns, a tensor whose last gradient was handed over can
 * be neither fetched nor given another (STRATA_FAILED_PRECONDITION): a
 * tensor used twice in one backward sums its gradients first. */
STRATA_EXPORT strata_code_t strata_engine_begin_step(strata_engine_t* engine,
                                                     double lr,
                                                     double loss_scale,
                                                     double max_grad_norm,
                                                     char** errptr);
/* One optimizer step over every tensor: the gradients are divided by
 * `loss_scale` (0: the engine's own, strata_engine_loss_scale; with the
 * config's loss scale static or dynamic any other value must equal it),
 * their global L2 norm clipped to `max_grad_norm` (0 = no clipping), and the
 * update runs at rate `lr`. A gradient with an inf or nan skips the step
 * (and moves a dynamic loss scale). Writes, where not NULL: whether it was
 * applied (1/0), the global norm of the unscaled gradient, and the steps
 * applied so far. */
STRATA_EXPORT strata_code_t strata_engine_step(strata_engine_t* engine,
                                               double lr, double loss_scale,
                                               double max_grad_norm,
                                               int* applied, double* grad_norm,
                                               int64_t* step, char** errptr);
/* The scale to multiply the next step's loss by: 1 without loss scaling,
 * else the config's static scale or the dynamic scale steps have moved. */
STRATA_EXPORT strata_code_t strata_engine_loss_scale(strata_engine_t* engine,
                                                     double* scale,
                                                     char** errptr);
/* The engine's counters as a JSON object (bytes and counts as integers,
 * seconds as numbers), NUL-terminated, in *json; free it with strata_free. */
STRATA_EXPORT strata_code_t strata_engine_stats_json(strata_engine_t* engine,
                                                     char** json,
                                                     char** errptr);
/* Saves the engine's state, between steps, as checkpoint `step` (>= 0,
 * named "step-<N>") of the checkpoint directory `dir` (created if missing;
 * one writer at a time, STRATA_BUSY naming the other's pid): every tensor's
 * fp32 master and optimizer moments, the step count and loss scale, and
 * with `save_params` nonzero the working copy too (gradients handed over
 * since the last step are not saved). Then publishes it as the
 * directory's latest and prunes to `keep` complete checkpoints (0: 2).
 * Nothing is published on failure (STRATA_ALREADY_EXISTS when the latest is
 * already "step-<N>"). Writes the committed checkpoint's path, where `path`
 * is not NULL, as a string the caller frees with strata_free. With several
 * ranks a collective: every rank calls it with the same arguments, rank 0
 * alone writes (`dir` is rank 0's), and every rank gets the same outcome and
 * path (an error names the rank it came from). */
STRATA_EXPORT strata_code_t strata_engine_save_checkpoint(
    strata_engine_t* engine, const char* dir, int64_t step, int keep,
    int save_params, char** path, char** errptr);
/* After start, between steps: replaces the engine's state with checkpoint
 * `path`: a "step-<N>" directory, or a checkpoint directory, whose latest is
 * loaded: masters, moments, working copy (or the master rounded), step
 * count and a dynamic loss scale. Every registered tensor must be in it with
 * the same shape (STRATA_NOT_FOUND or STRATA_INVALID_ARGUMENT naming it);
 * any partition layout, tier placement or world size loads, except int8
 * moments, which need the saving layout. No pin held and no gradient handed
 * over since the last step. The checkpoint is checked as it is opened and
 * read (STRATA_CORRUPTION or STRATA_NOT_FOUND naming the file); a read that
 * fails part-way leaves the engine refusing later calls. Writes the loaded
 * checkpoint's path, where `loaded` is not NULL (strata_free). With several
 * ranks a collective: every rank opens the same checkpoint and reads its own
 * shard; a failure on one rank is every rank's. */
STRATA_EXPORT strata_code_t strata_engine_load_checkpoint(
    strata_engine_t* engine, const char* path, char** loaded, char** errptr);
/* STRATA_FAILED_PRECONDITION while pins of it are held. */
STRATA_EXPORT strata_code_t strata_engine_destroy(strata_engine_t* engine,
                                                  char** errptr);

/* ---- CPU optimizer on caller memory ------------------------------------ */

typedef enum strata_cpu_algo {
  STRATA_CPU_ADAM = 0,    /* torch.optim.Adam: L2 decay added to the grad */
  STRATA_CPU_ADAMW = 1,   /* torch.optim.AdamW: decoupled weight decay */
  STRATA_CPU_ADAGRAD = 2, /* torch.optim.Adagrad (lr_decay 0) */
  STRATA_CPU_LION = 3,    /* Lion, decoupled weight decay */
  /* Adafactor (Shazeer & Stern 2018) as HF transformers' Adafactor: second
   * moment factored into one statistic per row and per column of a matrix
   * (strata_cpu_optimizer_step_shaped gives the shape). */
  STRATA_CPU_ADAFACTOR = 4,
  /* SM3-II (Anil et al. 2019), the rows and the columns of a matrix as
   * cover sets; momentum beta1 (0 = none). */
  STRATA_CPU_SM3 = 5
} strata_cpu_algo_t;

typedef enum strata_cpu_variant {
  STRATA_CPU_VARIANT_AUTO = 0, /* the best the CPU supports */
  STRATA_CPU_VARIANT_SCALAR = 1,
  STRATA_CPU_VARIANT_AVX2 = 2,
  STRATA_CPU_VARIANT_AVX512 = 3,
  STRATA_CPU_VARIANT_AVX512BF16 = 4
} strata_cpu_variant_t;

/* Options with strata's defaults: AdamW, betas (0.9, 0.999), eps 1e-8,
 * weight decay 0, bias correction on, the best variant, all cores. The
 * setters store; strata_cpu_optimizer_create checks the values. */
STRATA_EXPORT strata_code_t strata_cpu_optimizer_options_create(
    strata_cpu_optimizer_options_t** out, char** errptr);
STRATA_EXPORT void strata_cpu_optimizer_options_destroy(
    strata_cpu_optimizer_options_t* options);
STRATA_EXPORT void strata_cpu_optimizer_options_set_algo(
    strata_cpu_optimizer_options_t* options, strata_cpu_algo_t algo);
/* The algorithm by name: "adam", "adamw", "adagrad", "lion", "adafactor"
 * or "sm3", in any case; STRATA_INVALID_ARGUMENT naming the accepted names
 * otherwise (the options are left as they were). */
STRATA_EXPORT strata_code_t strata_cpu_optimizer_options_set_algo_name(
    strata_cpu_optimizer_options_t* options, const char* name, char** errptr);
/* Sets the algorithm and its hyper-parameters from an optimizer section as
 * DeepSpeed writes it: `length` bytes of JSON (no NUL needed) such as
 * {"type": "Adafactor", "params": {"lr": null, "scale_parameter": true}}.
 * The type and params accepted are cpu_adam's (docs/cpu_adam.md, "Selection
 * by name"); what the section leaves out keeps the values `options` holds
 * (variant, threads included). *lr (NULL: not written) receives the
 * section's learning rate. STRATA_INVALID_ARGUMENT names the JSON path at
 * fault; the options are then left as they were. */
STRATA_EXPORT strata_code_t strata_cpu_optimizer_options_from_json(
    strata_cpu_optimizer_options_t* options, const char* json, size_t length,
    double* lr, char** errptr);
/* Adam/AdamW: moment decay rates, each in [0, 1). Lion: interpolation and
 * momentum decay. SM3: beta1 is the momentum (0 = none), beta2 unused. */
STRATA_EXPORT void strata_cpu_optimizer_options_set_betas(
    strata_cpu_optimizer_options_t* options, double beta1, double beta2);
STRATA_EXPORT void strata_cpu_optimizer_options_set_eps(
    strata_cpu_optimizer_options_t* options, double eps);
STRATA_EXPORT void strata_cpu_optimizer_options_set_weight_decay(
    strata_cpu_optimizer_options_t* options, double weight_decay);
/* Nonzero: divide by (1 - beta^step), as torch does. */
STRATA_EXPORT void strata_cpu_optimizer_options_set_bias_correction(
    strata_cpu_optimizer_options_t* options, int bias_correction);
STRATA_EXPORT void strata_cpu_optimizer_options_set_variant(
    strata_cpu_optimizer_options_t* options, strata_cpu_variant_t variant);
/* Worker threads including the caller's; 0 = all cores the process may
 * use. */
STRATA_EXPORT void strata_cpu_optimizer_options_set_threads(
    strata_cpu_optimizer_options_t* options, int threads);
/* BLOCK8 moments: the update's sweeps over each block, 1 (the codecs, the
 * moments and the weights together) or 2 (the weights after the codecs and
 * the moments), the same results either way; 0 (the default) = the
 * variant's own (2 on AVX2, 1 elsewhere). */
STRATA_EXPORT void strata_cpu_optimizer_options_set_block8_sweeps(
    strata_cpu_optimizer_options_t* options, int sweeps);
/* Adafactor's hyper-parameters, with HF transformers' names and defaults.
 * eps1 (1e-30) is added to g^2 before the statistics, eps2 (1e-3) bounds
 * the parameter scale from below; both >= 0. */
STRATA_EXPORT void strata_cpu_optimizer_options_set_adafactor_eps(
    strata_cpu_optimizer_options_t* options, double eps1, double eps2);
/* d (1.0, > 0): the update is divided by max(1, RMS(update) / d). */
STRATA_EXPORT void strata_cpu_optimizer_options_set_adafactor_clip_threshold(
    strata_cpu_optimizer_options_t* options, double clip_threshold);
/* beta2_t = 1 - step^decay_rate (-0.8, in [-1, 0)). */
STRATA_EXPORT void strata_cpu_optimizer_options_set_adafactor_decay_rate(
    strata_cpu_optimizer_options_t* options, double decay_rate);
/* First-moment decay in [0, 1); 0 (the default) = no first moment, and
 * exp_avg is unused. */
STRATA_EXPORT void strata_cpu_optimizer_options_set_adafactor_beta1(
    strata_cpu_optimizer_options_t* options, double beta1);
/* Nonzero relative_step (default 1): lr = min(1e-2, 1 / sqrt(step)), the
 * step's lr ignored (warmup_init, default 0: min(1e-6 step, 1 /
 * sqrt(step))). Nonzero scale_parameter (default 1): lr is multiplied by
 * max(eps2, RMS(master before the step)). */
STRATA_EXPORT void strata_cpu_optimizer_options_set_adafactor_schedule(
    strata_cpu_optimizer_options_t* options, int relative_step,
    int scale_parameter, int warmup_init);

/* An optimizer with its own thread arena; NULL options = the defaults.
 * STRATA_INVALID_ARGUMENT for out-of-range values, STRATA_NOT_SUPPORTED for
 * a variant this CPU lacks. */
STRATA_EXPORT strata_code_t
strata_cpu_optimizer_create(const strata_cpu_optimizer_options_t* options,
                            strata_cpu_optimizer_t** out, char** errptr);
STRATA_EXPORT void strata_cpu_optimizer_destroy(
    strata_cpu_optimizer_t* optimizer);
/* The kernel variant chosen ("scalar", "avx2", ...; static storage) and the
 * threads used. */
STRATA_EXPORT const char* strata_cpu_optimizer_variant(
    const strata_cpu_optimizer_t* optimizer);
STRATA_EXPORT int strata_cpu_optimizer_threads(
    const strata_cpu_optimizer_t* optimizer);

/* The arrays of one update, all of `n` elements, the caller's, naturally
 * aligned for their types and not overlapping. New fields never go into
 * this struct: a later version adds a new struct and call. */
typedef struct strata_cpu_tensors {
  size_t n;
  float* master; /* fp32 master weights, updated in place */
  const void* grad;
  strata_dtype_t grad_dtype; /* FLOAT32, FLOAT16 or BFLOAT16 */
  /* Adam/AdamW: first and second moment; Adagrad: exp_avg_sq is the sum
   * of squares (exp_avg may be NULL); Lion: exp_avg only. Zeroed by the
   * caller before step 1; strata_cpu_state_bytes(moment_dtype, n) each.
   * Adafactor and SM3: exp_avg the first moment / momentum (NULL when
   * beta1 is 0), exp_avg_sq the fp32 row and column statistics; their
   * sizes are strata_cpu_step_footprint_of's. */
  void* exp_avg;
  void* exp_avg_sq;
  /* FLOAT32, BFLOAT16 or BLOCK8 (Adam, AdamW, Lion); Adafactor and SM3:
   * exp_avg's, FLOAT32 or BFLOAT16 */
  strata_dtype_t moment_dtype;
  /* Optional (NULL: not written): the updated master rounded to
   * working_dtype (FLOAT16 or BFLOAT16), written in the same pass. */
  void* working;
  strata_dtype_t working_dtype;
} strata_cpu_tensors_t;

/* One fused update of `t`: the gradient multiplied by inv_loss_scale *
 * clip_coef, then the algorithm at rate `lr` for 1-based step `step` (bias
 * correction). With `check_overflow` nonzero, a scaled gradient holding an
 * inf or nan writes nothing and sets *applied to 0 (not an error). */
STRATA_EXPORT strata_code_t strata_cpu_optimizer_step(
    strata_cpu_optimizer_t* optimizer, const strata_cpu_tensors_t* t,
    int64_t step, double lr, double inv_loss_scale, double clip_coef,
    int check_overflow, int* applied, char** errptr);
/* The sum of squares of grad * scale (in double) and whether every element
 * is finite (1/0), over `n` elements of `dtype`. Either output may be
 * NULL. */
STRATA_EXPORT strata_code_t strata_cpu_optimizer_grad_stats(
    strata_cpu_optimizer_t* optimizer, const void* grad, strata_dtype_t dtype,
    size_t n, double scale, double* sum_sq, int* finite, char** errptr);

/* The per-step values of strata_cpu_optimizer_step_shaped. New fields
 * never go into this struct (nor into the two below): a later version adds
 * a new struct and call. */
typedef struct strata_cpu_step_args {
  int64_t step; /* 1-based; a skipped step does not count */
  double lr;    /* >= 0; Adafactor with relative_step ignores it */
  /* The gradient is multiplied by inv_loss_scale * clip_coef; finite, > 0 */
  double inv_loss_scale;
  double clip_coef;
  /* Nonzero: a scaled gradient holding an inf or nan writes nothing and
   * the result's `applied` is 0 (not an error). */
  int check_overflow;
  /* Adafactor with scale_parameter: the sum of the squares of master as it
   * is now, the param_sq of the result of the step that last wrote it; the
   * statistics pass then does not read master (4 bytes a parameter fewer).
   * Negative: not known (the step sums it). Only while nothing else has
   * written master since that step; the other algorithms ignore it. */
  double param_sq;
} strata_cpu_step_args_t;

/* Step 1, lr 1e-3, scales 1, check_overflow 1, param_sq -1. */
STRATA_EXPORT strata_cpu_step_args_t strata_cpu_step_args_default(void);

/* What one strata_cpu_optimizer_step_shaped did. */
typedef struct strata_cpu_step_result {
  int applied; /* 0: an inf or nan, nothing written */
  /* Adafactor with scale_parameter, applied: the sum of the squares of the
   * updated master, for the next step's args.param_sq; negative otherwise
   * (a step not applied left master as it was). */
  double param_sq;
  /* Wall seconds of the inf/nan check (0 when not run) and of each pass
   * over the arrays, in order: `passes` of them (Adafactor: statistics,
   * then the update, with the RMS of the update between them on rows of
   * more than 32768 columns; the others one). */
  double check_seconds;
  int passes;
  double pass_seconds[3];
} strata_cpu_step_result_t;

/* One fused update of `t` as a row-major rows x cols matrix (rows * cols ==
 * n; rows 0: a vector). Adafactor and SM3 keep one statistic per row and
 * per column of it; the other algorithms ignore the shape and update as
 * strata_cpu_optimizer_step does. `result` may be NULL. */
STRATA_EXPORT strata_code_t strata_cpu_optimizer_step_shaped(
    strata_cpu_optimizer_t* optimizer, const strata_cpu_tensors_t* t,
    size_t rows, size_t cols, const strata_cpu_step_args_t* args,
    strata_cpu_step_result_t* result, char** errptr);

/* A step's shape and element types, for strata_cpu_step_footprint_of. */
typedef struct strata_cpu_step_shape {
  size_t n;
  size_t rows; /* as strata_cpu_optimizer_step_shaped */
  size_t cols;
  strata_dtype_t grad_dtype;
  strata_dtype_t moment_dtype;
  int has_working; /* nonzero: a working copy is written */
  strata_dtype_t working_dtype;
  int param_sq_known; /* nonzero: args.param_sq is given (Adafactor) */
} strata_cpu_step_shape_t;

typedef struct strata_cpu_step_footprint {
  /* Bytes of the caller's state arrays (0: unused, may be NULL). */
  size_t exp_avg_bytes;
  size_t exp_avg_sq_bytes;
  /* Bytes one step reads and writes with check_overflow off (on adds one
   * read of the gradient), over all its passes: master, gradient, state,
   * working copy. The optimizer's O(rows + cols) scratch is not counted. */
  uint64_t read_bytes;
  uint64_t written_bytes;
  int passes; /* passes over the gradient */
} strata_cpu_step_footprint_t;

/* What one step of `options` (NULL: the defaults) over `shape` needs and
 * moves. STRATA_INVALID_ARGUMENT for a shape that does not match n, or a
 * moment dtype the algorithm refuses. */
STRATA_EXPORT strata_code_t
strata_cpu_step_footprint_of(const strata_cpu_optimizer_options_t* options,
                             const strata_cpu_step_shape_t* shape,
                             strata_cpu_step_footprint_t* out, char** errptr);

/* Bytes of one optimizer-state array of `n` elements of `dtype`; 0 for a
 * value outside the enum. */
STRATA_EXPORT size_t strata_cpu_state_bytes(strata_dtype_t dtype, size_t n);
/* Converts `n` elements between FLOAT32, FLOAT16 and BFLOAT16 on the calling
 * thread (round to nearest even). */
STRATA_EXPORT strata_code_t strata_convert(const void* src,
                                           strata_dtype_t src_dtype, void* dst,
                                           strata_dtype_t dst_dtype, size_t n,
                                           char** errptr);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_C_H_ */
