// conv2d through cuDNN (cuda.conv=cudnn): its implicit-GEMM kernels read the input where it lies,
// where the im2col arm writes every output pixel's receptive field out first (klein's VAE at
// 1024x1024: 47 TFLOP/s on the H200, docs/SPEED.md session 21). cuDNN is opened at the first such
// conv (libcudnn.so.9: the toolkit's, or the one PyTorch's wheels bring), as cuBLASLt is.
//
// The contract's numerics: fp32 sums (bf16 on tensor cores, f32 on FMAs, never TF32), the
// algorithms restricted to the GEMM-like ones (no Winograd or FFT, whose transforms round
// otherwise), and the bias added in fp32 before the one rounding: y is filled with the bias first
// and cuDNN computes y = conv + 1 * y in its fp32 epilogue.
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "core/variants.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/device.cuh"
#include "ops/cuda/loaded_library.h"

#if APUS_HAS_CUDNN
#include <cudnn.h>
#endif

namespace apus::cuda {

#if APUS_HAS_CUDNN

namespace {

struct Dnn {
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnGetErrorString) error_string = nullptr;
  decltype(&cudnnCreateTensorDescriptor) tensor_create = nullptr;
  decltype(&cudnnSetTensor4dDescriptor) tensor_set = nullptr;
  decltype(&cudnnDestroyTensorDescriptor) tensor_destroy = nullptr;
  decltype(&cudnnCreateFilterDescriptor) filter_create = nullptr;
  decltype(&cudnnSetFilter4dDescriptor) filter_set = nullptr;
  decltype(&cudnnDestroyFilterDescriptor) filter_destroy = nullptr;
  decltype(&cudnnCreateConvolutionDescriptor) conv_create = nullptr;
  decltype(&cudnnSetConvolution2dDescriptor) conv_set = nullptr;
  decltype(&cudnnSetConvolutionMathType) conv_math = nullptr;
  decltype(&cudnnDestroyConvolutionDescriptor) conv_destroy = nullptr;
  decltype(&cudnnGetConvolutionForwardAlgorithm_v7) algorithms = nullptr;
  decltype(&cudnnGetConvolutionForwardWorkspaceSize) workspace = nullptr;
  decltype(&cudnnConvolutionForward) forward = nullptr;
  cudnnHandle_t handle = nullptr;

