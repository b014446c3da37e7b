// Happens-before edges that ThreadSanitizer cannot see on its own: the
// distribution's libtbb is not built with TSan, so the fork and join inside
// a oneTBB parallel algorithm are invisible to it, and every access of the
// caller's data by a worker looks like a race. Code that forks on oneTBB
// releases an address before handing out work and acquires it in each
// piece of work, and the reverse for the join (cpu_adam/cpu_adam.cc, Note
// [TSan and oneTBB]). Other builds see nothing.
#ifndef STRATA_UTIL_TSAN_ANNOTATIONS_H_
#define STRATA_UTIL_TSAN_ANNOTATIONS_H_

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define STRATA_TSAN_ACQUIRE(addr) __tsan_acquire(addr)
#define STRATA_TSAN_RELEASE(addr) __tsan_release(addr)
#else
#define STRATA_TSAN_ACQUIRE(addr) static_cast<void>(addr)
#define STRATA_TSAN_RELEASE(addr) static_cast<void>(addr)
#endif

#endif  // STRATA_UTIL_TSAN_ANNOTATIONS_H_
