// The engine options of the small-model engine tests (single- and
// multi-rank): 64 KiB partitions, staging buffers and I/O blocks, one
// optimizer thread, every unit evictable.
#ifndef STRATA_TESTS_MEMTIER_SMALL_ENGINE_OPTIONS_H_
#define STRATA_TESTS_MEMTIER_SMALL_ENGINE_OPTIONS_H_

#include "strata/engine.h"

namespace strata::testing {

inline EngineOptions SmallEngineOptions() {
  EngineOptions o;
  o.partition_bytes = 64 << 10;  // 16 Ki fp32: pack limit 4 Ki elements
  o.staging_buffer_bytes = 64 << 10;
  o.io_block_bytes = 64 << 10;
  o.io.queue_depth = 4;
  o.optimizer.cpu.threads = 1;
  o.optimizer.cpu.weight_decay = 0.01;
  o.persistence_threshold_bytes = 0;  // every unit may be evicted
  return o;
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_MEMTIER_SMALL_ENGINE_OPTIONS_H_
