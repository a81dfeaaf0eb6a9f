// 2-D convolution through oneDNN. Two layouts (a static knob, A/B-able in one process):
// plain runs on our NCHW tensors directly (oneDNN picks im2col + GEMM); blocked lets oneDNN
// choose its native layout (direct AVX512-BF16 kernels), reorders the activation in and out per
// call and keeps each weight reordered once.
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "core/error.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/dnnl_util.h"
#include "ops/cpu/rows.h"

namespace apus::cpu {

Knob conv_layout_knob("cpu.conv_layout",
                      "convs in oneDNN's blocked activation layout (reordered in and out) or in plain NCHW",
                      {"blocked", "plain"});

namespace {

dnnl::memory reorder_into(const dnnl::memory& from, const dnnl::memory::desc& to_desc, void* to_data) {
  dnnl::memory to(to_desc, dnnl_engine(), to_data);
  run_primitive(KernelKey("reorder", {}),
                [&] { dnnl::reorder(from, to).execute(dnnl_stream(), const_cast<dnnl::memory&>(from), to); });
  return to;
}

// Weights re-laid into oneDNN's blocked layout, one copy per (weight, kernel) shared by all
// threads. An entry remembers the weight's owner (its file mapping or heap block): once that is
// gone the entry is dropped, so a model mapped later at the same address never meets stale
// weights, and the cache never outlives what it was made from.
struct PackedEntry {
  std::weak_ptr<const void> owner;
  std::shared_ptr<void> buffer;
  dnnl::memory memory;
};

template <typename Reorder>
dnnl::memory packed_weights(const Tensor& w, const KernelKey& key, Reorder&& reorder, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, KernelKey>, PackedEntry> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto id = std::make_pair(static_cast<const void*>(w.data), key);
  auto it = cache.find(id);
  if (it == cache.end() || it->second.owner.owner_before(w.owner) || w.owner.owner_before(it->second.owner)) {
    // Entries of weights that are gone are dropped when the cache grows, not on every hit.
    for (auto e = cache.begin(); e != cache.end();) e = e->second.owner.expired() ? cache.erase(e) : std::next(e);
    std::shared_ptr<void> buf(std::aligned_alloc(64, (bytes + 63) & ~size_t(63)), std::free);
    APUS_CHECK(buf, "conv2d: out of memory re-laying a ", shape_str(w.shape), " weight");
    it = cache.insert_or_assign(id, PackedEntry{w.owner, buf, reorder(buf.get())}).first;
  }
  return it->second.memory;
}

}  // namespace

void conv2d(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, int64_t stride, int64_t pad,
            int64_t pad_end) {
  using namespace dnnl;
  using dims = memory::dims;
  APUS_CHECK(x.rank() == 4 && w.rank() == 4 && y.rank() == 4 && y.shape[0] == x.shape[0] && w.shape[1] == x.shape[1] &&
                 y.shape[1] == w.shape[0],
             "conv2d: x ", shape_str(x.shape), ", w ", shape_str(w.shape), ", y ", shape_str(y.shape));
  const int64_t kh = w.shape[2], kw = w.shape[3];
  APUS_CHECK(y.shape[2] == (x.shape[2] + pad + pad_end - kh) / stride + 1 &&
                 y.shape[3] == (x.shape[3] + pad + pad_end - kw) / stride + 1,
             "conv2d: output ", shape_str(y.shape), " does not match input ", shape_str(x.shape));
  ArenaScope scope(*c.arena);
  if (x.dtype == DType::bf16 && !native_bf16()) {
    // No bf16 convolution on this CPU: run it in f32 and round the result.
    const Tensor xf = as_dtype(*c.arena, x, DType::f32);
    Tensor yf = Tensor::in(*c.arena, y.shape, DType::f32);
    conv2d(c, xf, w, bias, yf, stride, pad, pad_end);
    const Tensor from = yf.reshape({y.numel() / y.shape.back(), y.shape.back()});
    Tensor to = y.reshape(from.shape);
    for (int64_t r = 0; r < from.shape[0]; ++r) store_row(to, r, from.ptr<float>() + r * from.shape[1], from.shape[1]);
    return;
  }
  const Tensor wx = as_dtype(*c.arena, w, x.dtype);
  const Tensor bx = bias ? as_dtype(*c.arena, *bias, DType::f32) : Tensor{};
  const auto dt = dnnl_type(x.dtype);
  const bool blocked = conv_layout_knob.value() == 0;
  conv_layout_knob.took(blocked ? 0 : 1);
  const memory::desc x_md(dims(x.shape.begin(), x.shape.end()), dt, memory::format_tag::nchw);
  const memory::desc w_md(dims(w.shape.begin(), w.shape.end()), dt, memory::format_tag::oihw);
  const memory::desc y_md(dims(y.shape.begin(), y.shape.end()), dnnl_type(y.dtype), memory::format_tag::nchw);
  const memory::desc b_md(dims{w.shape[0]}, memory::data_type::f32, memory::format_tag::x);
  auto any = [](const memory::desc& d) { return memory::desc(d.dims(), d.data_type(), memory::format_tag::any); };
  const KernelKey key(
      "conv", {x.shape[0], x.shape[1], x.shape[2], x.shape[3], w.shape[0], w.shape[2], w.shape[3], int64_t(x.dtype),
               int64_t(y.dtype), stride, pad, pad_end, bias ? 1 : 0, blocked ? 1 : 0});
  struct Conv {
    convolution_forward prim;
    convolution_forward::primitive_desc pd;
  };
  auto& conv = cached_primitive<Conv>(key, [&] {
    const dims strides{stride, stride}, padding{pad, pad}, padding_end{pad_end, pad_end};
    const auto xs = blocked ? any(x_md) : x_md, ws = blocked ? any(w_md) : w_md, ys = blocked ? any(y_md) : y_md;
    auto d = bias ? convolution_forward::desc(prop_kind::forward_inference, algorithm::convolution_direct, xs, ws, b_md,
                                              ys, strides, padding, padding_end)
                  : convolution_forward::desc(prop_kind::forward_inference, algorithm::convolution_direct, xs, ws, ys,
                                              strides, padding, padding_end);
    auto pd = convolution_forward::primitive_desc(d, dnnl_engine());
    return Conv{convolution_forward(pd), pd};
  });

  memory x_mem(x_md, dnnl_engine(), x.data);
  if (conv.pd.src_desc() != x_md)
    x_mem = reorder_into(x_mem, conv.pd.src_desc(), c.arena->alloc(conv.pd.src_desc().get_size()));
  // Reordered weights are kept per weight buffer while that buffer lives; widened (parity-mode)
  // weights live in the arena and are reordered every call.
  memory w_mem(w_md, dnnl_engine(), wx.data);
  if (conv.pd.weights_desc() != w_md) {
    if (wx.data == w.data && w.owner) {
      w_mem = packed_weights(
          w, key, [&](void* to) { return reorder_into(w_mem, conv.pd.weights_desc(), to); },
          conv.pd.weights_desc().get_size());
    } else {
      w_mem = reorder_into(w_mem, conv.pd.weights_desc(), c.arena->alloc(conv.pd.weights_desc().get_size()));
    }
  }
  memory y_user(y_md, dnnl_engine(), y.data);
  memory y_mem = conv.pd.dst_desc() == y_md
                     ? y_user
                     : memory(conv.pd.dst_desc(), dnnl_engine(), c.arena->alloc(conv.pd.dst_desc().get_size()));
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, x_mem}, {DNNL_ARG_WEIGHTS, w_mem}, {DNNL_ARG_DST, y_mem}};
  if (bias) args.emplace(DNNL_ARG_BIAS, memory(b_md, dnnl_engine(), bx.data));
  run_primitive(key, [&] {
    conv.prim.execute(dnnl_stream(), args);
    if (conv.pd.dst_desc() != y_md) dnnl::reorder(y_mem, y_user).execute(dnnl_stream(), y_mem, y_user);
  });
}

}  // namespace apus::cpu
