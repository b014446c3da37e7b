// Clang thread-safety annotations. They let the compiler
// check, with -Wthread-safety, that shared state is touched only with its
// lock held; the build turns the warning on whenever the C++ compiler is clang
// (docs/architecture.md, "Thread safety"). Other compilers see nothing.
//
// Reference: https://clang.llvm.org/docs/ThreadSafetyAnalysis.html. The
// names follow that page's mutex.h, with a STRATA_ prefix, as in leveldb's
// port/thread_annotations.h and abseil's thread_annotations.h.
//
// The lock type itself is strata::Mutex (util/mutex.h); std::mutex carries no
// annotations, so state guarded by one is not checked.
#ifndef STRATA_UTIL_THREAD_ANNOTATIONS_H_
#define STRATA_UTIL_THREAD_ANNOTATIONS_H_

#if defined(__clang__)
#define STRATA_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define STRATA_THREAD_ANNOTATION_(x)
#endif

// On a data member: read and written only with `x` held.
#define STRATA_GUARDED_BY(x) STRATA_THREAD_ANNOTATION_(guarded_by(x))

// On a pointer member: the pointee is read and written only with `x` held
// (the pointer itself is not guarded).
#define STRATA_PT_GUARDED_BY(x) STRATA_THREAD_ANNOTATION_(pt_guarded_by(x))

// On a function: the caller must hold these capabilities (exclusively).
// Private helpers named ...Locked carry it.
#define STRATA_REQUIRES(...) \
  STRATA_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))

// On a function: the caller must not hold these capabilities, because the
// function acquires them (the mutexes are not reentrant).
#define STRATA_EXCLUDES(...) \
  STRATA_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))

// On a function: it acquires / releases these capabilities (none named: the
// object itself, for a capability class's own Lock and Unlock).
#define STRATA_ACQUIRE(...) \
  STRATA_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define STRATA_RELEASE(...) \
  STRATA_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))

// On a function: it acquires the capabilities when it returns the first
// argument (e.g. true), and not otherwise.
#define STRATA_TRY_ACQUIRE(...) \
  STRATA_THREAD_ANNOTATION_(try_acquire_capability(__VA_ARGS__))

// On a function: it asserts that the capability is held (at run time where
// it can), and the analysis takes it as held afterwards.
#define STRATA_ASSERT_CAPABILITY(x) \
  STRATA_THREAD_ANNOTATION_(assert_capability(x))

// On a function: it returns a reference to capability `x` (an accessor).
#define STRATA_RETURN_CAPABILITY(x) STRATA_THREAD_ANNOTATION_(lock_returned(x))

// On a class: its objects are capabilities (locks); `x` names the kind in
// diagnostics, e.g. "mutex".
#define STRATA_CAPABILITY(x) STRATA_THREAD_ANNOTATION_(capability(x))

// On a class: an RAII object that holds a capability from its constructor
// to its destructor.
#define STRATA_SCOPED_CAPABILITY STRATA_THREAD_ANNOTATION_(scoped_lockable)

// On a function: the analysis skips its body. Last resort, for locking the
// analysis cannot follow; say why next to each use.
#define STRATA_NO_THREAD_SAFETY_ANALYSIS \
  STRATA_THREAD_ANNOTATION_(no_thread_safety_analysis)

#endif  // STRATA_UTIL_THREAD_ANNOTATIONS_H_
