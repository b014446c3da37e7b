// finetune-model-bench: how fast the model's CPU kernels and its whole
// forward + backward run on the host-emulated device.
//   finetune-model-bench kernels   each CPU kernel on one thread, in CPU
//                                   time (stable on a loaded machine): AVX2
//                                   set, scalar set, a naive loop
//   finetune-model-bench model [preset|tiny] [B] [T] [bf16|fp32]
//                                   one training step's time, its model
//                                   FLOP rate, and the device's sgemm rate
#include <tbb/global_control.h>
#include <time.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "examples/finetune/model/config.h"
#include "examples/finetune/model/kernels.h"
#include "examples/finetune/model/model.h"
#include "strata/device.h"

namespace finetune {
namespace {

double CpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

// Process CPU seconds per call of `f`.
double CpuTime(const std::function<void()>& f, int reps) {
  f();  // warm up
  const double t0 = CpuSeconds();
  for (int i = 0; i < reps; ++i) f();
  return (CpuSeconds() - t0) / reps;
}

double Seconds(const std::function<void()>& f, int reps) {
  f();  // warm up
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
             .count() /
         reps;
}

std::vector<float> Random(size_t n, float scale) {
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void NaiveLayerNorm(float* out, const float* inp, const float* w,
                    const float* b, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const float* x = inp + size_t(n) * C;
    float m = 0, v = 0;
    for (int i = 0; i < C; ++i) m += x[i];
    m /= C;
    for (int i = 0; i < C; ++i) v += (x[i] - m) * (x[i] - m);
    const float s = 1.0f / std::sqrt(v / C + 1e-5f);
    for (int i = 0; i < C; ++i)
      out[size_t(n) * C + i] = (x[i] - m) * s * w[i] + b[i];
  }
}

void NaiveGelu(float* out, const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    out[i] = 0.5f * x[i] *
             (1.0f + std::tanh(0.7978845608f *
                               (x[i] + 0.044715f * x[i] * x[i] * x[i])));
  }
}

void NaiveCrossEntropy(float* losses, float* d, const float* logits,
                       const int32_t* tgt, int N, int V) {
  for (int n = 0; n < N; ++n) {
    const float* l = logits + size_t(n) * V;
    float mx = l[0], sum = 0;
    for (int i = 1; i < V; ++i) mx = std::max(mx, l[i]);
    for (int i = 0; i < V; ++i) sum += std::exp(l[i] - mx);
    losses[n] = std::log(sum) - (l[tgt[n]] - mx);
    for (int i = 0; i < V; ++i) {
      d[size_t(n) * V + i] = std::exp(l[i] - mx) / sum - (i == tgt[n]);
    }
  }
}

void NaiveAttention(float* out, float* att, const float* qkv, int B, int T,
                    int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(float(hs));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        const float* q = qkv + (size_t(b) * T + t) * 3 * C + h * hs;
        float* a = att + ((size_t(b) * NH + h) * T + t) * T;
        float mx = -INFINITY, sum = 0;
        for (int s = 0; s <= t; ++s) {
          const float* k = qkv + (size_t(b) * T + s) * 3 * C + C + h * hs;
          float dot = 0;
          for (int i = 0; i < hs; ++i) dot += q[i] * k[i];
          a[s] = dot * scale;
          mx = std::max(mx, a[s]);
        }
        for (int s = 0; s <= t; ++s) sum += (a[s] = std::exp(a[s] - mx));
        for (int s = 0; s <= t; ++s) a[s] /= sum;
        float* o = out + (size_t(b) * T + t) * C + h * hs;
        for (int i = 0; i < hs; ++i) {
          float acc = 0;
          for (int s = 0; s <= t; ++s) {
            acc += a[s] * qkv[(size_t(b) * T + s) * 3 * C + 2 * C + h * hs + i];
          }
          o[i] = acc;
        }
      }
}

