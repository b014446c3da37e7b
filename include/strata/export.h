// Symbol visibility for the public API. The library is built with hidden
// visibility; only declarations marked STRATA_EXPORT are part of its ABI.
#ifndef STRATA_EXPORT_H_
#define STRATA_EXPORT_H_

#ifdef __cplusplus
#define STRATA_EXPORT [[gnu::visibility("default")]]
#else
#define STRATA_EXPORT __attribute__((visibility("default")))
#endif

#endif  // STRATA_EXPORT_H_
