// Backend-independent parts of strata/device.h: names, defaults, and the
// choice of a device (NewDevice).
#include <cstdlib>
#include <string>

#include "strata/device.h"
#include "util/log.h"

namespace strata {

std::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kHostEmulated:
      return "host-emulated";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

size_t ElementSize(ElementType type) {
  return type == ElementType::kFloat32 ? 4 : 2;
}

std::string_view ElementTypeName(ElementType type) {
  switch (type) {
    case ElementType::kFloat32:
      return "float32";
    case ElementType::kFloat16:
      return "float16";
    case ElementType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

std::string_view CopyKindName(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return "h2d";
    case CopyKind::kDeviceToHost:
      return "d2h";
    case CopyKind::kDeviceToDevice:
      return "d2d";
  }
  return "unknown";
}

Stream::~Stream() = default;
Event::~Event() = default;
Device::~Device() = default;

StatusOr<HostBuffer> Device::AllocatePinnedHost(
    size_t bytes, const HostBufferOptions& options) {
  STRATA_ASSIGN_OR_RETURN(HostBuffer buf, HostBuffer::Allocate(bytes, options));
  STRATA_RETURN_IF_ERROR(RegisterHostBuffer(buf));
  return buf;
}

Status Device::GemmAsync(Stream&, const GemmArgs&) {
  return Status::NotSupported(name() + " has no GEMM");
}

Status Device::LaunchHostWork(Stream&, HostFunction) {
  return Status::NotSupported(name() + " has no stream-ordered host work");
}

namespace {

StatusOr<DeviceChoice> ChoiceFromEnvironment(DeviceChoice fallback) {
  const char* env = std::getenv("STRATA_DEVICE");
  if (env == nullptr || *env == '\0') return fallback;
  const std::string v(env);
  if (v == "auto") return DeviceChoice::kAuto;
  if (v == "cuda" || v == "gpu") return DeviceChoice::kCuda;
  if (v == "host") return DeviceChoice::kHostEmulated;
  return Status::InvalidArgument("STRATA_DEVICE='" + v +
                                 "': expected auto, cuda or host");
}

}  // namespace

StatusOr<std::unique_ptr<Device>> NewDevice(const DeviceOptions& options,
                                            std::string* why) {
  DeviceChoice choice = options.choice;
  std::string source = "DeviceOptions::choice";
  if (choice == DeviceChoice::kAuto) {
    STRATA_ASSIGN_OR_RETURN(choice, ChoiceFromEnvironment(choice));
    if (const char* env = std::getenv("STRATA_DEVICE"); env && *env) {
      source = "STRATA_DEVICE=" + std::string(env);
    }
  } else if (const char* env = std::getenv("STRATA_DEVICE"); env && *env) {
    STRATA_LOG_ONCE(INFO, "STRATA_DEVICE={} ignored: {} was chosen in code",
                    env, choice == DeviceChoice::kCuda ? "cuda" : "host");
  }

  std::string reason;
  StatusOr<std::unique_ptr<Device>> device = Status::Internal("unset");
  switch (choice) {
    case DeviceChoice::kHostEmulated:
      device = NewHostEmulatedDevice(options);
      reason = "host-emulated device, as " + source + " asks";
      break;
    case DeviceChoice::kCuda:
      device = NewCudaDevice(options);
      if (!device.ok()) {
        return std::move(device).status().WithContext(source +
                                                      " asks for CUDA");
      }
      reason = (*device)->name() + ", as " + source + " asks";
      break;
    case DeviceChoice::kAuto: {
      device = NewCudaDevice(options);
      if (device.ok()) {
        reason = (*device)->name() + ": a CUDA device works (" + source +
                 " is auto)";
        break;
      }
      if (device.status().code() != StatusCode::kUnavailable) {
        // A GPU is there but failed (e.g. its budget does not fit): say so
        // instead of silently running on the host.
        return std::move(device).status();
      }
      reason = "host-emulated device, because CUDA is unavailable: " +
               std::string(device.status().message());
      device = NewHostEmulatedDevice(options);
      break;
    }
  }
  if (!device.ok()) return device;
  STRATA_LOG_ONCE(INFO, "device: {}", reason);
  if (why != nullptr) *why = std::move(reason);
  return device;
}

}  // namespace strata
