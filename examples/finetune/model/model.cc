#include "examples/finetune/model/model.h"

#include <array>
#include <numeric>
#include <string>
#include <utility>

#include "examples/finetune/model/gpu_kernels.h"

namespace finetune {

using strata::ElementType;
using strata::GemmArgs;
using strata::GemmOp;
using strata::Status;
using strata::StatusOr;

struct GptModel::Acts {
  void* ln1 = nullptr;  // [N, C] working type
  float* ln1_mean = nullptr;
  float* ln1_rstd = nullptr;
  float* qkv = nullptr;  // [N, 3C]
  float* att = nullptr;  // [B, NH, T, T]
  void* atty = nullptr;  // [N, C] working type
  float* x2 = nullptr;   // [N, C] residual after attention
  void* ln2 = nullptr;   // [N, C] working type
  float* ln2_mean = nullptr;
  float* ln2_rstd = nullptr;
  float* fch = nullptr;      // [N, 4C] before GELU
  void* fch_gelu = nullptr;  // [N, 4C] working type
};

namespace {

// The bytes of each field of one block's Acts, in its order: what Allocate
// gives each and what BlockActivationBytes adds up.
std::array<size_t, 12> ActBytes(const GptConfig& config,
                                const ModelOptions& options) {
  const size_t N = size_t(options.batch_size) * options.seq_len;
  const size_t C = config.n_embd;
  const size_t w = strata::ElementSize(options.param_type);
  const size_t f = sizeof(float);
  const size_t att = size_t(options.batch_size) * config.n_head *
                     options.seq_len * options.seq_len;
  return {N * C * w, N * f,     N * f,         3 * N * C * f,
          att * f,   N * C * w, N * C * f,     N * C * w,
          N * f,     N * f,     4 * N * C * f, 4 * N * C * w};
}

DType ToDType(ElementType t) {
  switch (t) {
    case ElementType::kFloat32:
      return DType::kF32;
    case ElementType::kBFloat16:
      return DType::kBF16;
    case ElementType::kFloat16:
      return DType::kF16;
  }
  return DType::kF32;
}

}  // namespace

GptModel::GptModel(strata::Device* device, strata::Stream* stream,
                   const GptConfig& config, const ModelOptions& options)
    : device_(device),
      stream_(stream),
      config_(config),
      options_(options),
      wt_(ToDType(options.param_type)),
      n_(int64_t{options.batch_size} * options.seq_len) {}

GptModel::~GptModel() = default;

StatusOr<std::unique_ptr<GptModel>> GptModel::Create(
    strata::Device* device, strata::Stream* stream, const GptConfig& config,
    const ModelOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateConfig(config));
  if (options.batch_size < 1 || options.batch_size > (1 << 20)) {
    return Status::InvalidArgument("model options: batch_size " +
                                   std::to_string(options.batch_size) +
                                   " is outside [1, 2^20]");
  }
  if (options.seq_len < 1 || options.seq_len > config.context_length) {
    return Status::InvalidArgument("model options: seq_len " +
                                   std::to_string(options.seq_len) +
                                   " is outside [1, context_length " +
                                   std::to_string(config.context_length) + "]");
  }
  const int64_t n = int64_t{options.batch_size} * options.seq_len;
  if (n * 4 * config.n_embd > (int64_t{1} << 31) - 1) {
    return Status::InvalidArgument(
        "model options: batch_size x seq_len x 4 x n_embd must stay below "
        "2^31 (GEMM dimensions are 32-bit)");
  }
  std::unique_ptr<GptModel> m(new GptModel(device, stream, config, options));
  if (device->kind() == strata::DeviceKind::kCuda) {
    m->gpu_ = CudaKernelTable();
    if (m->gpu_ == nullptr) {
      return Status(strata::StatusCode::kUnavailable,
                    "the fine-tune model was built without CUDA kernels");
    }
  } else {
    m->cpu_ = &cpu::Kernels(options.cpu_isa);
  }
  STRATA_RETURN_IF_ERROR(m->Allocate());
  return m;
}

StatusOr<void*> GptModel::Alloc(size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(strata::DeviceMemory mem,
                          device_->Allocate(bytes, *stream_));
  void* p = mem.data();
  workspace_bytes_ += bytes;
  memory_.push_back(std::move(mem));
  return p;
}

