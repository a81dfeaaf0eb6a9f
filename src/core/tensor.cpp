#include "core/tensor.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "core/clones.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/quant_blocks.h"
#include "core/scaled_codes.h"
#include "core/variants.h"

namespace apus {

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << ']';
  return o.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Tensor Tensor::reshape(Shape s) const {
  APUS_CHECK(contiguous(), "reshape of a strided view ", shape_str(shape));
  APUS_CHECK(shape_numel(s) == numel(), "reshape ", shape_str(shape), " -> ", shape_str(s), ": element counts differ");
  APUS_CHECK(!encoding.block_scales || (!s.empty() && s[0] == shape[0]), "reshape ", shape_str(shape), " -> ",
             shape_str(s), " of a block-scaled tensor must keep its rows");
  Tensor t = *this;
  t.shape = std::move(s);
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  APUS_CHECK(rank() >= 1 && 0 <= begin && begin <= end && end <= shape[0], "rows [", begin, ", ", end,
             ") out of range for ", shape_str(shape));
  Tensor t = *this;
  t.shape[0] = end - begin;
  t.encoding.block_row0 += begin;
  const int64_t row_elems = rank() == 2 ? row_stride() : (shape[0] ? numel() / shape[0] : 0);
  if (data) t.data = static_cast<char*>(data) + dtype_bytes(dtype, begin * row_elems);
  return t;
}

Tensor rows_copy(const Tensor& t, const std::vector<Share>& rows) {
  APUS_CHECK(t.rank() >= 1 && t.contiguous(), "rows of a ", shape_str(t.shape), " view");
  Shape shape = t.shape;
  shape[0] = 0;
  for (const Share& r : rows) {
    APUS_CHECK(r.first >= 0 && r.count >= 0 && r.first + r.count <= t.shape[0], "rows [", r.first, ", ",
               r.first + r.count, ") out of range for ", shape_str(t.shape));
    shape[0] += r.count;
  }
  Tensor part = t.data ? Tensor::heap(shape, t.dtype) : Tensor::shape_only(shape, t.dtype);
  part.encoding = t.encoding;
  part.encoding.block_row0 = 0;
  if (!t.data) return part;
  int64_t at = 0;
  for (const Share& r : rows) {
    const Tensor from = t.rows(r.first, r.first + r.count);
    std::memcpy(part.rows(at, at + r.count).data, from.data, from.nbytes());
    at += r.count;
  }
  return part;
}

Tensor Tensor::cols(int64_t begin, int64_t end) const {
  APUS_CHECK(rank() == 2 && 0 <= begin && begin <= end && end <= shape[1], "cols [", begin, ", ", end,
             ") out of range for ", shape_str(shape));
  APUS_CHECK(!encoding.block_scales || begin == 0, "cols [", begin, ", ", end, ") of a block-scaled tensor");
  Tensor t = *this;
  t.stride0 = row_stride();
  t.shape[1] = end - begin;
  if (data) t.data = static_cast<char*>(data) + dtype_bytes(dtype, begin);
  return t;
}

Knob host_pages_knob("host.pages",
                     "large host blocks (arena chunks, converted weights) on 2 MiB transparent huge pages or the "
                     "kernel's default pages",
                     {"huge", "default"});

namespace {
class HostAllocator final : public Allocator {
 public:
  HostAllocator() : Allocator(Device::cpu, 0) {}
  void* allocate(size_t bytes) override {
    // A request's activations are touched first inside its ops (the VAE's upsampled maps, a
    // conv's reordered input): on 4 KiB pages each first touch is a page fault, on huge pages one
    // in 512.
    constexpr size_t kHuge = size_t(2) << 20;
    const bool large = bytes >= kHuge, huge = large && host_pages_knob.value() == 0;
    if (large) host_pages_knob.took(huge ? 0 : 1);
    const size_t align = huge ? kHuge : 64;
    const size_t size = std::max<size_t>((bytes + align - 1) & ~(align - 1), 64);
    void* p = std::aligned_alloc(align, size);
    APUS_CHECK(p, "out of memory allocating ", bytes, " bytes");
    if (huge) madvise(p, size, MADV_HUGEPAGE);  // advice only: without THP the pages stay small
    return p;
  }
  void release(void* p) override { std::free(p); }
};
}  // namespace

Allocator& host_allocator() {
  static HostAllocator a;
  return a;
}

Tensor Tensor::allocate(Allocator& a, Shape s, DType t) {
  Tensor x;
  x.dtype = t;
  x.shape = std::move(s);
  x.device = a.device();
  x.ordinal = a.ordinal();
  void* p = a.allocate(x.nbytes());
  x.owner = std::shared_ptr<const void>(p, [&a](const void* q) { a.release(const_cast<void*>(q)); });
  x.data = p;
  return x;
}

Tensor Tensor::heap(Shape s, DType t) { return allocate(host_allocator(), std::move(s), t); }

Tensor Tensor::shape_only(Shape s, DType t) {
  Tensor x;
  x.dtype = t;
  x.shape = std::move(s);
  return x;
}

Tensor Tensor::in(Arena& a, Shape s, DType t) {
  Tensor x;
  x.dtype = t;
  x.shape = std::move(s);
  x.device = a.allocator().device();
  x.ordinal = a.allocator().ordinal();
  x.data = a.alloc(x.nbytes());
  return x;
}

float load_f32(const Tensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::f32:
      return t.ptr<float>()[i];
    case DType::bf16:
      return bf16_to_f32(t.ptr<uint16_t>()[i]);
    case DType::f16:
      return f16_to_f32(t.ptr<uint16_t>()[i]);
    case DType::u8:
      return t.ptr<uint8_t>()[i];
    case DType::e8m0:
      return e8m0_to_f32(t.ptr<uint8_t>()[i]);
    case DType::i32:
      return float(t.ptr<int32_t>()[i]);
    case DType::i64:
      return float(t.ptr<int64_t>()[i]);
    default: {
      if (is_code_format(t.dtype)) {
        const int64_t rows = t.rank() >= 1 ? t.shape[0] : 1, row = rows ? t.numel() / rows : 1;
        return decode_code_element(t.rank() == 2 ? t : t.reshape({rows, row}), i / row, i % row);
      }
      APUS_CHECK(is_block_quantized(t.dtype), "load_f32: unsupported dtype ", dtype_name(t.dtype));
      return dequantize_element(t.dtype, t.data, i);
    }
  }
}

