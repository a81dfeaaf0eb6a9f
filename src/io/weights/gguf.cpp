#include "io/weights/gguf.h"

#include <cstring>
#include <set>

#include "core/error.h"
#include "core/quant_blocks.h"

namespace apus {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian word
constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS

enum ValueType : uint32_t {
  kU8 = 0,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kF32,
  kBool,
  kString,
  kArray,
  kU64,
  kI64,
  kF64,
};

// A bounds-checked cursor over the header; every read names the file and the field.
class Reader {
 public:
  Reader(const MappedFile& f) : f_(f) {}
  size_t at() const { return at_; }
  size_t left() const { return f_.size - at_; }
  template <typename T> T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, f_.data + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string string(const char* what) {
    const uint64_t n = read<uint64_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(f_.data + at_), size_t(n));
    at_ += size_t(n);
    return s;
  }
  void need(uint64_t bytes, const char* what) const {
    APUS_CHECK(bytes <= left(), f_.path, ": truncated GGUF file: ", what, " at byte ", at_, " needs ", bytes,
               " bytes, ", left(), " remain");
  }

 private:
  const MappedFile& f_;
  size_t at_ = 0;
};

nlohmann::json scalar(Reader& r, uint32_t type, const std::string& key, const std::string& path) {
  switch (type) {
    case kU8:
      return r.read<uint8_t>("a u8 value");
    case kI8:
      return r.read<int8_t>("an i8 value");
    case kU16:
      return r.read<uint16_t>("a u16 value");
    case kI16:
      return r.read<int16_t>("an i16 value");
    case kU32:
      return r.read<uint32_t>("a u32 value");
    case kI32:
      return r.read<int32_t>("an i32 value");
    case kF32:
      return r.read<float>("an f32 value");
    case kU64:
      return r.read<uint64_t>("a u64 value");
    case kI64:
      return r.read<int64_t>("an i64 value");
    case kF64:
      return r.read<double>("an f64 value");
    case kBool: {
      const uint8_t b = r.read<uint8_t>("a bool value");
      APUS_CHECK(b <= 1, path, ": metadata '", key, "' is a bool of value ", int(b), ", expected 0 or 1");
      return b == 1;
    }
    case kString:
      return r.string("a string value");  // may be invalid UTF-8: dump it with error_handler_t::replace
  }
  fail(path, ": metadata '", key, "' has value type ", type, ", expected 0..12");
}

// The smallest encoding of one value of `type`, so a hostile count cannot make the parser loop
// past what the file can hold.
uint64_t min_bytes(uint32_t type) {
  switch (type) {
    case kU8:
    case kI8:
    case kBool:
      return 1;
    case kU16:
    case kI16:
      return 2;
    case kU32:
    case kI32:
    case kF32:
      return 4;
    default:
      return 8;  // u64, i64, f64, a string's length, an array's header
  }
}

nlohmann::json value(Reader& r, uint32_t type, const std::string& key, const std::string& path, int depth) {
  if (type != kArray) return scalar(r, type, key, path);
  APUS_CHECK(depth < 2, path, ": metadata '", key, "' nests arrays more than two deep");
  const uint32_t item = r.read<uint32_t>("an array's item type");
  const uint64_t n = r.read<uint64_t>("an array's length");
  APUS_CHECK(item <= kF64, path, ": metadata '", key, "' is an array of value type ", item, ", expected 0..12");
  APUS_CHECK(n <= r.left() / min_bytes(item), path, ": metadata '", key, "' claims ", n,
             " items, more than the file's remaining ", r.left(), " bytes hold");
  nlohmann::json a = nlohmann::json::array();
  for (uint64_t i = 0; i < n; ++i) a.push_back(value(r, item, key, path, depth + 1));
  return a;
}

}  // namespace

bool is_gguf_file(const std::string& path) {
  const std::shared_ptr<MappedFile> bytes = map_file(path);
  return bytes->size >= 4 && std::memcmp(bytes->data, "GGUF", 4) == 0;
}

GgufFile GgufFile::open(const std::string& path) { return parse(map_file(path)); }