size_t GptModel::BlockActivationBytes(const GptConfig& config,
                                      const ModelOptions& options) {
  const std::array<size_t, 12> bytes = ActBytes(config, options);
  return std::accumulate(bytes.begin(), bytes.end(), size_t{0});
}

Status GptModel::Allocate() {
  const size_t N = n_, C = config_.n_embd, V = config_.vocab_size;
  const size_t w = strata::ElementSize(options_.param_type);
  const size_t f = sizeof(float);
  auto get = [&](auto*& dst, size_t bytes) -> Status {
    STRATA_ASSIGN_OR_RETURN(void* p, Alloc(bytes));
    dst = static_cast<std::remove_reference_t<decltype(dst)>>(p);
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(get(tokens_, N * sizeof(int32_t)));
  STRATA_RETURN_IF_ERROR(get(targets_, N * sizeof(int32_t)));
  residual_.resize(config_.n_layer + 1);
  for (float*& r : residual_) STRATA_RETURN_IF_ERROR(get(r, N * C * f));
  const size_t sets = options_.checkpoint_blocks ? 1 : config_.n_layer;
  const std::array<size_t, 12> bytes = ActBytes(config_, options_);
  for (size_t i = 0; i < sets; ++i) {
    auto a = std::make_unique<Acts>();
    STRATA_RETURN_IF_ERROR(get(a->ln1, bytes[0]));
    STRATA_RETURN_IF_ERROR(get(a->ln1_mean, bytes[1]));
    STRATA_RETURN_IF_ERROR(get(a->ln1_rstd, bytes[2]));
    STRATA_RETURN_IF_ERROR(get(a->qkv, bytes[3]));
    STRATA_RETURN_IF_ERROR(get(a->att, bytes[4]));
    STRATA_RETURN_IF_ERROR(get(a->atty, bytes[5]));
    STRATA_RETURN_IF_ERROR(get(a->x2, bytes[6]));
    STRATA_RETURN_IF_ERROR(get(a->ln2, bytes[7]));
    STRATA_RETURN_IF_ERROR(get(a->ln2_mean, bytes[8]));
    STRATA_RETURN_IF_ERROR(get(a->ln2_rstd, bytes[9]));
    STRATA_RETURN_IF_ERROR(get(a->fch, bytes[10]));
    STRATA_RETURN_IF_ERROR(get(a->fch_gelu, bytes[11]));
    acts_.push_back(std::move(a));
  }
  STRATA_RETURN_IF_ERROR(get(dres_, N * C * f));
  STRATA_RETURN_IF_ERROR(get(dwork_, 4 * N * C * w));
  STRATA_RETURN_IF_ERROR(get(dbig_, 4 * N * C * f));
  STRATA_RETURN_IF_ERROR(get(dsmall_, N * C * f));
  STRATA_RETURN_IF_ERROR(get(lnf_, N * C * w));
  STRATA_RETURN_IF_ERROR(get(lnf_mean_, N * f));
  STRATA_RETURN_IF_ERROR(get(lnf_rstd_, N * f));
  STRATA_RETURN_IF_ERROR(get(logits_, N * V * f));
  STRATA_RETURN_IF_ERROR(get(dlogits_, N * V * w));
  STRATA_RETURN_IF_ERROR(get(losses_, N * f));
  return Status::Ok();
}

template <class CpuFn, class GpuFn, class... A>
Status GptModel::Run(const char* name, CpuFn cpu_fn, GpuFn gpu_fn, A... args) {
  Status s;
  if (gpu_ != nullptr) {
    s = gpu_fn(*stream_, args...);
  } else {
    s = device_->LaunchHostWork(*stream_,
                                [cpu_fn, args...] { cpu_fn(args...); });
  }
  if (s.ok()) return s;
  return Status(s.code(), std::string(name) + ": " + std::string(s.message()));
}

#define FINETUNE_RUN(kernel, ...)                                            \
  Run(#kernel, cpu_ ? cpu_->kernel : nullptr, gpu_ ? gpu_->kernel : nullptr, \
      __VA_ARGS__)

Status GptModel::Gemm(GemmOp op_a, GemmOp op_b, int64_t m, int64_t n, int64_t k,
                      const void* a, int64_t lda, const void* b, int64_t ldb,
                      float* c, int64_t ldc, bool accumulate) {
  GemmArgs g;
  g.op_a = op_a;
  g.op_b = op_b;
  g.m = m;
  g.n = n;
  g.k = k;
  g.beta = accumulate ? 1.0f : 0.0f;
  g.ab_type = options_.param_type;
  g.a = a;
  g.lda = lda;
  g.b = b;
  g.ldb = ldb;
  g.c = c;
  g.ldc = ldc;
  return device_->GemmAsync(*stream_, g);
}

constexpr GemmOp kN = GemmOp::kNoTranspose;
constexpr GemmOp kT = GemmOp::kTranspose;

Status GptModel::Linear(float* out, const void* in, const void* w, int in_dim,
                        int out_dim) {
  // out^T (OUT x N) += w^T (OUT x IN, w's row-major bytes) x in^T (IN x N)
  return Gemm(kN, kN, out_dim, n_, in_dim, w, out_dim, in, in_dim, out, out_dim,
              /*accumulate=*/true);
}

Status GptModel::LinearBackward(const void* dout, const void* in, const void* w,
                                float* dw, float* din, int in_dim,
                                int out_dim) {
  // dw^T (OUT x IN) = dout^T (OUT x N) x in (N x IN)
  STRATA_RETURN_IF_ERROR(Gemm(kN, kT, out_dim, in_dim, n_, dout, out_dim, in,
                              in_dim, dw, out_dim, false));
  // din^T (IN x N) = w (IN x OUT) x dout^T (OUT x N)
  return Gemm(kT, kN, in_dim, n_, out_dim, w, out_dim, dout, out_dim, din,
              in_dim, false);
}

StatusOr<const void*> GptModel::AsWorking(const float* src, size_t n) {
  if (wt_ == DType::kF32) return static_cast<const void*>(src);
  strata::ConvertArgs c;
  c.src = src;
  c.src_type = ElementType::kFloat32;
  c.dst = dwork_;
  c.dst_type = options_.param_type;
  c.count = n;
  STRATA_RETURN_IF_ERROR(device_->ConvertAsync(*stream_, c));
  return static_cast<const void*>(dwork_);
}

Status GptModel::SetBatch(std::span<const int32_t> inputs,
                          std::span<const int32_t> targets) {
  if (int64_t(inputs.size()) != n_ || int64_t(targets.size()) != n_) {
    return Status::InvalidArgument(
        "SetBatch: " + std::to_string(inputs.size()) + " inputs and " +
        std::to_string(targets.size()) + " targets given, batch_size x " +
        "seq_len = " + std::to_string(n_) + " expected");
  }
  for (std::span<const int32_t> s : {inputs, targets}) {
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] < 0 || s[i] >= config_.vocab_size) {
        return Status::InvalidArgument(
            "SetBatch: token " + std::to_string(s[i]) + " at " +
            std::to_string(i) + " is outside [0, vocab_size " +
            std::to_string(config_.vocab_size) + ")");
      }
    }
  }
  STRATA_RETURN_IF_ERROR(device_->CopyAsync(*stream_, tokens_, inputs.data(),
                                            n_ * sizeof(int32_t),
                                            strata::CopyKind::kHostToDevice));
  return device_->CopyAsync(*stream_, targets_, targets.data(),
                            n_ * sizeof(int32_t),
                            strata::CopyKind::kHostToDevice);
}

