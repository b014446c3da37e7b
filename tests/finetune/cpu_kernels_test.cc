// The CPU kernels (every ISA this machine runs, every working type) against
// naive double-precision references written from the formulas, over sizes
// that leave vector tails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "examples/finetune/model/kernels.h"
#include "tests/gpu/conversion_reference.h"

namespace finetune {
namespace {

using strata::ElementType;

ElementType ToElement(DType t) {
  return t == DType::kF32    ? ElementType::kFloat32
         : t == DType::kBF16 ? ElementType::kBFloat16
                             : ElementType::kFloat16;
}

// A buffer in a working type, written from and read back as doubles.
class Typed {
 public:
  Typed(DType t, size_t n)
      : t_(t), n_(n), bytes_(n * (t == DType::kF32 ? 4 : 2)) {}
  void* data() { return bytes_.data(); }
  // Stores `v` rounded to the type; returns the stored values.
  std::vector<double> Set(const std::vector<float>& v) {
    for (size_t i = 0; i < n_; ++i) {
      if (t_ == DType::kF32) {
        std::memcpy(bytes_.data() + 4 * i, &v[i], 4);
      } else {
        const uint16_t b = strata::testing::Round16(
            v[i], strata::testing::FormatOf(ToElement(t_)));
        std::memcpy(bytes_.data() + 2 * i, &b, 2);
      }
    }
    return Get();
  }
  std::vector<double> Get() const {
    std::vector<double> out(n_);
    for (size_t i = 0; i < n_; ++i) {
      if (t_ == DType::kF32) {
        float f;
        std::memcpy(&f, bytes_.data() + 4 * i, 4);
        out[i] = f;
      } else {
        uint16_t b;
        std::memcpy(&b, bytes_.data() + 2 * i, 2);
        out[i] = strata::testing::Decode16(
            b, strata::testing::FormatOf(ToElement(t_)));
      }
    }
    return out;
  }

 private:
  DType t_;
  size_t n_;
  std::vector<unsigned char> bytes_;
};

std::vector<float> Random(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Relative tolerance of a value stored in `t`.
double Tol(DType t) {
  return t == DType::kF32 ? 2e-6 : t == DType::kBF16 ? 8e-3 : 1e-3;
}

template <class A, class B>
void ExpectClose(const A& got, const B& want, double rel, double abs,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(double(got[i]), double(want[i]),
                abs + rel * std::fabs(double(want[i])))
        << what << "[" << i << "]";
  }
}

class CpuKernelsTest : public ::testing::Test {
 protected:
  template <class F>
  void ForEachSet(F&& f) {
    for (Isa isa : {Isa::kScalar, Isa::kAvx2}) {
      if (!cpu::IsaSupported(isa)) continue;
      for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
        SCOPED_TRACE(testing::Message()
                     << "isa " << int(isa) << " type " << int(t));
        f(cpu::Kernels(isa), t);
      }
    }
  }
};

constexpr int kSizes[] = {1, 7, 8, 33, 100};

double Gelu(double x) {
  return 0.5 * x *
         (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST_F(CpuKernelsTest, Encoder) {
  ForEachSet([](const CpuKernels& k, DType t) {
    for (int C : kSizes) {
      const int B = 2, T = 5, V = 11;
      Typed wte(t, V * C), wpe(t, T * C);
      const auto te = wte.Set(Random(V * C, 1)), pe = wpe.Set(Random(T * C, 2));
      std::vector<int32_t> tok(B * T);
      for (int i = 0; i < B * T; ++i) tok[i] = (i * 7) % V;
      std::vector<float> out(B * T * C);
      k.encoder_forward(out.data(), tok.data(), wte.data(), wpe.data(), t, B, T,
                        C);
      std::vector<double> want(out.size());
      for (int n = 0; n < B * T; ++n)
        for (int c = 0; c < C; ++c)
          want[n * C + c] = te[tok[n] * C + c] + pe[(n % T) * C + c];
      ExpectClose(out, want, 1e-6, 0, "encoder");
      // Backward: dwte accumulates, dwpe is overwritten.
      const auto dout = Random(B * T * C, 3);
      std::vector<float> dwte = Random(V * C, 4), dwpe(T * C, 9.0f);
      std::vector<double> want_te(dwte.begin(), dwte.end()),
          want_pe(T * C, 0.0);
      for (int n = 0; n < B * T; ++n)
        for (int c = 0; c < C; ++c) {
          want_te[tok[n] * C + c] += dout[n * C + c];
          want_pe[(n % T) * C + c] += dout[n * C + c];
        }
      k.encoder_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B,
                         T, C);
      ExpectClose(dwte, want_te, 1e-6, 1e-6, "dwte");
      ExpectClose(dwpe, want_pe, 1e-6, 1e-6, "dwpe");
    }
  });
}

TEST_F(CpuKernelsTest, LayerNorm) {
  ForEachSet([](const CpuKernels& k, DType t) {
    for (int C : kSizes) {
      for (int N : {1, 3, 40}) {
        const auto inp = Random(N * C, 5, 2.0f);
        Typed w(t, C), b(t, C), out(t, N * C);
        const auto wv = w.Set(Random(C, 6)), bv = b.Set(Random(C, 7));
        std::vector<float> mean(N), rstd(N);
        k.layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(),
                            w.data(), b.data(), t, N, C);
        std::vector<double> want(N * C), wm(N), wr(N), xhat(N * C);
        for (int n = 0; n < N; ++n) {
          double m = 0, v = 0;
          for (int c = 0; c < C; ++c) m += inp[n * C + c];
          m /= C;
          for (int c = 0; c < C; ++c) v += std::pow(inp[n * C + c] - m, 2);
          const double r = 1 / std::sqrt(v / C + 1e-5);
          wm[n] = m;
          wr[n] = r;
          for (int c = 0; c < C; ++c) {
            xhat[n * C + c] = (inp[n * C + c] - m) * r;
            want[n * C + c] = xhat[n * C + c] * wv[c] + bv[c];
          }
        }
        ExpectClose(out.Get(), want, Tol(t), 1e-5, "ln out");
        ExpectClose(mean, wm, 1e-5, 1e-6, "mean");
        ExpectClose(rstd, wr, 1e-4, 1e-6, "rstd");
        // Backward.
        const auto dout = Random(N * C, 8);
        std::vector<float> dinp = Random(N * C, 9), dw(C), db(C);
        std::vector<double> want_in(dinp.begin(), dinp.end()), want_w(C, 0),
            want_b(C, 0);
        for (int n = 0; n < N; ++n) {
          double a = 0, bb = 0;
          for (int c = 0; c < C; ++c) {
            const double dn = dout[n * C + c] * wv[c];
            a += dn;
            bb += dn * xhat[n * C + c];
            want_w[c] += dout[n * C + c] * xhat[n * C + c];
            want_b[c] += dout[n * C + c];
          }
          a /= C;
          bb /= C;
          for (int c = 0; c < C; ++c) {
            want_in[n * C + c] +=
                (dout[n * C + c] * wv[c] - a - xhat[n * C + c] * bb) * wr[n];
          }
        }
        k.layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(),
                             inp.data(), w.data(), t, mean.data(), rstd.data(),
                             N, C);
        ExpectClose(dinp, want_in, 1e-4, 1e-4, "dinp");
        ExpectClose(dw, want_w, 1e-4, 1e-4, "dw");
        ExpectClose(db, want_b, 1e-5, 1e-5, "db");
      }
    }
  });
}