GgufFile GgufFile::parse(std::shared_ptr<MappedFile> file) {
  const std::string& path = file->path;
  Reader r(*file);
  GgufFile g;
  g.file_ = file;
  const uint32_t magic = r.read<uint32_t>("the magic");
  APUS_CHECK(magic == kMagic, path, ": not a GGUF file (magic 0x", std::hex, magic, std::dec, ", expected 'GGUF')");
  g.version_ = r.read<uint32_t>("the version");
  APUS_CHECK(g.version_ == 2 || g.version_ == 3, path, ": GGUF version ", g.version_, ", expected 2 or 3");
  const uint64_t tensor_count = r.read<uint64_t>("the tensor count");
  const uint64_t kv_count = r.read<uint64_t>("the metadata count");
  // A key-value takes at least 12 bytes, a tensor entry at least 8 + 4 + 4 + 8.
  APUS_CHECK(kv_count <= r.left() / 12 && tensor_count <= r.left() / 24, path, ": header claims ", kv_count,
             " metadata entries and ", tensor_count, " tensors, more than its ", file->size, " bytes hold");
  g.metadata_ = nlohmann::json::object();
  for (uint64_t i = 0; i < kv_count; ++i) {
    const std::string key = r.string("a metadata key");
    const uint32_t type = r.read<uint32_t>("a metadata value type");
    APUS_CHECK(!g.metadata_.contains(key), path, ": metadata key '", key, "' appears twice");
    g.metadata_[key] = value(r, type, key, path, 0);
  }
  uint64_t alignment = kDefaultAlignment;
  if (g.metadata_.contains("general.alignment")) {
    const nlohmann::json& a = g.metadata_["general.alignment"];
    // The spec's type is uint32: a signed or float one is refused for its type, whatever its value.
    APUS_CHECK(a.is_number_unsigned(), path, ": general.alignment is stored as a ",
               a.is_number_integer() ? "signed integer" : a.type_name(), " (", a.dump(),
               "), expected a uint32 as the GGUF spec says");
    APUS_CHECK(
        a.get<uint64_t>() > 0 && a.get<uint64_t>() <= 65536 && (a.get<uint64_t>() & (a.get<uint64_t>() - 1)) == 0, path,
        ": general.alignment is ", a.dump(), ", expected a power of two up to 65536");
    alignment = a.get<uint64_t>();
  }
  struct Info {
    std::string name;
    Shape shape;
    uint32_t type;
    uint64_t offset;
  };
  std::vector<Info> infos;
  std::set<std::string> seen;
  for (uint64_t i = 0; i < tensor_count; ++i) {
    Info t;
    t.name = r.string("a tensor name");
    const uint32_t dims = r.read<uint32_t>("a tensor's rank");
    APUS_CHECK(dims >= 1 && dims <= kMaxDims, path, ": tensor '", t.name, "' has ", dims, " dimensions, expected 1..",
               kMaxDims);
    std::vector<uint64_t> ne(dims);
    for (uint32_t d = 0; d < dims; ++d) ne[d] = r.read<uint64_t>("a tensor dimension");
    t.type = r.read<uint32_t>("a tensor's type");
    t.offset = r.read<uint64_t>("a tensor's offset");
    uint64_t numel = 1;
    for (uint64_t n : ne) {
      APUS_CHECK(n >= 1, path, ": tensor '", t.name, "' has a dimension of 0 (", dims,
                 "-D): a tensor holds at least one element");
      APUS_CHECK(n <= (uint64_t(1) << 40) && numel <= (uint64_t(1) << 40) / n, path, ": tensor '", t.name,
                 "' has dimension ", n, " (", dims, "-D), beyond 2^40 elements in all");
      numel *= n;
    }
    for (uint32_t d = dims; d-- > 0;) t.shape.push_back(int64_t(ne[d]));
    APUS_CHECK(seen.insert(t.name).second, path, ": tensor '", t.name, "' appears twice");
    infos.push_back(std::move(t));
  }
  const uint64_t data_start = (uint64_t(r.at()) + alignment - 1) / alignment * alignment;
  APUS_CHECK(data_start <= file->size || infos.empty(), path, ": the tensor data would start at byte ", data_start,
             ", past the file's end (", file->size, " bytes)");
  const uint64_t data_size = data_start <= file->size ? file->size - data_start : 0;
  // As ggml's reader requires, the tensors' data follow one another in the order of their infos,
  // each at the previous one's end padded to the alignment: two tensors sharing bytes, swapped
  // offsets or a type relabelled to a smaller one (an F32 read as F16 from half its bytes) are
  // refused. After a type apus cannot read (its size unknown here) only the order is checked.
  uint64_t expected = 0;
  bool size_known = true;
  std::string previous = "the start of the data";
  for (Info& t : infos) {
    Entry e;
    e.ggml_type = t.type;
    e.readable = dtype_from_ggml(t.type, e.tensor.dtype);
    APUS_CHECK(t.offset % alignment == 0, path, ": tensor '", t.name, "' starts at data offset ", t.offset,
               ", not a multiple of the file's alignment ", alignment);
    e.tensor.shape = t.shape;
    if (e.readable) {
      const int64_t block = dtype_block(e.tensor.dtype);
      APUS_CHECK(t.shape.back() % block == 0, path, ": tensor '", t.name, "' (", ggml_type_name(t.type), ", ",
                 shape_str(t.shape), ") has rows of ", t.shape.back(), " elements, not whole ", block,
                 "-element blocks");
      const uint64_t bytes = dtype_bytes(e.tensor.dtype, shape_numel(t.shape));
      APUS_CHECK(t.offset <= data_size && bytes <= data_size - t.offset, path, ": tensor '", t.name, "' (",
                 ggml_type_name(t.type), ", ", shape_str(t.shape), ", ", bytes, " bytes at data offset ", t.offset,
                 ") runs past the end of the file (", data_size, " bytes of data)");
      e.tensor.data = const_cast<uint8_t*>(file->data) + data_start + t.offset;
      e.tensor.owner = file;
    }
    APUS_CHECK(size_known ? t.offset == expected : t.offset >= expected, path, ": tensor '", t.name,
               "' starts at data offset ", t.offset, ", expected ", size_known ? "" : "at least ", expected, " (where ",
               previous, " ends, padded to the alignment ", alignment,
               "): the tensors' data must follow one another in the order of their infos");
    size_known = e.readable;
    expected = e.readable ? t.offset + (dtype_bytes(e.tensor.dtype, shape_numel(t.shape)) + alignment - 1) / alignment *
                                           alignment
                          : t.offset + 1;
    previous = "tensor '" + t.name + "'";
    g.order_.push_back(t.name);
    g.tensors_.emplace(t.name, std::move(e));
  }
  // Bytes past the last tensor beyond its padding: what a tensor relabelled smaller leaves behind.
  APUS_CHECK(!size_known || infos.empty() || data_size <= expected, path, ": ", data_size - expected,
             " bytes of tensor data follow the last tensor '", infos.back().name,
             "' past its padding (it ends at data offset ", expected,
             "): a tensor's type or shape does not match the bytes stored for it");
  return g;
}

