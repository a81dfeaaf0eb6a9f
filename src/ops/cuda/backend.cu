// The CUDA backend object: device memory through cudaMalloc, the op list's entries forwarded to
// this folder's kernels.
#include <memory>
#include <mutex>
#include <vector>

#include "ops/cuda/collectives.h"
#include "ops/cuda/cuda.h"
#include "ops/cuda/cuda_ops.h"

namespace apus {

namespace cuda {

void check(cudaError_t e, const char* what) {
  APUS_CHECK(e == cudaSuccess, "cuda: ", what, ": ", cudaGetErrorString(e));
}

cudaStream_t stream() { return cudaStreamPerThread; }

}  // namespace cuda

namespace {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int ordinal) : Backend("cuda:" + std::to_string(ordinal), Device::cuda, ordinal) {}
  void* allocate(size_t bytes) override {
    select();
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    APUS_CHECK(e == cudaSuccess, name(), ": out of device memory allocating ", bytes, " bytes (", cudaGetErrorString(e),
               ")");
    return p;
  }
  void release(void* p) override {
    select();
    cudaFree(p);
  }
  Tensor upload(const Tensor& host) override { return to_device(*this, host); }
  void upload_into(const Tensor& host, Tensor& to) override {
    APUS_CHECK(host.device == Device::cpu && host.contiguous() && to.device == Device::cuda && to.contiguous() &&
                   host.nbytes() == to.nbytes(),
               "upload_into: expected a contiguous host tensor and a device tensor of its bytes, got ",
               shape_str(host.shape), " and ", shape_str(to.shape));
    select();
    // From pageable memory the runtime stages the bytes before returning, without waiting for the
    // stream (CUDA's API synchronisation notes); the copy itself runs in the stream's order. While
    // a step's graph is recorded, from a pinned copy the graph reads when it runs.
    cuda::check(cudaMemcpyAsync(to.data, cuda::host_source(host.data, host.nbytes()), host.nbytes(),
                                cudaMemcpyHostToDevice, cuda::stream()),
                "stage host data on the device");
  }
  bool begin_graph() override {
    select();
    return cuda::begin_graph();
  }
  void launch_graph() override { cuda::launch_graph(); }
  int mark_queue() override {
    select();
    return cuda::mark_queue();
  }
  void wait_for_mark(int slot) override {
    select();
    cuda::wait_for_mark(slot);
  }
  void abandon_graph() noexcept override { cuda::abandon_graph(); }
  Tensor download(const Tensor& t) override {
    cuda::refuse_wait_in_graph("a download to the host");
    Tensor host = to_host(t);
    host.encoding = encoding_off(*this, t.encoding);
    return host;
  }
  void synchronize() override {
    cuda::refuse_wait_in_graph("a wait for the queued ops");
    select();
    cuda::check(cudaStreamSynchronize(cuda::stream()), "finish the queued ops");
  }
  double memory_bytes() const override {
    select();
    size_t free = 0, total = 0;
    cuda::check(cudaMemGetInfo(&free, &total), "read the device's memory size");
    return double(total);
  }
  std::string refuses(Products p) const override {
    if (p != Products::fp8) return {};
    select();
    cudaDeviceProp d{};
    cuda::check(cudaGetDeviceProperties(&d, ordinal()), "read the device's properties");
    if (10 * d.major + d.minor >= 89) return {};
    return "--quant fp8 needs a GPU with fp8 tensor cores (compute capability 8.9 or later: Ada, Hopper); " + name() +
           " (" + d.name + ") is sm_" + std::to_string(d.major) + std::to_string(d.minor) + ": use --quant int8";
  }
  std::string hardware() const override {
    select();
    cudaDeviceProp p{};
    cuda::check(cudaGetDeviceProperties(&p, ordinal()), "read the device's properties");
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
           std::to_string(p.multiProcessorCount) + " SMs) | CUDA runtime " + std::to_string(runtime) + ", driver " +
           std::to_string(driver);
  }
  void all_gather(const ProcessGroup& group, void* data, const std::vector<size_t>& bytes, const char* what) override {
    cuda::all_gather(ordinal(), group, data, bytes, what);
  }
  void all_to_all(const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes, const char* what) override {
    cuda::all_to_all(ordinal(), group, send, send_bytes, recv, recv_bytes, what);
  }
  bool exchanges(std::string* why) const override { return cuda::nccl_usable(why); }
#define APUS_CUDA_OP(ret, name, params, args) \
  ret name params override {                  \
    select();                                 \
    return cuda::name args;                   \
  }
  APUS_OPS(APUS_CUDA_OP)
#undef APUS_CUDA_OP