Status GptModel::EmbeddingForward(const EmbeddingParams& p) {
  return FINETUNE_RUN(encoder_forward, residual_[0],
                      static_cast<const int32_t*>(tokens_), p.wte, p.wpe, wt_,
                      options_.batch_size, options_.seq_len,
                      int(config_.n_embd));
}

Status GptModel::RunBlockForward(int layer, const BlockParams& p, Acts& a,
                                 bool write_output) {
  const int N = int(n_), C = int(config_.n_embd);
  const float* x = residual_[layer];
  const auto& t = p.t;
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(layernorm_forward, a.ln1, a.ln1_mean,
                                      a.ln1_rstd, x, t[kLn1Weight], t[kLn1Bias],
                                      wt_, N, C));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(add_bias, a.qkv,
                                      static_cast<const float*>(nullptr),
                                      t[kQkvBias], wt_, N, 3 * C));
  STRATA_RETURN_IF_ERROR(Linear(a.qkv, a.ln1, t[kQkvWeight], C, 3 * C));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(
      attention_forward, a.atty, a.att, static_cast<const float*>(a.qkv), wt_,
      options_.batch_size, options_.seq_len, C, int(config_.n_head)));
  STRATA_RETURN_IF_ERROR(
      FINETUNE_RUN(add_bias, a.x2, x, t[kAttnProjBias], wt_, N, C));
  STRATA_RETURN_IF_ERROR(Linear(a.x2, a.atty, t[kAttnProjWeight], C, C));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(
      layernorm_forward, a.ln2, a.ln2_mean, a.ln2_rstd,
      static_cast<const float*>(a.x2), t[kLn2Weight], t[kLn2Bias], wt_, N, C));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(add_bias, a.fch,
                                      static_cast<const float*>(nullptr),
                                      t[kFcBias], wt_, N, 4 * C));
  STRATA_RETURN_IF_ERROR(Linear(a.fch, a.ln2, t[kFcWeight], C, 4 * C));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(gelu_forward, a.fch_gelu,
                                      static_cast<const float*>(a.fch), wt_,
                                      size_t(N) * 4 * C));
  if (!write_output) return Status::Ok();
  float* out = residual_[layer + 1];
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(add_bias, out,
                                      static_cast<const float*>(a.x2),
                                      t[kFcProjBias], wt_, N, C));
  return Linear(out, a.fch_gelu, t[kFcProjWeight], 4 * C, C);
}