std::string GgufFile::metadata_string(const std::string& key, const std::string& fallback) const {
  if (!metadata_.contains(key)) return fallback;
  APUS_CHECK(metadata_[key].is_string(), path(), ": metadata '", key, "' is ",
             metadata_[key].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), ", expected a string");
  return metadata_[key].get<std::string>();
}

const Tensor& GgufFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  APUS_CHECK(it != tensors_.end(), path(), ": no tensor '", name, "'");
  APUS_CHECK(it->second.readable, path(), ": tensor '", name, "' is stored as ", ggml_type_name(it->second.ggml_type),
             ", which apus does not read (it reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)");
  const Tensor& t = it->second.tensor;
  if (is_block_quantized(t.dtype)) {
    // The blocks' scales, checked as the weights are fetched (once: the file is read-only).
    std::call_once(*it->second.scales_checked, [&] {
      const int64_t block = first_nonfinite_scale(t.dtype, t.data, t.numel() / dtype_block(t.dtype));
      APUS_CHECK(block < 0, path(), ": tensor '", name, "' (", ggml_type_name(it->second.ggml_type), ", ",
                 shape_str(t.shape), ") block ", block, " (row ", block * dtype_block(t.dtype) / t.shape.back(),
                 ") has a NaN or infinite scale");
    });
  }
  return t;
}

const Shape& GgufFile::shape(const std::string& name) const {
  auto it = tensors_.find(name);
  APUS_CHECK(it != tensors_.end(), path(), ": no tensor '", name, "'");
  return it->second.tensor.shape;
}

const char* GgufFile::type_name(const std::string& name) const {
  auto it = tensors_.find(name);
  APUS_CHECK(it != tensors_.end(), path(), ": no tensor '", name, "'");
  return ggml_type_name(it->second.ggml_type);
}

}  // namespace apus
