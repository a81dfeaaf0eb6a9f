#pragma once
// A device whose memory the host cannot touch, for proving on a machine without a GPU that a
// pipeline keeps the device discipline a GPU needs: every host-built input staged through
// ops::to_context / host_filled, every result brought back through ops::to_host, no host code
// reading or writing device memory on the way.
//
// It poses as CUDA device 99. Each allocation reserves twice its size: the first half, handed out,
// is mapped without access, so a host read or write of it faults (and the handler names the
// address as device memory); the second half holds the data. Its ops run the CPU backend's on the
// second halves, so a pipeline on it computes exactly what it computes on the CPU, byte for byte.
//
// It records graphs as a GPU does (Backend::begin_graph): the ops of a recorded step are kept with
// their operands as they were called and run only at launch_graph, so a step that leaned on
// running as it is called (a host read of a result inside it, an operand that changed or died
// before the launch, an allocation or a synchronous copy) computes something else there or is
// refused by name, as a CUDA graph's capture would refuse it.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "apus/apus.h"
#include "core/error.h"
#include "core/scaled_codes.h"
#include "ops/backend.h"
#include "ops/ops.h"

namespace apus::test {

class ShadowDevice : public Backend {
 public:
  static constexpr int kOrdinal = 99;

  ShadowDevice() : Backend("shadow", Device::cuda, kOrdinal) {
    struct sigaction action {};
    action.sa_sigaction = &ShadowDevice::on_fault;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, nullptr);
  }

  void* allocate(size_t bytes) override {
    const size_t page = size_t(sysconf(_SC_PAGESIZE)), size = (bytes + page - 1) / page * page;
    char* base = static_cast<char*>(mmap(nullptr, 2 * size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    APUS_CHECK(base != MAP_FAILED, "shadow device: out of address space for ", bytes, " bytes");
    APUS_CHECK(mprotect(base + size, size, PROT_READ | PROT_WRITE) == 0, "shadow device: mprotect failed");
    std::lock_guard<std::mutex> lock(mutex_);
    regions_[uintptr_t(base)] = size;
    ++allocations_;
    return base;
  }
  void release(void* p) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = regions_.find(uintptr_t(p));
    APUS_CHECK(it != regions_.end(), "shadow device: release of memory it did not hand out");
    munmap(p, 2 * it->second);
    regions_.erase(it);
  }

  Tensor upload(const Tensor& host) override {
    APUS_CHECK(!recording_, "shadow device: an upload (an allocation and a synchronous copy) inside a recorded step");
    APUS_CHECK(host.device == Device::cpu && host.contiguous(), "shadow upload: expected a contiguous host tensor");
    Tensor t = Tensor::allocate(*this, host.shape, host.dtype);
    std::memcpy(on_host(t.data), host.data, host.nbytes());
    t.encoding = encoding_on(*this, host.encoding);
    return t;
  }
  void upload_into(const Tensor& host, Tensor& to) override {
    APUS_CHECK(host.device == Device::cpu && host.contiguous() && to.device == Device::cuda && to.ordinal == kOrdinal &&
                   to.contiguous() && host.nbytes() == to.nbytes(),
               "shadow upload_into: expected a contiguous host tensor and a shadow tensor of its bytes");
    if (!recording_) {
      std::memcpy(on_host(to.data), host.data, host.nbytes());
      return;
    }
    // A GPU's graph copies from pinned memory kept for it: the bytes as they were at the call.
    auto kept = std::make_shared<std::vector<char>>(static_cast<const char*>(host.data),
                                                    static_cast<const char*>(host.data) + host.nbytes());
    void* data = to.data;
    recorded_.push_back([this, kept, data] { std::memcpy(on_host(data), kept->data(), kept->size()); });
  }
  Tensor download(const Tensor& t) override {
    APUS_CHECK(!recording_, "shadow device: a download (a host read) inside a recorded step");
    APUS_CHECK(t.device == Device::cuda && t.ordinal == kOrdinal && t.contiguous(),
               "shadow download: expected a contiguous tensor of the shadow device");
    Tensor host = Tensor::heap(t.shape, t.dtype);
    std::memcpy(host.data, on_host(t.data), t.nbytes());
    host.encoding = encoding_off(*this, t.encoding);
    return host;
  }

  // A split's exchanges over its memory: the group's own (host) exchanges on the data halves, as
  // a GPU's NCCL moves device memory without the host reading it.
  void all_gather(const ProcessGroup& group, void* data, const std::vector<size_t>& bytes, const char* what) override {
    ++exchanges_run_;
    group.all_gather(on_host(data), bytes, what);
  }
  void all_to_all(const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes, const char* what) override {
    ++exchanges_run_;
    group.all_to_all(on_host(const_cast<void*>(send)), send_bytes, on_host(recv), recv_bytes, what);
  }
  bool exchanges(std::string*) const override { return true; }
  // Exchanges it has run, for tests to see that a split's exchanges went through the device.
  size_t exchanges_run() const { return exchanges_run_; }

  // The memory it reports (0: none of its own, the host's budget applies), for admission tests.
  double memory_bytes() const override { return memory_bytes_; }
  void set_memory_bytes(double bytes) { memory_bytes_ = bytes; }

  void synchronize() override {
    APUS_CHECK(!recording_, "shadow device: a wait for the device inside a recorded step");
  }

  bool begin_graph() override {
    APUS_CHECK(!recording_, "shadow device: a graph is already being recorded");
    recording_ = true;
    return true;
  }
  void launch_graph() override {
    recording_ = false;
    std::vector<std::function<void()>> ops;
    ops.swap(recorded_);
    for (auto& op : ops) op();
    ++graphs_launched_;
  }
  void abandon_graph() noexcept override {
    recording_ = false;
    recorded_.clear();
  }
  // Graphs it has launched, for tests to see that steps were recorded.
  size_t graphs_launched() const { return graphs_launched_; }
  // Queue marks, for tests to see how far ahead a host queues: its ops run as called, so a wait
  // is only counted.
  int mark_queue() override { return int(marks_made_++ % size_t(kQueueMarks)); }
  void wait_for_mark(int) override {
    APUS_CHECK(!recording_, "shadow device: a wait for a queue mark inside a recorded step");
    ++mark_waits_;
  }
  size_t mark_waits() const { return mark_waits_; }

  // Ops the device has run, for tests to see that work reached it.
  size_t ops_run() const { return ops_run_; }
  // Allocations of its memory so far (a GPU's cudaMalloc, whose release waits for the device).
  size_t allocations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allocations_;
  }

