#include "models/common/text_inputs.h"

#include <algorithm>
#include <cstring>

namespace apus {

TextInputs embed_text(Context& c, const Tensor& embedding, const std::vector<int32_t>& ids, int64_t batch,
                      int64_t head_dim, double rope_theta) {
  const int64_t rows = int64_t(ids.size()), t = rows / batch;
  // The inputs staged as tensors: the ids, and positions 0..t-1 (whatever the padding).
  const Tensor id_tensor = ops::host_filled(
      c, {rows}, DType::i32, [&](Tensor& x) { std::memcpy(x.data, ids.data(), ids.size() * sizeof(int32_t)); });
  const Tensor positions = ops::host_filled(c, {t, 1}, DType::i64, [&](Tensor& x) {
    for (int64_t r = 0; r < t; ++r) x.ptr<int64_t>()[r] = r;
  });
  TextInputs in;
  in.x = Tensor::in(*c.arena, {rows, embedding.shape[1]}, c.act);
  ops::embedding(c, embedding, id_tensor, in.x);
  in.cos = Tensor::in(*c.arena, {t, head_dim / 2}, DType::f32);
  in.sin = Tensor::in(*c.arena, {t, head_dim / 2}, DType::f32);
  ops::rope_tables(c, positions, {head_dim}, rope_theta, ops::RopeMath::f32, in.cos, in.sin);
  return in;
}

Tensor key_mask(Context& c, const std::vector<int64_t>& mask) {
  return ops::host_filled(c, {int64_t(mask.size())}, DType::i64,
                          [&](Tensor& t) { std::copy(mask.begin(), mask.end(), t.ptr<int64_t>()); });
}

LayerBuffers layer_buffers(Context& c, int64_t rows, int64_t hidden, int64_t q_width, int64_t kv_width,
                           int64_t intermediate) {
  auto make = [&](int64_t width) { return Tensor::in(*c.arena, {rows, width}, c.act); };
  return {make(hidden),  make(q_width), make(kv_width),     make(kv_width),
          make(q_width), make(hidden),  make(intermediate), make(intermediate)};
}

}  // namespace apus
