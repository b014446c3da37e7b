// strata-bench: benchmarks of strata's bandwidth tiers. See docs/bench.md.
#include <cstdio>
#include <string_view>

#include "bench/bench.h"
#include "strata/log.h"

namespace {
void Usage() {
  std::printf("usage: strata-bench <command> [options]\n\ncommands:\n");
  for (const auto& c : strata::bench::Commands()) {
    std::printf("  %-8s %s\n", c.name, c.summary);
  }
  std::printf("\n`strata-bench <command> --help` lists a command's options.\n");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    Usage();
    return 2;
  }
  const std::string_view cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    Usage();
    return 0;
  }
  if (cmd == "--version") {
    std::printf("strata-bench %s\n", std::string(strata::Version()).c_str());
    return 0;
  }
  for (const auto& c : strata::bench::Commands()) {
    if (cmd == c.name) return c.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "strata-bench: unknown command '%s'\n", argv[1]);
  Usage();
  return 2;
}
