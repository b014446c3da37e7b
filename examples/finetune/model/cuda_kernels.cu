// CUDA kernels of cuda_kernels.h. Simple shapes: grid-stride element loops,
// one warp per row for LayerNorm and attention, one block per row for the
// loss, column sums split over row groups with atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "examples/finetune/model/cuda_kernels.h"

namespace finetune::cuda {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ void Put(float* p, float v) { *p = v; }
__device__ __forceinline__ void Put(__half* p, float v) {
  *p = __float2half_rn(v);
}
__device__ __forceinline__ void Put(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}

template <class F>
cudaError_t WithType(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      return f(static_cast<float*>(nullptr));
    case DType::kBF16:
      return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::kF16:
      return f(static_cast<__half*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

constexpr int kThreads = 256;
inline unsigned Blocks(size_t n) {
  return static_cast<unsigned>(
      std::min<size_t>((n + kThreads - 1) / kThreads, 65535u * 8));
}
inline unsigned WarpBlocks(size_t rows) {
  return static_cast<unsigned>((rows + kThreads / 32 - 1) / (kThreads / 32));
}
__device__ __forceinline__ size_t GlobalWarp() {
  return (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}

#define GRID_STRIDE(i, n)                                                 \
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += size_t(gridDim.x) * blockDim.x)

template <class S>
__global__ void EncoderForwardKernel(float* out, const int32_t* tokens,
                                     const S* wte, const S* wpe, int T, int C,
                                     size_t total) {
  GRID_STRIDE(i, total) {
    const size_t n = i / C, c = i % C;
    out[i] =
        ToFloat(wte[size_t(tokens[n]) * C + c]) + ToFloat(wpe[(n % T) * C + c]);
  }
}

__global__ void EncoderBackwardKernel(float* dwte, float* dwpe,
                                      const float* dout, const int32_t* tokens,
                                      int B, int T, int C) {
  const size_t total = size_t(T) * C;
  GRID_STRIDE(i, total) {
    const size_t t = i / C, c = i % C;
    float acc = 0.0f;
    for (int b = 0; b < B; ++b) {
      const size_t n = size_t(b) * T + t;
      const float d = dout[n * C + c];
      acc += d;
      atomicAdd(dwte + size_t(tokens[n]) * C + c, d);
    }
    dwpe[i] = acc;
  }
}

template <class S>
__global__ void LayerNormForwardKernel(S* out, float* mean, float* rstd,
                                       const float* inp, const S* w, const S* b,
                                       int N, int C) {
  const size_t n = GlobalWarp();
  const int lane = threadIdx.x % 32;
  if (n >= size_t(N)) return;
  const float* x = inp + n * C;
  float sum = 0.0f;
  for (int i = lane; i < C; i += 32) sum += x[i];
  const float m = WarpSum(sum) / C;
  float var = 0.0f;
  for (int i = lane; i < C; i += 32) var += (x[i] - m) * (x[i] - m);
  const float s = rsqrtf(WarpSum(var) / C + 1e-5f);
  for (int i = lane; i < C; i += 32) {
    Put(out + n * C + i, (x[i] - m) * s * ToFloat(w[i]) + ToFloat(b[i]));
  }
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = s;
  }
}

template <class S>
__global__ void LayerNormBackwardKernel(float* dinp, const float* dout,
                                        const float* inp, const S* w,
                                        const float* mean, const float* rstd,
                                        int N, int C) {
  const size_t n = GlobalWarp();
  const int lane = threadIdx.x % 32;
  if (n >= size_t(N)) return;
  const float* x = inp + n * C;
  const float* d = dout + n * C;
  const float m = mean[n], s = rstd[n];
  float a = 0.0f, b = 0.0f;
  for (int i = lane; i < C; i += 32) {
    const float dn = d[i] * ToFloat(w[i]);
    a += dn;
    b += dn * (x[i] - m) * s;
  }
  a = WarpSum(a) / C;
  b = WarpSum(b) / C;
  for (int i = lane; i < C; i += 32) {
    const float dn = d[i] * ToFloat(w[i]);
    dinp[n * C + i] += (dn - a - (x[i] - m) * s * b) * s;
  }
}

constexpr int kRowSplits = 32;

// out[c] += sum over this block's rows of dout[n, c] (* xhat when mean is
// not null). grid: (column blocks, kRowSplits). REQUIRES: out zeroed.
__global__ void ColumnSumKernel(float* out, const float* dout, const float* inp,
                                const float* mean, const float* rstd, int N,
                                int OC) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= OC) return;
  const int per = (N + kRowSplits - 1) / kRowSplits;
  const int n0 = blockIdx.y * per, n1 = min(N, n0 + per);
  float acc = 0.0f;
  for (int n = n0; n < n1; ++n) {
    const size_t i = size_t(n) * OC + c;
    acc += mean ? dout[i] * (inp[i] - mean[n]) * rstd[n] : dout[i];
  }
  atomicAdd(out + c, acc);
}