 private:
  void select() const { cuda::check(cudaSetDevice(ordinal()), "select the device"); }
};

// A kernel that does nothing: whether this build holds code the device can run (SASS for its
// architecture, or PTX it can compile) is whether the runtime finds an image of it.
__global__ void image_probe_kernel() {}

// A CUDA version number (12040) as its users write it (12.4).
std::string cuda_version(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

}  // namespace

bool cuda_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) return true;
  if (why) {
    // The runtime's error alone ("driver version is insufficient") reads as an old driver when
    // usually there is none: the driver's version (0: none loaded) tells which.
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    *why = std::string("no usable CUDA GPU (") +
           (e != cudaSuccess ? std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e) : "no CUDA device found") +
           "; " +
           (driver == 0 ? std::string("no NVIDIA driver is loaded")
                        : "the driver supports CUDA " + cuda_version(driver) + ", this build's runtime is " +
                              cuda_version(runtime)) +
           ")";
  }
  return false;
}

std::string cuda_libraries() {
  std::string names = "cuBLASLt";
#if APUS_HAS_CUDNN
  names += ", cuDNN";
#endif
#if APUS_HAS_NCCL
  names += ", NCCL";
#endif
  return names;
}

int cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

Backend& cuda_backend(int ordinal) {
  std::string why;
  APUS_CHECK(cuda_available(&why), "device cuda:", ordinal, ": ", why);
  int n = 0;
  cuda::check(cudaGetDeviceCount(&n), "count devices");
  APUS_CHECK(ordinal >= 0 && ordinal < n, "cuda:", ordinal, ": this machine has ", n, " CUDA device(s)");
  static std::mutex mutex;
  static std::vector<std::unique_ptr<CudaBackend>> backends;
  std::lock_guard<std::mutex> lock(mutex);
  if (backends.size() < size_t(n)) backends.resize(size_t(n));
  if (!backends[size_t(ordinal)]) {
    // A GPU this build has no code for (older than Ampere, or left out of CMAKE_CUDA_ARCHITECTURES)
    // is refused here, naming it, not at the first kernel's launch.
    cuda::check(cudaSetDevice(ordinal), "select the device");
    cudaDeviceProp prop{};
    cuda::check(cudaGetDeviceProperties(&prop, ordinal), "read the device's properties");
    cudaFuncAttributes attributes{};
    const cudaError_t image = cudaFuncGetAttributes(&attributes, image_probe_kernel);
    cudaGetLastError();  // the probe's error is this check's, not the next launch's to report
    APUS_CHECK(image == cudaSuccess, "cuda:", ordinal, " (", prop.name, ", compute capability ", prop.major, ".",
               prop.minor, "): this build has no kernels it can run (", cudaGetErrorString(image),
               "); apus's CUDA kernels need compute capability 8.0 or later and a build whose "
               "CMAKE_CUDA_ARCHITECTURES covers it (" APUS_CUDA_ARCHITECTURES ")");
    backends[size_t(ordinal)] = std::make_unique<CudaBackend>(ordinal);
  }
  return *backends[size_t(ordinal)];
}

Tensor to_device(Backend& backend, const Tensor& host) {
  APUS_CHECK(host.device == Device::cpu && host.contiguous(), "to_device: expected a contiguous host tensor, got ",
             shape_str(host.shape));
  Tensor t = Tensor::allocate(backend, host.shape, host.dtype);
  cuda::check(cudaMemcpy(t.data, host.data, host.nbytes(), cudaMemcpyHostToDevice), "copy to the device");
  t.encoding = encoding_on(backend, host.encoding);
  return t;
}

Tensor to_host(const Tensor& device) {
  APUS_CHECK(device.device == Device::cuda && device.contiguous(), "to_host: expected a contiguous device tensor, got ",
             shape_str(device.shape));
  cuda::check(cudaStreamSynchronize(cuda::stream()), "finish the queued ops");
  Tensor t = Tensor::heap(device.shape, device.dtype);
  cuda::check(cudaMemcpy(t.data, device.data, device.nbytes(), cudaMemcpyDeviceToHost), "copy to the host");
  return t;
}

}  // namespace apus