int Kernels() {
  tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism,
                                 1);
  const int N = 4 * 256, C = 768, V = 50257, B = 4, T = 256, NH = 12;
  const auto x = Random(size_t(N) * 4 * C, 1.0f);
  const auto w = Random(C, 1.0f), b = Random(C, 1.0f);
  const auto logits = Random(size_t(64) * V, 2.0f);
  std::vector<int32_t> tgt(N, 7);
  std::vector<float> out(size_t(N) * 4 * C), mean(N), rstd(N),
      dl(size_t(64) * V), losses(N), att(size_t(B) * NH * T * T);
  const auto qkv = Random(size_t(N) * 3 * C, 1.0f);
  std::printf("%-22s %12s %12s %12s %8s\n", "kernel (1 thread)", "avx2 ms",
              "scalar ms", "naive ms", "speedup");
  auto row = [](const char* name,
                const std::function<void(const CpuKernels&)>& f,
                const std::function<void()>& naive, int reps) {
    const double a = cpu::IsaSupported(Isa::kAvx2)
                         ? CpuTime([&] { f(cpu::Kernels(Isa::kAvx2)); }, reps)
                         : NAN;
    const double s = CpuTime([&] { f(cpu::Kernels(Isa::kScalar)); }, reps);
    const double n = CpuTime(naive, reps);
    std::printf("%-22s %12.3f %12.3f %12.3f %7.1fx\n", name, a * 1e3, s * 1e3,
                n * 1e3, n / a);
  };
  row(
      "layernorm 1024x768",
      [&](const CpuKernels& k) {
        k.layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(),
                            w.data(), b.data(), DType::kF32, N, C);
      },
      [&] { NaiveLayerNorm(out.data(), x.data(), w.data(), b.data(), N, C); },
      20);
  row(
      "gelu 1024x3072",
      [&](const CpuKernels& k) {
        k.gelu_forward(out.data(), x.data(), DType::kF32, size_t(N) * 4 * C);
      },
      [&] { NaiveGelu(out.data(), x.data(), size_t(N) * 4 * C); }, 10);
  row(
      "crossentropy 64x50257",
      [&](const CpuKernels& k) {
        k.crossentropy(losses.data(), dl.data(), logits.data(), tgt.data(),
                       DType::kF32, 64, V, 1.0f);
      },
      [&] {
        NaiveCrossEntropy(losses.data(), dl.data(), logits.data(), tgt.data(),
                          64, V);
      },
      5);
  row(
      "attention 4x256x768",
      [&](const CpuKernels& k) {
        k.attention_forward(out.data(), att.data(), qkv.data(), DType::kF32, B,
                            T, C, NH);
      },
      [&] { NaiveAttention(out.data(), att.data(), qkv.data(), B, T, C, NH); },
      3);
  return 0;
}