cudaError_t ColumnSum(cudaStream_t s, float* out, const float* dout,
                      const float* inp, const float* mean, const float* rstd,
                      int N, int OC) {
  cudaError_t e = cudaMemsetAsync(out, 0, sizeof(float) * OC, s);
  if (e != cudaSuccess) return e;
  dim3 grid((OC + kThreads - 1) / kThreads, kRowSplits);
  ColumnSumKernel<<<grid, kThreads, 0, s>>>(out, dout, inp, mean, rstd, N, OC);
  return cudaGetLastError();
}

template <class S>
__global__ void AddBiasKernel(float* out, const float* res, const S* bias,
                              int OC, size_t total) {
  GRID_STRIDE(i, total) {
    out[i] = (res ? res[i] : 0.0f) + ToFloat(bias[i % OC]);
  }
}

constexpr float kGeluScale = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

template <class S>
__global__ void GeluForwardKernel(S* out, const float* inp, size_t n) {
  GRID_STRIDE(i, n) {
    const float x = inp[i];
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    Put(out + i, 0.5f * x * (1.0f + tanhf(u)));
  }
}

__global__ void GeluBackwardKernel(float* d, const float* inp, size_t n) {
  GRID_STRIDE(i, n) {
    const float x = inp[i];
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    const float th = tanhf(u);
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    d[i] *= 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
  }
}

// The (b, h, t) row of attention that this warp computes, and where its
// head's q, k and v start (base: q of t = 0; k at + C, v at + 2C).
struct AttnRow {
  __device__ AttnRow(const float* qkv, int T, int C, int NH)
      : row(GlobalWarp()),
        lane(threadIdx.x % 32),
        hs(C / NH),
        t(row % T),
        h((row / T) % NH),
        b(row / (size_t(T) * NH)),
        C3(3 * size_t(C)),
        scale(rsqrtf(static_cast<float>(C / NH))),
        base(qkv + b * T * C3 + h * hs) {}
  size_t row;
  int lane, hs;
  size_t t, h, b, C3;
  float scale;
  const float* base;
};

// One warp per (b, h, t).
template <class S>
__global__ void AttentionForwardKernel(S* out, float* att, const float* qkv,
                                       int B, int T, int C, int NH) {
  const AttnRow r(qkv, T, C, NH);
  if (r.row >= size_t(B) * NH * T) return;
  const int hs = r.hs, lane = r.lane;
  const size_t row = r.row, t = r.t, b = r.b, h = r.h, C3 = r.C3;
  const float scale = r.scale;
  const float* base = r.base;
  const float* q = base + t * C3;
  float* a = att + row * T;
  float mx = -INFINITY;
  for (size_t s = lane; s <= t; s += 32) {
    const float* k = base + s * C3 + C;
    float dot = 0.0f;
    for (int i = 0; i < hs; ++i) dot += q[i] * k[i];
    a[s] = dot * scale;
    mx = fmaxf(mx, a[s]);
  }
  mx = WarpMax(mx);
  float sum = 0.0f;
  for (size_t s = lane; s <= t; s += 32) {
    a[s] = expf(a[s] - mx);
    sum += a[s];
  }
  const float inv = 1.0f / WarpSum(sum);
  for (size_t s = lane; s < size_t(T); s += 32)
    a[s] = s <= t ? a[s] * inv : 0.0f;
  __syncwarp();
  for (int i = lane; i < hs; i += 32) {
    float acc = 0.0f;
    for (size_t s = 0; s <= t; ++s) acc += a[s] * base[s * C3 + 2 * C + i];
    Put(out + (b * T + t) * C + h * hs + i, acc);
  }
}

