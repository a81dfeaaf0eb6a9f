// Gathers and re-layouts: embedding rows, axis permutations, pixels out.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/rows.h"
#include "ops/permute_plan.h"

namespace apus::cpu {

void embedding(Context& c, const Tensor& table, const Tensor& ids, Tensor& y) {
  const int64_t s = ids.numel(), d = table.shape[1];
  APUS_CHECK(table.rank() == 2 && ids.dtype == DType::i32 && y.shape == Shape({s, d}), "embedding: table ",
             shape_str(table.shape), ", ids ", shape_str(ids.shape), " ", dtype_name(ids.dtype), ", y ",
             shape_str(y.shape));
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t r = 0; r < s; ++r)
    APUS_CHECK(id[r] >= 0 && id[r] < table.shape[0], "embedding: token id ", id[r], " outside the table's ",
               table.shape[0], " rows");
  parallel_for(s, [&](int64_t r) {
    float* v = thread_scratch(0, d);
    load_row(table, id[r], v, d);
    store_row(y, r, v, d);
  });
}

void permute(Context& c, const Tensor& x, Tensor& y, const std::vector<int>& perm) {
  const PermutePlan plan = permute_plan(x, y, perm);
  const int rank = plan.rank;
  const int64_t* dims = plan.dims;
  const int64_t* y_stride = plan.from;
  const size_t es = dtype_size(x.dtype);
  const int64_t inner = dims[rank - 1], rows = y.numel() / std::max<int64_t>(inner, 1);
  parallel_for(rows, [&](int64_t r) {
    int64_t src = 0, rem = r;
    for (int i = rank - 2; i >= 0; --i) {
      src += (rem % dims[i]) * y_stride[i];
      rem /= dims[i];
    }
    const char* in = static_cast<const char*>(x.data);
    char* out = static_cast<char*>(y.data) + size_t(r * inner) * es;
    for (int64_t j = 0; j < inner; ++j)
      std::memcpy(out + size_t(j) * es, in + size_t(src + j * y_stride[rank - 1]) * es, es);
  });
}

void image_to_rgb8(Context& c, const Tensor& image, Tensor& rgb) {
  const int64_t h = image.shape[2], w = image.shape[3];
  APUS_CHECK(image.rank() == 4 && image.shape[0] == 1 && image.shape[1] == 3 && rgb.shape == Shape({h, w, 3}) &&
                 rgb.dtype == DType::u8,
             "image_to_rgb8: image ", shape_str(image.shape), ", rgb ", shape_str(rgb.shape), " ",
             dtype_name(rgb.dtype), "; expected [1, 3, H, W] and u8 [H, W, 3]");
  const Tensor planes = image.reshape({3 * h, w});
  const DType dt = image.dtype;
  parallel_for(3 * h, [&](int64_t r) {
    const int64_t ch = r / h, y = r % h;
    float* v = thread_scratch(0, w);
    load_row(planes, r, v, w);
    uint8_t* out = rgb.ptr<uint8_t>() + size_t(y * w * 3 + ch);
    for (int64_t x = 0; x < w; ++x) {
      APUS_CHECK(std::isfinite(v[x]), "image_to_rgb8: pixel (", y, ", ", x, ") of channel ", ch, " is ", v[x],
                 ", expected a finite value");
      // denormalize runs in the image's dtype: x * 0.5 + 0.5 as two rounded ops, then clamp;
      // then numpy in float32: (x * 255).round() rounds halves to even, as nearbyint does.
      const float unit = std::clamp(round_as(dt, round_as(dt, v[x] * 0.5f) + 0.5f), 0.0f, 1.0f);
      out[x * 3] = uint8_t(std::nearbyint(unit * 255.0f));
    }
  });
}

}  // namespace apus::cpu