std::vector<float> to_f32_vector(const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  if (is_block_quantized(t.dtype)) {
    dequantize_row(t.dtype, t.data, v.data(), t.numel());
    return v;
  }
  if (is_code_format(t.dtype) && t.rank() >= 1 && t.contiguous()) {
    const int64_t row = t.shape[0] ? t.numel() / t.shape[0] : 0;
    const Tensor rows = t.rank() == 2 ? t : t.reshape({t.shape[0], row});
    for (int64_t r = 0; r < t.shape[0]; ++r) decode_code_row(rows, r, v.data() + r * row, row);
    return v;
  }
  for (int64_t i = 0; i < t.numel(); ++i) v[size_t(i)] = load_f32(t, i);
  return v;
}

// f32 -> bf16, round to nearest even, NaN kept NaN: f32_to_bf16 without its branch, so the compiler
// vectorises it (the branchy form compiled to scalar code: 27 % of a 1-step medium run's time).
namespace {

APUS_CLONES void f32_to_bf16_block(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    dst[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

}  // namespace

Tensor row_blocks_permuted(const Tensor& t, const std::vector<int>& order) {
  const int64_t parts = int64_t(order.size());
  APUS_CHECK(t.rank() >= 1 && parts > 0 && t.dim(0) % parts == 0 && t.contiguous(),
             "row_blocks_permuted: ", shape_str(t.shape), " does not split into ", parts, " blocks of rows");
  Tensor out = Tensor::heap(t.shape, t.dtype);
  const int64_t rows = t.dim(0) / parts;
  const size_t bytes = t.rows(0, rows).nbytes();
  for (int64_t i = 0; i < parts; ++i)
    std::memcpy(out.rows(i * rows, (i + 1) * rows).data,
                t.rows(order[size_t(i)] * rows, (order[size_t(i)] + 1) * rows).data, bytes);
  return out;
}

Tensor to_dtype(const Tensor& t, DType dt) {
  APUS_CHECK(dt == DType::f32 || dt == DType::bf16, "to_dtype: cannot convert to ", dtype_name(dt));
  Tensor out = Tensor::heap(t.shape, dt);
  if (is_code_format(t.dtype)) {
    const std::vector<float> v = to_f32_vector(t);
    for (size_t i = 0; i < v.size(); ++i) {
      if (dt == DType::f32) out.ptr<float>()[i] = v[i];
      else out.ptr<uint16_t>()[i] = f32_to_bf16(v[i]);
    }
    return out;
  }
  const int64_t n = t.numel(), block = int64_t(1) << 16;
  const bool f32_to_bf16_rows = t.dtype == DType::f32 && dt == DType::bf16;
  // Whole weight matrices go through here at load: spread over the cores, the common f32 -> bf16
  // case in a loop the compiler vectorises.
  parallel_for((n + block - 1) / block, [&](int64_t b) {
    const int64_t begin = b * block, end = std::min(n, begin + block);
    if (is_block_quantized(t.dtype) || t.dtype == DType::f16) {
      // Decoded to fp32 a chunk at a time (whole blocks: the chunk is a multiple of every block
      // size), then stored: GGUF blocks, and sa3.cpp's and ComfyUI's F16 weights at load.
      std::vector<float> buf(dt == DType::f32 ? 0 : size_t(end - begin));
      float* wide = dt == DType::f32 ? out.ptr<float>() + begin : buf.data();
      if (t.dtype == DType::f16) f16_to_f32_row(t.ptr<uint16_t>() + begin, wide, end - begin);
      else dequantize_row(t.dtype, t.ptr<uint8_t>() + dtype_bytes(t.dtype, begin), wide, end - begin);
      if (dt == DType::bf16) f32_to_bf16_block(wide, out.ptr<uint16_t>() + begin, end - begin);
      return;
    }
    if (f32_to_bf16_rows) {
      f32_to_bf16_block(t.ptr<float>() + begin, out.ptr<uint16_t>() + begin, end - begin);
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      if (dt == DType::f32) out.ptr<float>()[i] = load_f32(t, i);
      else out.ptr<uint16_t>()[i] = f32_to_bf16(load_f32(t, i));
    }
  });
  return out;
}

Knob arena_chunks_knob("host.arena_chunks",
                       "a finished request's host arena chunks kept for the next request, or released",
                       {"kept", "released"});

namespace {
// Chunks of finished host arenas. The next request's activations land on pages already mapped
// instead of faulting each page in again inside its ops (a VAE decode touches gigabytes first
// inside its convs). The pool holds no more than the arenas that ran at once ever held.
class ChunkPool {
 public:
  ~ChunkPool() {
    for (auto& [size, base] : free_) host_allocator().release(base);
  }
  // The smallest kept chunk of at least `bytes`, or null.
  std::pair<void*, size_t> take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.lower_bound(bytes);
    if (it == free_.end()) return {nullptr, 0};
    const std::pair<void*, size_t> chunk{it->second, it->first};
    free_.erase(it);
    return chunk;
  }
  void keep(void* base, size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.emplace(size, base);
  }
  size_t bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t sum = 0;
    for (const auto& [size, base] : free_) sum += size;
    return sum;
  }

 private:
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;
};

ChunkPool& chunk_pool() {
  static ChunkPool pool;
  return pool;
}
}  // namespace