TEST_F(CpuKernelsTest, BiasAndGelu) {
  ForEachSet([](const CpuKernels& k, DType t) {
    for (int OC : kSizes) {
      for (int N : {1, 3, 40}) {
        Typed bias(t, OC);
        const auto bv = bias.Set(Random(OC, 10));
        const auto res = Random(N * OC, 11);
        std::vector<float> out(N * OC, 5.0f), in_place = res;
        k.add_bias(out.data(), nullptr, bias.data(), t, N, OC);
        k.add_bias(in_place.data(), in_place.data(), bias.data(), t, N, OC);
        std::vector<double> w0(N * OC), w1(N * OC);
        for (int i = 0; i < N * OC; ++i) {
          w0[i] = bv[i % OC];
          w1[i] = res[i] + bv[i % OC];
        }
        ExpectClose(out, w0, 0, 0, "bias fill");
        ExpectClose(in_place, w1, 1e-7, 0, "bias add");
        std::vector<float> db(OC);
        k.bias_grad(db.data(), res.data(), N, OC);
        std::vector<double> wdb(OC, 0);
        for (int i = 0; i < N * OC; ++i) wdb[i % OC] += res[i];
        ExpectClose(db, wdb, 1e-5, 1e-5, "bias grad");
      }
    }
    for (size_t n : {1, 7, 8, 100, 20000}) {
      const auto x = Random(n, 12, 3.0f);
      Typed out(t, n);
      k.gelu_forward(out.data(), x.data(), t, n);
      std::vector<double> want(n), wd(n);
      std::vector<float> d = Random(n, 13);
      for (size_t i = 0; i < n; ++i) {
        want[i] = Gelu(x[i]);
        const double h = 1e-4;
        wd[i] = d[i] * (Gelu(x[i] + h) - Gelu(x[i] - h)) / (2 * h);
      }
      ExpectClose(out.Get(), want, Tol(t), 2e-6, "gelu");
      k.gelu_backward(d.data(), x.data(), n);
      ExpectClose(d, wd, 1e-4, 1e-5, "gelu grad");
    }
  });
}