// One warp per (b, h, t); dk, dv and dq gather with atomics. REQUIRES: dqkv
// zeroed.
__global__ void AttentionBackwardKernel(float* dqkv, const float* dout,
                                        const float* qkv, const float* att,
                                        int B, int T, int C, int NH) {
  const AttnRow r(qkv, T, C, NH);
  if (r.row >= size_t(B) * NH * T) return;
  const int hs = r.hs, lane = r.lane;
  const size_t row = r.row, t = r.t, b = r.b, h = r.h, C3 = r.C3;
  const float scale = r.scale;
  const float* base = r.base;
  float* dbase = dqkv + (base - qkv);
  const float* d = dout + (b * T + t) * C + h * hs;
  const float* a = att + row * T;
  const float* q = base + t * C3;
  float pdp = 0.0f;
  for (size_t s = lane; s <= t; s += 32) {
    const float* v = base + s * C3 + 2 * C;
    float dp = 0.0f;
    for (int i = 0; i < hs; ++i) dp += d[i] * v[i];
    pdp += a[s] * dp;
  }
  pdp = WarpSum(pdp);
  for (size_t s = lane; s <= t; s += 32) {
    const float* k = base + s * C3 + C;
    const float* v = base + s * C3 + 2 * C;
    float dp = 0.0f;
    for (int i = 0; i < hs; ++i) dp += d[i] * v[i];
    const float ds = a[s] * (dp - pdp) * scale;
    for (int i = 0; i < hs; ++i) {
      atomicAdd(dbase + t * C3 + i, ds * k[i]);
      atomicAdd(dbase + s * C3 + C + i, ds * q[i]);
      atomicAdd(dbase + s * C3 + 2 * C + i, a[s] * d[i]);
    }
  }
}

__device__ float BlockReduce(float v, bool is_max) {
  __shared__ float shared[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = is_max ? WarpMax(v) : WarpSum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? shared[lane] : (is_max ? -INFINITY : 0.0f);
  return is_max ? WarpMax(v) : WarpSum(v);
}

// One block per row.
template <class S>
__global__ void CrossEntropyKernel(float* losses, S* dlogits,
                                   const float* logits, const int32_t* targets,
                                   int V, float dscale) {
  const size_t n = blockIdx.x;
  const float* l = logits + n * V;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, l[i]);
  mx = BlockReduce(mx, true);
  float sum = 0.0f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) sum += expf(l[i] - mx);
  sum = BlockReduce(sum, false);
  const int tgt = targets[n];
  if (threadIdx.x == 0) losses[n] = logf(sum) - (l[tgt] - mx);
  if (dlogits == nullptr) return;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float p = expf(l[i] - mx) / sum;
    Put(dlogits + n * V + i, (p - (i == tgt ? 1.0f : 0.0f)) * dscale);
  }
}

}  // namespace

cudaError_t EncoderForward(cudaStream_t s, float* out, const int32_t* tokens,
                           const void* wte, const void* wpe, DType wt, int B,
                           int T, int C) {
  return WithType(wt, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    const size_t total = size_t(B) * T * C;
    EncoderForwardKernel<<<Blocks(total), kThreads, 0, s>>>(
        out, tokens, static_cast<const S*>(wte), static_cast<const S*>(wpe), T,
        C, total);
    return cudaGetLastError();
  });
}

cudaError_t EncoderBackward(cudaStream_t s, float* dwte, float* dwpe,
                            const float* dout, const int32_t* tokens, int B,
                            int T, int C) {
  EncoderBackwardKernel<<<Blocks(size_t(T) * C), kThreads, 0, s>>>(
      dwte, dwpe, dout, tokens, B, T, C);
  return cudaGetLastError();
}