  Dnn() {
    LoadedLibrary lib("cuDNN", {"libcudnn.so.9", "libcudnn.so"});
    lib.function(create, "cudnnCreate");
    lib.function(set_stream, "cudnnSetStream");
    lib.function(error_string, "cudnnGetErrorString");
    lib.function(tensor_create, "cudnnCreateTensorDescriptor");
    lib.function(tensor_set, "cudnnSetTensor4dDescriptor");
    lib.function(tensor_destroy, "cudnnDestroyTensorDescriptor");
    lib.function(filter_create, "cudnnCreateFilterDescriptor");
    lib.function(filter_set, "cudnnSetFilter4dDescriptor");
    lib.function(filter_destroy, "cudnnDestroyFilterDescriptor");
    lib.function(conv_create, "cudnnCreateConvolutionDescriptor");
    lib.function(conv_set, "cudnnSetConvolution2dDescriptor");
    lib.function(conv_math, "cudnnSetConvolutionMathType");
    lib.function(conv_destroy, "cudnnDestroyConvolutionDescriptor");
    lib.function(algorithms, "cudnnGetConvolutionForwardAlgorithm_v7");
    lib.function(workspace, "cudnnGetConvolutionForwardWorkspaceSize");
    lib.function(forward, "cudnnConvolutionForward");
    APUS_CHECK(lib.missing().empty(), "cuda.conv=cudnn: ", lib.missing(), " (version 9 is needed)");
    check_dnn(create(&handle), "cudnnCreate");
  }
  void check_dnn(cudnnStatus_t s, const char* call) const {
    APUS_CHECK(s == CUDNN_STATUS_SUCCESS, "cuDNN ", call, ": ", error_string ? error_string(s) : "failed");
  }
};

// One handle, made on the first conv's device: enough for one GPU (as cuBLASLt's).
Dnn& dnn() {
  static Dnn instance;
  return instance;
}

// The descriptors of one conv, destroyed with it (they are host objects: cheap to make).
struct Descriptors {
  const Dnn& d;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  explicit Descriptors(const Dnn& dnn) : d(dnn) {
    d.check_dnn(d.tensor_create(&x), "cudnnCreateTensorDescriptor");
    d.check_dnn(d.tensor_create(&y), "cudnnCreateTensorDescriptor");
    d.check_dnn(d.filter_create(&w), "cudnnCreateFilterDescriptor");
    d.check_dnn(d.conv_create(&conv), "cudnnCreateConvolutionDescriptor");
  }
  ~Descriptors() {
    d.tensor_destroy(x);
    d.tensor_destroy(y);
    d.filter_destroy(w);
    d.conv_destroy(conv);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
};

// n, ci, h, w, co, k, stride, pad, dtype
using ConvKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int>;

// The fastest GEMM-like algorithm cuDNN's heuristic offers for the shape, chosen once and kept.
cudnnConvolutionFwdAlgo_t algorithm(const Dnn& d, const Descriptors& s, const ConvKey& key) {
  static std::mutex mutex;
  static std::map<ConvKey, cudnnConvolutionFwdAlgo_t> chosen;
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = chosen.find(key);
  if (found != chosen.end()) return found->second;
  cudnnConvolutionFwdAlgoPerf_t offered[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  int count = 0;
  d.check_dnn(d.algorithms(d.handle, s.x, s.w, s.conv, s.y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &count, offered),
              "cudnnGetConvolutionForwardAlgorithm_v7");
  for (int i = 0; i < count; ++i) {
    const cudnnConvolutionFwdAlgo_t a = offered[i].algo;
    const bool gemm_like = a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM ||
                           a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM ||
                           a == CUDNN_CONVOLUTION_FWD_ALGO_GEMM;
    if (offered[i].status == CUDNN_STATUS_SUCCESS && gemm_like) return chosen.emplace(key, a).first->second;
  }
  fail("cuda.conv=cudnn: cuDNN offers no GEMM-like algorithm for a ", std::get<1>(key), "->", std::get<4>(key),
       " channel ", std::get<5>(key), "x", std::get<5>(key), " conv on ", std::get<2>(key), "x", std::get<3>(key));
}

// y[b][o][p] = bias[o]: what cuDNN's epilogue adds to the sum before rounding it once.
__global__ void fill_bias_kernel(const void* bias, void* y, DType dt, int64_t co, int64_t pixels, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    store(dt, y, i, load(dt, bias, i / pixels % co));
}

// w [co, K] converted to dt.
__global__ void convert_kernel(const void* w, DType wt, void* out, DType dt, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    store(dt, out, i, load(wt, w, i));
}

}  // namespace

bool cudnn_conv_takes(const Tensor& x, const Tensor* bias, int64_t pad, int64_t pad_end) {
  return pad == pad_end && (x.dtype == DType::bf16 || x.dtype == DType::f32) && (!bias || bias->dtype == x.dtype);
}

void conv2d_by_cudnn(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, int64_t stride,
                     int64_t pad) {
  const int64_t n = x.shape[0], ci = x.shape[1], h = x.shape[2], wd = x.shape[3], co = w.shape[0], k = w.shape[2];
  const int64_t oh = y.shape[2], ow = y.shape[3];
  APUS_CHECK(n <= INT32_MAX && ci <= INT32_MAX && h <= INT32_MAX && wd <= INT32_MAX && co <= INT32_MAX,
             "cuda.conv=cudnn: a ", shape_str(x.shape), " input is beyond cuDNN's int dimensions");
  Dnn& d = dnn();
  d.check_dnn(d.set_stream(d.handle, stream()), "cudnnSetStream");
  const bool bf16 = x.dtype == DType::bf16;
  const cudnnDataType_t dt = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  Descriptors s(d);
  d.check_dnn(d.tensor_set(s.x, CUDNN_TENSOR_NCHW, dt, int(n), int(ci), int(h), int(wd)), "cudnnSetTensor4dDescriptor");
  d.check_dnn(d.tensor_set(s.y, CUDNN_TENSOR_NCHW, dt, int(n), int(co), int(oh), int(ow)),
              "cudnnSetTensor4dDescriptor");
  d.check_dnn(d.filter_set(s.w, dt, CUDNN_TENSOR_NCHW, int(co), int(ci), int(k), int(k)), "cudnnSetFilter4dDescriptor");
  d.check_dnn(
      d.conv_set(s.conv, int(pad), int(pad), int(stride), int(stride), 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
      "cudnnSetConvolution2dDescriptor");
  // bf16 on tensor cores; f32 on FMAs only (cuDNN's default math allows TF32 there, a coarser sum).
  d.check_dnn(d.conv_math(s.conv, bf16 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH), "cudnnSetConvolutionMathType");
  const cudnnConvolutionFwdAlgo_t algo = algorithm(d, s, {n, ci, h, wd, co, k, stride, pad, int(x.dtype)});
  size_t bytes = 0;
  d.check_dnn(d.workspace(d.handle, s.x, s.w, s.conv, s.y, algo, &bytes), "cudnnGetConvolutionForwardWorkspaceSize");
  ArenaScope scope(*c.arena);
  const Tensor workspace = Tensor::in(*c.arena, {std::max<int64_t>(1, int64_t(bytes))}, DType::i8);
  const void* weights = w.data;
  if (w.dtype != x.dtype) {
    const Tensor converted = Tensor::in(*c.arena, w.shape, x.dtype);
    convert_kernel<<<blocks_for(w.numel()), kThreads, 0, stream()>>>(w.data, w.dtype, converted.data, x.dtype,
                                                                     w.numel());
    weights = converted.data;
  }
  if (bias)
    fill_bias_kernel<<<blocks_for(y.numel()), kThreads, 0, stream()>>>(bias->data, y.data, y.dtype, co, oh * ow,
                                                                       y.numel());
  check(cudaGetLastError(), "conv2d kernels launch");
  const float alpha = 1.0f, beta = bias ? 1.0f : 0.0f;
  d.check_dnn(
      d.forward(d.handle, &alpha, s.x, x.data, s.w, weights, s.conv, algo, workspace.data, bytes, &beta, s.y, y.data),
      "cudnnConvolutionForward");
}

#else

bool cudnn_conv_takes(const Tensor&, const Tensor*, int64_t, int64_t) { return true; }

void conv2d_by_cudnn(Context&, const Tensor&, const Tensor&, const Tensor*, Tensor&, int64_t, int64_t) {
  fail("cuda.conv=cudnn: this build found no cudnn.h (cuDNN's headers) when it was configured");
}

#endif

}  // namespace apus::cuda