TEST_F(CpuKernelsTest, Attention) {
  ForEachSet([](const CpuKernels& k, DType t) {
    // T past one task's 32 queries and hs past four vectors leave tails.
    for (int T : {1, 5, 9, 37}) {
      for (int hs : {3, 8, 16, 44}) {
        const int B = 2, NH = 2, C = NH * hs, N = B * T;
        const auto qkv = Random(N * 3 * C, 14);
        Typed out(t, N * C);
        std::vector<float> att(B * NH * T * T, 7.0f);
        k.attention_forward(out.data(), att.data(), qkv.data(), t, B, T, C, NH);
        std::vector<double> want_att(att.size(), 0), want_out(N * C, 0);
        const double scale = 1 / std::sqrt(double(hs));
        auto Q = [&](int b, int tt, int h, int i) {
          return double(qkv[(b * T + tt) * 3 * C + h * hs + i]);
        };
        auto K = [&](int b, int tt, int h, int i) {
          return double(qkv[(b * T + tt) * 3 * C + C + h * hs + i]);
        };
        auto Vv = [&](int b, int tt, int h, int i) {
          return double(qkv[(b * T + tt) * 3 * C + 2 * C + h * hs + i]);
        };
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < NH; ++h)
            for (int q = 0; q < T; ++q) {
              double* a = &want_att[((b * NH + h) * T + q) * T];
              double mx = -1e300, sum = 0;
              for (int s = 0; s <= q; ++s) {
                double dot = 0;
                for (int i = 0; i < hs; ++i)
                  dot += Q(b, q, h, i) * K(b, s, h, i);
                a[s] = dot * scale;
                mx = std::max(mx, a[s]);
              }
              for (int s = 0; s <= q; ++s) sum += (a[s] = std::exp(a[s] - mx));
              for (int s = 0; s <= q; ++s) a[s] /= sum;
              for (int i = 0; i < hs; ++i) {
                double o = 0;
                for (int s = 0; s <= q; ++s) o += a[s] * Vv(b, s, h, i);
                want_out[(b * T + q) * C + h * hs + i] = o;
              }
            }
        ExpectClose(att, want_att, 1e-5, 1e-6, "att");
        ExpectClose(out.Get(), want_out, Tol(t), 1e-5, "att out");
        // Backward against the same formulas in double.
        const auto dout = Random(N * C, 15);
        std::vector<float> dqkv(N * 3 * C, 3.0f);
        k.attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(),
                             B, T, C, NH);
        std::vector<double> want(N * 3 * C, 0);
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < NH; ++h)
            for (int q = 0; q < T; ++q) {
              const double* a = &want_att[((b * NH + h) * T + q) * T];
              std::vector<double> dp(q + 1);
              double pdp = 0;
              for (int s = 0; s <= q; ++s) {
                for (int i = 0; i < hs; ++i) {
                  const double d = dout[(b * T + q) * C + h * hs + i];
                  dp[s] += d * Vv(b, s, h, i);
                  want[(b * T + s) * 3 * C + 2 * C + h * hs + i] += a[s] * d;
                }
                pdp += a[s] * dp[s];
              }
              for (int s = 0; s <= q; ++s) {
                const double ds = a[s] * (dp[s] - pdp) * scale;
                for (int i = 0; i < hs; ++i) {
                  want[(b * T + q) * 3 * C + h * hs + i] += ds * K(b, s, h, i);
                  want[(b * T + s) * 3 * C + C + h * hs + i] +=
                      ds * Q(b, q, h, i);
                }
              }
            }
        ExpectClose(dqkv, want, 1e-4, 1e-5, "dqkv");
      }
    }
  });
}

TEST_F(CpuKernelsTest, CrossEntropy) {
  ForEachSet([](const CpuKernels& k, DType t) {
    for (int V : {1, 7, 8, 100, 1000}) {
      const int N = 5;
      const auto logits = Random(N * V, 16, 3.0f);
      std::vector<int32_t> tgt(N);
      for (int n = 0; n < N; ++n) tgt[n] = (n * 13) % V;
      std::vector<float> losses(N), only(N);
      Typed d(t, N * V);
      const float dscale = 0.25f;
      k.crossentropy(losses.data(), d.data(), logits.data(), tgt.data(), t, N,
                     V, dscale);
      k.crossentropy(only.data(), nullptr, logits.data(), tgt.data(), t, N, V,
                     dscale);
      std::vector<double> wl(N), wd(N * V);
      for (int n = 0; n < N; ++n) {
        double mx = -1e300, sum = 0;
        for (int v = 0; v < V; ++v)
          mx = std::max(mx, double(logits[n * V + v]));
        for (int v = 0; v < V; ++v) sum += std::exp(logits[n * V + v] - mx);
        wl[n] = std::log(sum) + mx - logits[n * V + tgt[n]];
        for (int v = 0; v < V; ++v) {
          wd[n * V + v] =
              (std::exp(logits[n * V + v] - mx) / sum - (v == tgt[n])) * dscale;
        }
      }
      ExpectClose(losses, wl, 1e-5, 1e-5, "loss");
      ExpectClose(only, wl, 1e-5, 1e-5, "loss only");
      ExpectClose(d.Get(), wd, Tol(t), 1e-6, "dlogits");
    }
  });
}

}  // namespace
}  // namespace finetune