cudaError_t LayerNormForward(cudaStream_t s, void* out, float* mean,
                             float* rstd, const float* inp, const void* w,
                             const void* b, DType wt, int N, int C) {
  return WithType(wt, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    LayerNormForwardKernel<<<WarpBlocks(N), kThreads, 0, s>>>(
        static_cast<S*>(out), mean, rstd, inp, static_cast<const S*>(w),
        static_cast<const S*>(b), N, C);
    return cudaGetLastError();
  });
}

cudaError_t LayerNormBackward(cudaStream_t s, float* dinp, float* dw, float* db,
                              const float* dout, const float* inp,
                              const void* w, DType wt, const float* mean,
                              const float* rstd, int N, int C) {
  cudaError_t e = WithType(wt, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    LayerNormBackwardKernel<<<WarpBlocks(N), kThreads, 0, s>>>(
        dinp, dout, inp, static_cast<const S*>(w), mean, rstd, N, C);
    return cudaGetLastError();
  });
  if (e != cudaSuccess) return e;
  e = ColumnSum(s, dw, dout, inp, mean, rstd, N, C);
  if (e != cudaSuccess) return e;
  return ColumnSum(s, db, dout, nullptr, nullptr, nullptr, N, C);
}

cudaError_t AddBias(cudaStream_t s, float* out, const float* res,
                    const void* bias, DType wt, int N, int OC) {
  return WithType(wt, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    const size_t total = size_t(N) * OC;
    AddBiasKernel<<<Blocks(total), kThreads, 0, s>>>(
        out, res, static_cast<const S*>(bias), OC, total);
    return cudaGetLastError();
  });
}

cudaError_t BiasGrad(cudaStream_t s, float* db, const float* dout, int N,
                     int OC) {
  return ColumnSum(s, db, dout, nullptr, nullptr, nullptr, N, OC);
}

cudaError_t GeluForward(cudaStream_t s, void* out, const float* inp, DType wt,
                        size_t n) {
  return WithType(wt, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    GeluForwardKernel<<<Blocks(n), kThreads, 0, s>>>(static_cast<S*>(out), inp,
                                                     n);
    return cudaGetLastError();
  });
}

cudaError_t GeluBackward(cudaStream_t s, float* dinout, const float* inp,
                         size_t n) {
  GeluBackwardKernel<<<Blocks(n), kThreads, 0, s>>>(dinout, inp, n);
  return cudaGetLastError();
}

cudaError_t AttentionForward(cudaStream_t s, void* out, float* att,
                             const float* qkv, DType wt, int B, int T, int C,
                             int NH) {
  return WithType(wt, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    AttentionForwardKernel<<<WarpBlocks(size_t(B) * NH * T), kThreads, 0, s>>>(
        static_cast<S*>(out), att, qkv, B, T, C, NH);
    return cudaGetLastError();
  });
}

cudaError_t AttentionBackward(cudaStream_t s, float* dqkv, const float* dout,
                              const float* qkv, const float* att, int B, int T,
                              int C, int NH) {
  cudaError_t e =
      cudaMemsetAsync(dqkv, 0, sizeof(float) * size_t(B) * T * 3 * C, s);
  if (e != cudaSuccess) return e;
  AttentionBackwardKernel<<<WarpBlocks(size_t(B) * NH * T), kThreads, 0, s>>>(
      dqkv, dout, qkv, att, B, T, C, NH);
  return cudaGetLastError();
}

cudaError_t CrossEntropy(cudaStream_t s, float* losses, void* dlogits,
                         const float* logits, const int32_t* targets, DType wt,
                         int N, int V, float dscale) {
  return WithType(wt, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    CrossEntropyKernel<<<N, kThreads, 0, s>>>(losses, static_cast<S*>(dlogits),
                                              logits, targets, V, dscale);
    return cudaGetLastError();
  });
}

}  // namespace finetune::cuda
