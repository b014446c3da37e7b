// ThreadSanitizer suppressions for this test binary (read by the TSan
// runtime through __tsan_default_suppressions; unused in other builds).
// The distribution's libtbb is not instrumented, so TSan misses the
// synchronization inside it and flags oneTBB's own inline header code
// (task and range bookkeeping written by the spawning thread and read by the
// stealing one). Each entry names a oneTBB function that is never on the
// stack of strata's kernels (start_for's constructor is named; its execute
// and run_body, which are on that stack, are not), so a race in strata's own
// code is still reported. strata's
// own fork/join edges are annotated in cpu_adam.cc (Note [TSan and oneTBB]).
extern "C" const char* __tsan_default_suppressions() {
  // Inlined frames are symbolized by their short names, hence both forms;
  // ^...$ anchors keep a short name from matching inside a longer one.
  return "race:^affinity_slot$\n"
         "race:^is_same_affinity$\n"
         "race:^finalize$\n"
         "race:^start_for$\n"
         "race:^task$\n"
         // run_body reads the body and range the spawning thread built; the
         // kernels it calls live in their own per-ISA translation units, so
         // they are never inlined here and their accesses keep their frames.
         "race:^run_body$\n"
         "race:tbb::detail::d1::start_for<*>::run_body\n"
         "race:tbb::detail::d1::blocked_range<*>::size\n"
         "race:tbb::detail::d1::blocked_range<*>::is_divisible\n"
         "race:tbb::detail::d1::task::task\n"
         "race:tbb::detail::d1::proportional_mode<*>::is_divisible\n"
         "race:tbb::detail::d1::affinity_slot\n"
         // Work splitting (offer_work), its tree nodes and their small-object
         // pool, inlined from oneTBB's headers (the model's kernels).
         "race:^offer_work$\n"
         "race:^offer_work_impl$\n"
         "race:tbb::detail::d1::start_for<*>::offer_work\n"
         "race:tbb::detail::d1::start_for<*>::offer_work_impl\n"
         "race:tbb::detail::d1::small_object_allocator::new_object\n"
         "race:tbb::detail::d1::tree_node\n"
         "race:tbb::detail::d1::fold_tree\n";
}