  // Whether p lies in the inaccessible half of one of the device's allocations.
  bool owns(const void* p) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return region_of(uintptr_t(p)) != regions_.end();
  }

 private:
  // A device tensor as the CPU backend sees it: the same view over the data half, on the host.
  struct HostView {
    Tensor tensor;
    bool set = false;
    operator Tensor&() { return tensor; }
    operator const Tensor*() { return set ? &tensor : nullptr; }
  };

  // Attention options whose key mask is a device tensor: the same options over its data half.
  struct HostOptions {
    ops::AttentionOptions options;
    HostView valid;
    operator const ops::AttentionOptions&() {
      options.key_valid = valid;
      return options;
    }
  };

  HostView view(const Tensor& t) const {
    HostView v{t, true};
    if (t.data) v.tensor.data = on_host(t.data);
    v.tensor.device = Device::cpu;
    v.tensor.ordinal = 0;
    v.tensor.owner = nullptr;
    if (t.encoding.block_scales) {  // a stored weight's factors, uploaded beside its codes
      auto scales = std::make_shared<BlockScales>(*t.encoding.block_scales);
      scales->factors = view(scales->factors);
      v.tensor.encoding.block_scales = std::move(scales);
    }
    return v;
  }
  template <typename T> decltype(auto) host(T&& operand) const {
    using Plain = std::remove_cv_t<std::remove_reference_t<T>>;
    if constexpr (std::is_same_v<Plain, Tensor>) return view(operand);
    else if constexpr (std::is_same_v<Plain, const Tensor*> || std::is_same_v<Plain, Tensor*>)
      return operand ? view(*operand) : HostView{};
    else if constexpr (std::is_same_v<Plain, ops::AttentionOptions>)
      return HostOptions{operand, operand.key_valid ? view(*operand.key_valid) : HostView{}};
    else return std::forward<T>(operand);
  }

  // An operand as a recorded op keeps it: tensors (and a key mask's) by value, as a graph keeps
  // the device addresses and sizes it was recorded with, never the host objects that held them.
  struct KeptOptions {
    ops::AttentionOptions options;
    std::optional<Tensor> valid;
  };
  template <typename T> static auto keep(T&& operand) {
    using Plain = std::remove_cv_t<std::remove_reference_t<T>>;
    if constexpr (std::is_same_v<Plain, const Tensor*> || std::is_same_v<Plain, Tensor*>)
      return operand ? std::optional<Tensor>(*operand) : std::optional<Tensor>();
    else if constexpr (std::is_same_v<Plain, ops::AttentionOptions>)
      return KeptOptions{operand, operand.key_valid ? std::optional<Tensor>(*operand.key_valid) : std::nullopt};
    else return Plain(operand);
  }
  template <typename T> static decltype(auto) unkeep(T& kept) {
    if constexpr (std::is_same_v<T, std::optional<Tensor>>) return kept ? &*kept : static_cast<const Tensor*>(nullptr);
    else if constexpr (std::is_same_v<T, KeptOptions>) {
      ops::AttentionOptions options = kept.options;
      options.key_valid = kept.valid ? &*kept.valid : nullptr;
      return options;
    } else return (kept);
  }

  // An op run now, or while a graph is recorded kept to run at its launch; an op answering the
  // host (all_finite) cannot be recorded.
  template <typename Ret, typename Run, typename... Operands>
  Ret dispatch(const char* op, const Context& c, Run run, Operands&&... operands) {
    ++ops_run_;
    Context inner = host_context(c);
    if (recording_) {
      if constexpr (std::is_void_v<Ret>) {
        recorded_.push_back([this, inner, run, kept = std::make_tuple(keep(operands)...)]() mutable {
          std::apply([&](auto&... k) { run(inner, host(unkeep(k))...); }, kept);
        });
        return;
      } else {
        APUS_CHECK(false, "shadow device: ", op, " answers the host inside a recorded step");
      }
    }
    return run(inner, host(operands)...);
  }

  Context host_context(const Context& c) {
    thread_local Arena scratch(size_t(16) << 20);
    Context inner = c;
    inner.arena = &scratch;
    inner.backend = &cpu_backend();
    inner.cost = nullptr;
    inner.trace = nullptr;
    return inner;
  }

  std::map<uintptr_t, size_t>::const_iterator region_of(uintptr_t p) const {
    auto it = regions_.upper_bound(p);
    if (it == regions_.begin()) return regions_.end();
    --it;
    return p < it->first + it->second ? it : regions_.end();
  }
  void* on_host(void* device) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = region_of(uintptr_t(device));
    APUS_CHECK(it != regions_.end(), "shadow device: an operand's memory is not the device's");
    return static_cast<char*>(device) + it->second;
  }

 public:
  // Every op: the CPU backend's, on the data halves, with a host scratch arena of its own.
