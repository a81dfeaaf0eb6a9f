#pragma once
// A tensor is a typed, shaped view of contiguous memory that lives on one device.
// Memory comes from one of three owners: a mapped weight file, an Arena, or the heap;
// `owner` keeps a file mapping or heap block alive, arena memory lives until the arena is reset.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/share.h"

namespace apus {

enum class Device : uint8_t { cpu, cuda };

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Arena;
struct BlockScales;

// Where the memory of one device comes from. Every backend is one (a GPU backend hands out device
// memory); the host allocator serves host-side staging and the CPU backends.
class Allocator {
 public:
  Allocator(Device device, int ordinal) : device_(device), ordinal_(ordinal) {}
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;  // 64-byte aligned; throws apus::Error when out of memory
  virtual void release(void* p) = 0;
  Device device() const { return device_; }
  int ordinal() const { return ordinal_; }

 private:
  Device device_;
  int ordinal_;
};
Allocator& host_allocator();

// How a weight's stored values become its numbers, one value on Tensor for every feature of it.
// A tensor of codes (fp8, int8, packed fp4: quantised checkpoints' weights) has factors: its
// values are the decoded codes times code_scale (a weight_scale), and times the factor of their
// row's block when block_scales is set, its rows counted from block_row0 (core/scaled_codes.h).
// Every decode of a code format applies them, unless the weight's products are a quantised tier's.
//
// How a linear multiplies a weight (ops/op_list.h, linear): decoded into the activation dtype, or,
// for a quantised tier's weight (`--quant int8 | fp8`, io/weights/quant_weights.h: i8 or e4m3
// codes with one scale a row), in its codes: the linear quantises its input per row to the same
// codes and scales the sums (int8: exact integer sums; fp8: exact products summed in fp32).
enum class Products { decoded, int8, fp8 };
struct WeightEncoding {
  float code_scale = 1;
  std::shared_ptr<const BlockScales> block_scales;
  int64_t block_row0 = 0;
  Products products = Products::decoded;
};

struct Tensor {
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ordinal = 0;  // which device of its kind (GPU 0, 1, ...)
  Shape shape;
  void* data = nullptr;  // null in counting mode: the shape is all that exists
  std::shared_ptr<const void> owner;
  // Elements between consecutive rows of a rank-2 column view; 0 means contiguous. Column views
  // let one GEMM output feed several consumers (q, k, v, gate, up) without copies.
  int64_t stride0 = 0;
  // A weight's name as its model's loader fetched it (null for activations): what a request's
  // low-rank adapters are found by (ops/adapters.h). Owned by the loader, which the model keeps.
  const std::string* weight_name = nullptr;
  // How the stored values become the weight's numbers (plain dtypes: the defaults, ignored).
  WeightEncoding encoding;

  int64_t numel() const { return shape_numel(shape); }
  size_t nbytes() const { return dtype_bytes(dtype, numel()); }
  int64_t dim(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
  int rank() const { return int(shape.size()); }
  bool defined() const { return !shape.empty() || data; }

  template <typename T> T* ptr() { return static_cast<T*>(data); }
  template <typename T> const T* ptr() const { return static_cast<const T*>(data); }

  // Same memory, new shape with the same element count.
  Tensor reshape(Shape s) const;
  // Rows [begin, end) along dim 0 without a copy.
  Tensor rows(int64_t begin, int64_t end) const;
  // Columns [begin, end) of a rank-2 tensor without a copy (sets stride0); for a block format,
  // whole blocks.
  Tensor cols(int64_t begin, int64_t end) const;
  int64_t row_stride() const { return stride0 ? stride0 : shape.back(); }
  bool contiguous() const { return stride0 == 0 || stride0 == shape.back(); }
  void* row(int64_t i) const { return static_cast<char*>(data) + dtype_bytes(dtype, i * row_stride()); }

  static Tensor heap(Shape s, DType t);
  // Memory from `a`, released through it when the last copy of the tensor goes.
  static Tensor allocate(Allocator& a, Shape s, DType t);
  // Shape and dtype without memory: what counting mode hands around.
  static Tensor shape_only(Shape s, DType t);
  static Tensor in(Arena& a, Shape s, DType t);
};

// Element access for tests and host-side glue (not for hot loops).
float load_f32(const Tensor& t, int64_t i);
std::vector<float> to_f32_vector(const Tensor& t);
Tensor to_dtype(const Tensor& t, DType dt);  // heap copy
// A heap copy of t's rows `rows` (ranges along dim 0, one after another), encoding kept: a rank's
// share of a weight under tensor parallelism. Shape only when t has no data.
Tensor rows_copy(const Tensor& t, const std::vector<Share>& rows);
// A heap copy of t (host, contiguous) cut along dim 0 into order.size() equal blocks, block i of
// the copy being t's block order[i]: fused projections stored in another row order.
Tensor row_blocks_permuted(const Tensor& t, const std::vector<int>& order);

// Bytes of finished host arenas' chunks the process keeps for the next arena (knob host.arena_chunks).
size_t pooled_host_bytes();

// Bump allocator: the hot loop takes scratch and activations from here, never from malloc.
// Regions are grown in chunks; `mark`/`release` give stack-like scoping per block.
class Arena {
 public:
  // measure_only: allocations only move the counters and return null (the cost model's
  // counting mode measures peak activation memory without reserving it).
  explicit Arena(size_t chunk_bytes = size_t(64) << 20, bool measure_only = false,
                 Allocator& allocator = host_allocator());
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void* alloc(size_t bytes);
  struct Mark {
    size_t chunk, offset;
  };
  Mark mark() const { return {current_, offset_}; }
  void release(Mark m) {
    current_ = m.chunk;
    offset_ = m.offset;
  }
  void reset() {
    current_ = 0;
    offset_ = 0;
  }
  size_t high_water() const { return high_water_; }
  const Allocator& allocator() const { return allocator_; }

 private:
  struct Chunk {
    void* base;
    size_t size;
  };
  std::vector<Chunk> chunks_;
  size_t chunk_bytes_, current_ = 0, offset_ = 0, high_water_ = 0;
  bool measure_only_;
  Allocator& allocator_;
  bool pooled_;  // host chunks come from and go back to the process's pool (knob host.arena_chunks)
};

// Releases everything allocated after construction when it leaves scope.
class ArenaScope {
 public:
  explicit ArenaScope(Arena& a) : arena_(a), mark_(a.mark()) {}
  ~ArenaScope() { arena_.release(mark_); }

 private:
  Arena& arena_;
  Arena::Mark mark_;
};

}  // namespace apus