Status GptModel::BlockForward(int layer, const BlockParams& p) {
  if (layer < 0 || layer >= config_.n_layer) {
    return Status::InvalidArgument("BlockForward: layer " +
                                   std::to_string(layer) + " is outside [0, " +
                                   std::to_string(config_.n_layer) + ")");
  }
  return RunBlockForward(layer, p, *acts_[acts_.size() == 1 ? 0 : layer],
                         /*write_output=*/true);
}

Status GptModel::HeadForwardBackward(const HeadParams& p,
                                     const HeadGrads* grads, float loss_scale) {
  const int N = int(n_), C = int(config_.n_embd), V = int(config_.vocab_size);
  const float* x = residual_[config_.n_layer];
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(layernorm_forward, lnf_, lnf_mean_,
                                      lnf_rstd_, x, p.lnf_weight, p.lnf_bias,
                                      wt_, N, C));
  // logits^T (V x N) = wte (V x C) x lnf^T (C x N)
  STRATA_RETURN_IF_ERROR(
      Gemm(kT, kN, V, N, C, p.wte, C, lnf_, C, logits_, V, false));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(
      crossentropy, losses_, grads ? dlogits_ : nullptr,
      static_cast<const float*>(logits_), static_cast<const int32_t*>(targets_),
      wt_, N, V, loss_scale / static_cast<float>(N)));
  if (grads == nullptr) return Status::Ok();
  // dwte^T (C x V) = lnf^T (C x N) x dlogits (N x V)
  STRATA_RETURN_IF_ERROR(
      Gemm(kN, kT, C, V, N, lnf_, C, dlogits_, V, grads->wte, C, false));
  // dlnf^T (C x N) = wte^T (C x V) x dlogits^T (V x N)
  STRATA_RETURN_IF_ERROR(
      Gemm(kN, kN, C, N, V, p.wte, C, dlogits_, V, dsmall_, C, false));
  STRATA_RETURN_IF_ERROR(
      device_->MemsetAsync(*stream_, dres_, 0, n_ * C * sizeof(float)));
  return FINETUNE_RUN(layernorm_backward, dres_, grads->lnf_weight,
                      grads->lnf_bias, static_cast<const float*>(dsmall_), x,
                      p.lnf_weight, wt_, static_cast<const float*>(lnf_mean_),
                      static_cast<const float*>(lnf_rstd_), N, C);
}