#define APUS_SHADOW_OP(ret, name, params, args)                                                                        \
  ret name params override {                                                                                           \
    auto run = [](Context& inner, auto&&... operands) -> ret {                                                         \
      return cpu_backend().name(inner, std::forward<decltype(operands)>(operands)...);                                 \
    };                                                                                                                 \
    auto call = [&](Context& context, auto&&... operands) { return dispatch<ret>(#name, context, run, operands...); }; \
    return call args;                                                                                                  \
  }
  APUS_OPS(APUS_SHADOW_OP)
#undef APUS_SHADOW_OP

 private:
  static ShadowDevice* instance;
  static void on_fault(int, siginfo_t* info, void*) {
    // Not async-signal-safe in general (the map lookup takes no lock here on purpose: the faulting
    // thread may hold it); good enough to name the cause before the test dies.
    const auto p = uintptr_t(info->si_addr);
    bool device = false;
    if (instance) {
      const auto& regions = instance->regions_;
      const auto it = regions.upper_bound(p);
      device = it != regions.begin() && p < std::prev(it)->first + std::prev(it)->second;
    }
    char line[160];
    const int n =
        std::snprintf(line, sizeof line, "%s at %p\n",
                      device ? "host code touched shadow device memory" : "segmentation fault", info->si_addr);
    if (n > 0) (void)!write(2, line, size_t(n));
    signal(SIGSEGV, SIG_DFL);
    raise(SIGSEGV);
  }

  mutable std::mutex mutex_;
  std::map<uintptr_t, size_t> regions_;
  std::atomic<size_t> ops_run_{0}, exchanges_run_{0};
  size_t allocations_ = 0;
  std::atomic<double> memory_bytes_{0};
  bool recording_ = false;
  std::vector<std::function<void()>> recorded_;
  size_t graphs_launched_ = 0, marks_made_ = 0, mark_waits_ = 0;

  friend ShadowDevice& shadow_device();
};

inline ShadowDevice* ShadowDevice::instance = nullptr;

inline ShadowDevice& shadow_device() {
  static ShadowDevice device;
  ShadowDevice::instance = &device;
  return device;
}

}  // namespace apus::test
