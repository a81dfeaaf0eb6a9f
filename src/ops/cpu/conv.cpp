#include "core/error.h"
#include "ops/cpu/dnnl_util.h"
#include "ops/cpu/rows.h"
#include "ops/cpu/cpu_ops.h"

namespace apus::cpu {

void conv2d(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,
            int64_t stride, int64_t pad) {
  using namespace dnnl;
  using dims = memory::dims;
  APUS_CHECK(x.rank() == 4 && w.rank() == 4 && y.rank() == 4 && x.shape[0] == 1 &&
                 w.shape[1] == x.shape[1] && y.shape[1] == w.shape[0],
             "conv2d: x ", shape_str(x.shape), ", w ", shape_str(w.shape), ", y ",
             shape_str(y.shape));
  const int64_t kh = w.shape[2], kw = w.shape[3];
  APUS_CHECK(y.shape[2] == (x.shape[2] + 2 * pad - kh) / stride + 1 &&
                 y.shape[3] == (x.shape[3] + 2 * pad - kw) / stride + 1,
             "conv2d: output ", shape_str(y.shape), " does not match input ", shape_str(x.shape));
  ArenaScope scope(*c.arena);
  const Tensor wx = cpu::as_dtype(*c.arena, w, x.dtype);
  const Tensor bx = bias ? cpu::as_dtype(*c.arena, *bias, DType::f32) : Tensor{};
  const auto dt = cpu::dnnl_type(x.dtype);
  const memory::desc x_md(dims(x.shape.begin(), x.shape.end()), dt, memory::format_tag::nchw);
  const memory::desc w_md(dims(w.shape.begin(), w.shape.end()), dt, memory::format_tag::oihw);
  const memory::desc y_md(dims(y.shape.begin(), y.shape.end()), cpu::dnnl_type(y.dtype),
                          memory::format_tag::nchw);
  const memory::desc b_md(dims{w.shape[0]}, memory::data_type::f32, memory::format_tag::x);
  std::string key = "conv" + shape_str(x.shape) + shape_str(w.shape) + shape_str(y.shape) +
                    std::to_string(int(x.dtype)) + std::to_string(int(y.dtype)) +
                    std::to_string(stride) + std::to_string(pad) + (bias ? "b" : "");
  auto& prim = cpu::cached_primitive<convolution_forward>(key, [&] {
    const dims strides{stride, stride}, padding{pad, pad};
    auto d = bias ? convolution_forward::desc(prop_kind::forward_inference,
                                              algorithm::convolution_direct, x_md, w_md, b_md,
                                              y_md, strides, padding, padding)
                  : convolution_forward::desc(prop_kind::forward_inference,
                                              algorithm::convolution_direct, x_md, w_md, y_md,
                                              strides, padding, padding);
    return convolution_forward(convolution_forward::primitive_desc(d, cpu::dnnl_engine()));
  });
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, memory(x_md, cpu::dnnl_engine(), x.data)},
      {DNNL_ARG_WEIGHTS, memory(w_md, cpu::dnnl_engine(), wx.data)},
      {DNNL_ARG_DST, memory(y_md, cpu::dnnl_engine(), y.data)}};
  if (bias) args.emplace(DNNL_ARG_BIAS, memory(b_md, cpu::dnnl_engine(), bx.data));
  prim.execute(cpu::dnnl_stream(), args);
  cpu::dnnl_stream().wait();
}

}  // namespace apus::cpu