size_t pooled_host_bytes() { return chunk_pool().bytes(); }

Arena::Arena(size_t chunk_bytes, bool measure_only, Allocator& allocator)
    : chunk_bytes_(chunk_bytes),
      measure_only_(measure_only),
      allocator_(allocator),
      pooled_(&allocator == &host_allocator() && arena_chunks_knob.value() == 0) {
  arena_chunks_knob.took(pooled_ ? 0 : 1);
}

Arena::~Arena() {
  for (auto& c : chunks_) {
    if (pooled_) chunk_pool().keep(c.base, c.size);
    else allocator_.release(c.base);
  }
}

void* Arena::alloc(size_t bytes) {
  bytes = (bytes + 63) & ~size_t(63);
  if (measure_only_) {
    offset_ += bytes;
    high_water_ = std::max(high_water_, offset_);
    return nullptr;
  }
  while (current_ < chunks_.size() && offset_ + bytes > chunks_[current_].size) {
    ++current_;
    offset_ = 0;
  }
  if (current_ == chunks_.size()) {
    size_t size = std::max(bytes, chunk_bytes_);
    void* p = nullptr;
    if (pooled_) std::tie(p, size) = chunk_pool().take(size);
    if (!p) {
      size = std::max(bytes, chunk_bytes_);
      p = allocator_.allocate(size);
    }
    chunks_.push_back({p, size});
    offset_ = 0;
  }
  void* p = static_cast<char*>(chunks_[current_].base) + offset_;
  offset_ += bytes;
  size_t used = offset_;
  for (size_t i = 0; i < current_; ++i) used += chunks_[i].size;
  high_water_ = std::max(high_water_, used);
  return p;
}

}  // namespace apus
