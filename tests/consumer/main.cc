// Links against the installed strata and exercises a public API per module.
#include <strata/host_buffer.h>
#include <strata/io_engine.h>
#include <strata/status.h>
#include <strata/version.h>

#include <cstdio>
#include <cstring>

int main() {
  if (std::strcmp(strata_version(), STRATA_VERSION_STRING) != 0) {
    std::fprintf(stderr, "version mismatch: %s vs %s\n", strata_version(),
                 STRATA_VERSION_STRING);
    return 1;
  }
  auto buf = strata::HostBuffer::Allocate(1 << 20);
  if (!buf.ok() || buf->size() != (1u << 20)) {
    std::fprintf(stderr, "HostBuffer: %s\n", buf.status().ToString().c_str());
    return 1;
  }
  std::memset(buf->data(), 0x5a, buf->size());
  strata::Status s = strata::Status::FromErrno(28, "write swap");
  if (s.code() != strata::StatusCode::kNoSpace) return 1;
  strata::IoEngineOptions io;
  io.backend = strata::IoBackend::kMemory;
  auto engine = strata::NewIoEngine(io);
  if (!engine.ok()) return 1;
  auto file = (*engine)->Open("consumer.dat", {.create = true});
  if (!file.ok() || !(*engine)->WriteAt(*file, 0, buf->span()).ok()) return 1;
  auto back = strata::HostBuffer::Allocate(buf->size());
  if (!back.ok() || !(*engine)->ReadAt(*file, 0, back->span()).ok() ||
      std::memcmp(back->data(), buf->data(), buf->size()) != 0) {
    std::fprintf(stderr, "io engine round trip failed\n");
    return 1;
  }
  std::printf("consumer ok: strata %s\n", strata_version());
  return 0;
}