int Model(int argc, char** argv) {
  const std::string preset = argc > 2 ? argv[2] : "gpt2-124M";
  auto config = PresetConfig(preset);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  if (preset == "gpt2-124M") config->n_layer = 2;  // the shapes, fewer blocks
  ModelOptions o;
  o.batch_size = argc > 3 ? std::atoi(argv[3]) : 4;
  o.seq_len = argc > 4 ? std::atoi(argv[4]) : 128;
  o.param_type = argc > 5 && std::string(argv[5]) == "fp32"
                     ? strata::ElementType::kFloat32
                     : strata::ElementType::kBFloat16;
  strata::DeviceOptions dopt;
  dopt.choice = strata::DeviceChoice::kHostEmulated;
  dopt.memory_budget_bytes = uint64_t{8} << 30;
  auto device = strata::NewHostEmulatedDevice(dopt);
  if (!device.ok()) return 1;
  strata::Device& d = **device;
  auto stream = d.NewStream({});
  if (!stream.ok()) return 1;
  auto model = GptModel::Create(&d, stream->get(), *config, o);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  GptModel& m = **model;
  const size_t wsize = strata::ElementSize(o.param_type);
  std::vector<strata::DeviceMemory> keep;
  std::vector<void*> params;
  std::vector<float*> grads;
  const auto specs = ListParameters(*config);
  for (const ParamSpec& s : specs) {
    auto p = d.Allocate(s.numel * wsize, **stream);
    auto g = d.Allocate(s.numel * sizeof(float), **stream);
    if (!p.ok() || !g.ok()) return 1;
    (void)d.MemsetAsync(**stream, p->data(), 0, s.numel * wsize);
    params.push_back(p->data());
    grads.push_back(static_cast<float*>(g->data()));
    keep.push_back(std::move(*p));
    keep.push_back(std::move(*g));
  }
  auto P = [&](const std::string& n) -> const void* {
    for (size_t i = 0; i < specs.size(); ++i)
      if (specs[i].name == n) return params[i];
    return nullptr;
  };
  auto G = [&](const std::string& n) -> float* {
    for (size_t i = 0; i < specs.size(); ++i)
      if (specs[i].name == n) return grads[i];
    return nullptr;
  };
  std::vector<int32_t> tokens(m.tokens_per_step(), 1);
  auto step = [&] {
    (void)m.SetBatch(tokens, tokens);
    (void)m.EmbeddingForward({P("wte.weight"), P("wpe.weight")});
    for (int l = 0; l < config->n_layer; ++l) {
      BlockParams bp;
      for (size_t i = 0; i < specs.size(); ++i)
        if (specs[i].layer == l) bp.t[specs[i].slot] = params[i];
      (void)m.BlockForward(l, bp);
    }
    HeadGrads hg{G("ln_f.weight"), G("ln_f.bias"), G("wte.weight")};
    (void)m.HeadForwardBackward(
        {P("ln_f.weight"), P("ln_f.bias"), P("wte.weight")}, &hg, 1.0f);
    for (int l = config->n_layer - 1; l >= 0; --l) {
      BlockParams bp;
      BlockGrads bg;
      for (size_t i = 0; i < specs.size(); ++i)
        if (specs[i].layer == l) {
          bp.t[specs[i].slot] = params[i];
          bg.t[specs[i].slot] = grads[i];
        }
      (void)m.BlockBackward(l, bp, bg);
    }
    (void)m.EmbeddingBackward({G("wte.weight"), G("wpe.weight")});
    (void)d.SynchronizeStream(**stream);
  };
  const double t = Seconds(step, 3);
  const double tokens_s = m.tokens_per_step() / t;
  const double flops = TrainingFlopsPerToken(*config, o.seq_len) * tokens_s;
  // The device's own sgemm rate on a square fp32 GEMM.
  const int64_t n = 1536;
  auto a = d.Allocate(n * n * 4, **stream), c = d.Allocate(n * n * 4, **stream);
  if (!a.ok() || !c.ok()) return 1;
  (void)d.MemsetAsync(**stream, a->data(), 0, n * n * 4);
  strata::GemmArgs g;
  g.m = g.n = g.k = n;
  g.a = g.b = a->data();
  g.lda = g.ldb = g.ldc = n;
  g.c = c->data();
  const double tg = Seconds(
      [&] {
        (void)d.GemmAsync(**stream, g);
        (void)d.SynchronizeStream(**stream);
      },
      5);
  const double gemm = 2.0 * n * n * n / tg;
  std::printf(
      "%s L=%lld B=%d T=%d %s: step %.3f s, %.0f tokens/s, %.2f GFLOPS "
      "(model FLOPs, recompute not counted); device sgemm %.2f GFLOPS; "
      "share %.0f%%; workspace %.1f MiB\n",
      preset.c_str(), (long long)config->n_layer, o.batch_size, o.seq_len,
      std::string(strata::ElementTypeName(o.param_type)).c_str(), t, tokens_s,
      flops / 1e9, gemm / 1e9, 100.0 * flops / gemm,
      m.workspace_bytes() / 1048576.0);
  (void)d.SynchronizeStream(**stream);
  return 0;
}

}  // namespace
}  // namespace finetune

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "kernels";
  if (cmd == "kernels") return finetune::Kernels();
  if (cmd == "model") return finetune::Model(argc, argv);
  std::fprintf(stderr,
               "usage: finetune-model-bench kernels | model [preset] [B] [T] "
               "[bf16|fp32]\n");
  return 2;
}