Status GptModel::BlockBackward(int layer, const BlockParams& p,
                               const BlockGrads& g) {
  if (layer < 0 || layer >= config_.n_layer) {
    return Status::InvalidArgument("BlockBackward: layer " +
                                   std::to_string(layer) + " is outside [0, " +
                                   std::to_string(config_.n_layer) + ")");
  }
  Acts& a = *acts_[acts_.size() == 1 ? 0 : layer];
  if (options_.checkpoint_blocks) {
    STRATA_RETURN_IF_ERROR(
        RunBlockForward(layer, p, a, /*write_output=*/false));
  }
  const int N = int(n_), C = int(config_.n_embd);
  const size_t NC = size_t(N) * C;
  const float* x = residual_[layer];
  const auto& t = p.t;
  const auto& d = g.t;
  // MLP: out = x2 + fch_gelu Wfp + bfp.
  STRATA_ASSIGN_OR_RETURN(const void* dy, AsWorking(dres_, NC));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(bias_grad, d[kFcProjBias],
                                      static_cast<const float*>(dres_), N, C));
  STRATA_RETURN_IF_ERROR(LinearBackward(dy, a.fch_gelu, t[kFcProjWeight],
                                        d[kFcProjWeight], dbig_, 4 * C, C));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(
      gelu_backward, dbig_, static_cast<const float*>(a.fch), 4 * NC));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(
      bias_grad, d[kFcBias], static_cast<const float*>(dbig_), N, 4 * C));
  STRATA_ASSIGN_OR_RETURN(const void* dfc, AsWorking(dbig_, 4 * NC));
  STRATA_RETURN_IF_ERROR(LinearBackward(dfc, a.ln2, t[kFcWeight], d[kFcWeight],
                                        dsmall_, C, 4 * C));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(
      layernorm_backward, dres_, d[kLn2Weight], d[kLn2Bias],
      static_cast<const float*>(dsmall_), static_cast<const float*>(a.x2),
      t[kLn2Weight], wt_, static_cast<const float*>(a.ln2_mean),
      static_cast<const float*>(a.ln2_rstd), N, C));
  // Attention: x2 = x + atty Wap + bap.
  STRATA_ASSIGN_OR_RETURN(const void* dx2, AsWorking(dres_, NC));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(bias_grad, d[kAttnProjBias],
                                      static_cast<const float*>(dres_), N, C));
  STRATA_RETURN_IF_ERROR(LinearBackward(dx2, a.atty, t[kAttnProjWeight],
                                        d[kAttnProjWeight], dsmall_, C, C));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(
      attention_backward, dbig_, static_cast<const float*>(dsmall_),
      static_cast<const float*>(a.qkv), static_cast<const float*>(a.att),
      options_.batch_size, options_.seq_len, C, int(config_.n_head)));
  STRATA_RETURN_IF_ERROR(FINETUNE_RUN(
      bias_grad, d[kQkvBias], static_cast<const float*>(dbig_), N, 3 * C));
  STRATA_ASSIGN_OR_RETURN(const void* dqkv, AsWorking(dbig_, 3 * NC));
  STRATA_RETURN_IF_ERROR(LinearBackward(dqkv, a.ln1, t[kQkvWeight],
                                        d[kQkvWeight], dsmall_, C, 3 * C));
  return FINETUNE_RUN(layernorm_backward, dres_, d[kLn1Weight], d[kLn1Bias],
                      static_cast<const float*>(dsmall_), x, t[kLn1Weight], wt_,
                      static_cast<const float*>(a.ln1_mean),
                      static_cast<const float*>(a.ln1_rstd), N, C);
}

Status GptModel::EmbeddingBackward(const EmbeddingGrads& g) {
  const size_t used = size_t(options_.seq_len) * config_.n_embd;
  const size_t all = size_t(config_.context_length) * config_.n_embd;
  if (used < all) {
    STRATA_RETURN_IF_ERROR(device_->MemsetAsync(*stream_, g.wpe + used, 0,
                                                (all - used) * sizeof(float)));
  }
  return FINETUNE_RUN(encoder_backward, g.wte, g.wpe,
                      static_cast<const float*>(dres_),
                      static_cast<const int32_t*>(tokens_), options_.batch_size,
                      options_.seq_len, int(config_.n_embd));
}

StatusOr<float> GptModel::MeanLoss() {
  std::vector<float> host(n_);
  STRATA_RETURN_IF_ERROR(device_->CopyAsync(*stream_, host.data(), losses_,
                                            n_ * sizeof(float),
                                            strata::CopyKind::kDeviceToHost));
  STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*stream_));
  double sum = 0.0;
  for (float v : host) sum += v;
  return static_cast<float>(sum / static_cast<double>(n_));
}

Status GptModel::CopyLogits(std::span<float> out) {
  const size_t count = size_t(n_) * config_.vocab_size;
  if (out.size() != count) {
    return Status::InvalidArgument("CopyLogits: " + std::to_string(out.size()) +
                                   " floats given, " + std::to_string(count) +
                                   " expected");
  }
  STRATA_RETURN_IF_ERROR(device_->CopyAsync(*stream_, out.data(), logits_,
                                            count * sizeof(float),
                                            strata::CopyKind::kDeviceToHost));
  return device_->SynchronizeStream(*stream_);
}

}  // namespace finetune
