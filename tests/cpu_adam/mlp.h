// The small training problem of the cpu_adam tests: a two-layer tanh MLP
// (16-64-4) learns a fixed random teacher's outputs (a teacher-student
// regression). All parameters live in one flat array, as an engine
// partition would hold them: W1 (kIn x kHidden, row-major), b1, W2
// (kHidden x kOut), b2.
#ifndef STRATA_TESTS_CPU_ADAM_MLP_H_
#define STRATA_TESTS_CPU_ADAM_MLP_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace strata {

class Mlp {
 public:
  static constexpr int kIn = 16, kHidden = 64, kOut = 4;
  static constexpr size_t kParams =
      size_t{kIn} * kHidden + kHidden + size_t{kHidden} * kOut + kOut;

  static void Init(std::vector<float>& w, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    w.resize(kParams);
    for (size_t i = 0; i < kParams; ++i) {
      const bool first = i < size_t{kIn} * kHidden + kHidden;
      w[i] = nd(rng) / std::sqrt(static_cast<float>(first ? kIn : kHidden));
    }
  }

  // Mean squared error over the batch; grad (if not null) gets d loss / dw.
  static double Loss(const std::vector<float>& w, const std::vector<float>& x,
                     const std::vector<float>& y, std::vector<float>* grad) {
    const size_t batch = x.size() / kIn;
    const float* w1 = w.data();
    const float* b1 = w1 + kIn * kHidden;
    const float* w2 = b1 + kHidden;
    const float* b2 = w2 + kHidden * kOut;
    if (grad) grad->assign(kParams, 0.0f);
    double loss = 0;
    float h[kHidden], out[kOut], dh[kHidden];
    for (size_t s = 0; s < batch; ++s) {
      const float* xs = &x[s * kIn];
      for (int j = 0; j < kHidden; ++j) {
        float a = b1[j];
        for (int i = 0; i < kIn; ++i) a += xs[i] * w1[i * kHidden + j];
        h[j] = std::tanh(a);
      }
      for (int k = 0; k < kOut; ++k) {
        float a = b2[k];
        for (int j = 0; j < kHidden; ++j) a += h[j] * w2[j * kOut + k];
        out[k] = a - y[s * kOut + k];
        loss += static_cast<double>(out[k]) * out[k];
      }
      if (!grad) continue;
      float* g1 = grad->data();
      float* gb1 = g1 + kIn * kHidden;
      float* g2 = gb1 + kHidden;
      float* gb2 = g2 + kHidden * kOut;
      const float scale = 2.0f / static_cast<float>(batch * kOut);
      for (int j = 0; j < kHidden; ++j) {
        float d = 0;
        for (int k = 0; k < kOut; ++k) {
          g2[j * kOut + k] += scale * out[k] * h[j];
          d += scale * out[k] * w2[j * kOut + k];
        }
        dh[j] = d * (1 - h[j] * h[j]);
      }
      for (int k = 0; k < kOut; ++k) gb2[k] += scale * out[k];
      for (int j = 0; j < kHidden; ++j) {
        gb1[j] += dh[j];
        for (int i = 0; i < kIn; ++i) g1[i * kHidden + j] += dh[j] * xs[i];
      }
    }
    return loss / static_cast<double>(batch * kOut);
  }

  // The teacher's outputs for the inputs `in`.
  static void Targets(const std::vector<float>& teacher,
                      const std::vector<float>& in, std::vector<float>& out) {
    const size_t b = in.size() / kIn;
    out.assign(b * kOut, 0.0f);
    const float* w1 = teacher.data();
    const float* b1 = w1 + kIn * kHidden;
    const float* w2 = b1 + kHidden;
    const float* b2 = w2 + kHidden * kOut;
    for (size_t s = 0; s < b; ++s) {
      for (int k = 0; k < kOut; ++k) {
        float a = b2[k];
        for (int j = 0; j < kHidden; ++j) {
          float hj = b1[j];
          for (int i = 0; i < kIn; ++i) {
            hj += in[s * kIn + i] * w1[i * kHidden + j];
          }
          a += std::tanh(hj) * w2[j * kOut + k];
        }
        out[s * kOut + k] = a;
      }
    }
  }
};

}  // namespace strata

#endif  // STRATA_TESTS_CPU_ADAM_MLP_H_
