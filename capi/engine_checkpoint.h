// Saving and loading an engine's checkpoint over its ranks, as the C API
// (strata_engine_save_checkpoint, strata_engine_load_checkpoint) and the
// Python binding (strata.Engine.save_checkpoint, load_checkpoint) both do
// it. Header-only over the public C++ API (include/strata/engine.h,
// include/strata/checkpoint.h), so that each wrapper compiles it in and
// libstrata exports nothing more.
#ifndef STRATA_CAPI_ENGINE_CHECKPOINT_H_
#define STRATA_CAPI_ENGINE_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "strata/checkpoint.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::wrap {

// Checkpoint `step` of `dir`, with the working copy when `params`; `keep`
// complete checkpoints kept after the commit (0: CheckpointWriterOptions'
// default). A collective with several ranks: every rank calls it between
// steps with the same arguments; `rank` is the engine's EngineOptions::rank,
// and rank 0 alone writes (include/strata/engine.h, "Several ranks").
// Returns the committed checkpoint's path on every rank. `call` names the
// caller in messages.
inline StatusOr<std::string> SaveEngineCheckpoint(Engine& engine, int rank,
                                                  std::string_view call,
                                                  const std::string& dir,
                                                  int64_t step, int keep,
                                                  bool params) {
  // Refusals that every rank makes alike come before any collective.
  if (step < 0) {
    return Status::InvalidArgument(std::string(call) + ": step " +
                                   std::to_string(step) +
                                   " is negative; accepted: >= 0");
  }
  if (keep < 0) {
    return Status::InvalidArgument(
        std::string(call) + ": keep " + std::to_string(keep) +
        " is negative; accepted: 0 (the default, 2) or >= 1");
  }
  // Rank 0 alone writes; every rank agrees on its Begin's outcome, so that a
  // failure there is every rank's before the collective save.
  std::unique_ptr<CheckpointWriter> writer;
  Status begun;
  if (rank == 0) {
    CheckpointWriterOptions o;
    o.dir = dir;
    o.step = step;
    if (keep > 0) o.keep = keep;
    StatusOr<std::unique_ptr<CheckpointWriter>> w = CheckpointWriter::Begin(o);
    if (w.ok()) {
      writer = std::move(w).value();
    } else {
      begun = std::move(w).status().WithContext(std::string(call) + ": " + dir);
    }
  }
  STRATA_RETURN_IF_ERROR(engine.Agree(begun));
  STRATA_RETURN_IF_ERROR(engine.SaveState(writer.get(), params));
  return engine.CommitState(writer.get());
}

// Replaces the engine's state with the checkpoint at `path` (a checkpoint,
// or a directory of them: its latest). A collective with several ranks:
// every rank opens it, and one that cannot makes the load fail on all.
// Returns the path of the checkpoint loaded.
inline StatusOr<std::string> LoadEngineCheckpoint(Engine& engine,
                                                  std::string_view call,
                                                  const std::string& path) {
  std::unique_ptr<CheckpointReader> reader;
  StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(path);
  Status opened;
  if (r.ok()) {
    reader = std::move(r).value();
  } else {
    opened = std::move(r).status().WithContext(std::string(call) + ": " + path);
  }
  STRATA_RETURN_IF_ERROR(engine.Agree(opened));
  STRATA_RETURN_IF_ERROR(engine.LoadState(*reader));
  return reader->path();
}

}  // namespace strata::wrap

#endif  // STRATA_CAPI_ENGINE_CHECKPOINT_H_
