// The GGUF reader against files gguf-py wrote (tools/oracle/make_gguf_fixtures.py): metadata of
// every value type, every block format dequantised bit for bit as gguf-py does, and hostile files
// refused naming the file and the field.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "core/error.h"
#include "core/quant_blocks.h"
#include "io/gguf.h"
#include "io/model_dir.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace apus {
namespace {

using test::expect_error;
using test::fixture;

TEST(Gguf, MetadataOfEveryValueTypeReadsAsGgufPyWroteIt) {
  const GgufFile g = GgufFile::open(fixture("gguf/blocks.gguf"));
  const Json want = read_json(fixture("gguf/blocks.json"));
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.metadata_string("general.architecture"), "apus-test");
  for (auto it = want["metadata"].begin(); it != want["metadata"].end(); ++it) {
    ASSERT_TRUE(g.metadata().contains(it.key())) << it.key();
    const Json& got = g.metadata()[it.key()];
    if (it.value().is_number_float()) EXPECT_DOUBLE_EQ(got.get<double>(), it.value().get<double>()) << it.key();
    else EXPECT_EQ(got, it.value()) << it.key();
  }
  expect_error([&] { g.metadata_string("test.u8"); }, {"blocks.gguf", "test.u8", "expected a string"});
}

TEST(Gguf, EveryBlockFormatDequantisesBitForBitAsGgufPy) {
  const GgufFile g = GgufFile::open(fixture("gguf/blocks.gguf"));
  const SafetensorsFile ref = SafetensorsFile::open(fixture("gguf/blocks_ref.safetensors"));
  const Json want = read_json(fixture("gguf/blocks.json"))["tensors"];
  ASSERT_EQ(g.names().size(), want.size());
  for (const std::string& name : g.names()) {
    SCOPED_TRACE(name);
    const Tensor& t = g.get(name);
    EXPECT_EQ(t.shape, want[name]["shape"].get<Shape>());
    EXPECT_EQ(std::string(g.type_name(name)), want[name]["type"].get<std::string>());
    const Tensor& r = ref.get(name);
    ASSERT_EQ(r.shape, t.shape);
    const std::vector<float> got = to_f32_vector(t);
    int64_t differ = 0;
    for (int64_t i = 0; i < r.numel(); ++i) differ += std::memcmp(&got[size_t(i)], r.ptr<float>() + i, 4) != 0;
    EXPECT_EQ(differ, 0) << " of " << r.numel() << " values differ from gguf-py's";
    // A row view starts at whole blocks: row 1 of the tensor dequantised alone.
    const Tensor row = t.reshape({t.numel() / t.shape.back(), t.shape.back()}).rows(1, 2);
    EXPECT_EQ(to_f32_vector(row), std::vector<float>(got.begin() + t.shape.back(), got.begin() + 2 * t.shape.back()));
  }
}

TEST(Gguf, Fp8E4m3DecodesEveryCode) {
  // torch.float8_e4m3fn: bias 7, subnormals below exponent 1, S.1111.111 NaN, no infinities.
  EXPECT_EQ(fp8_e4m3_to_f32(0x00), 0.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0xfe), -448.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xff)));
  // Monotone over the positive codes, each the one before times at most 1 + 1/8 (or a subnormal step).
  for (int v = 1; v < 0x7f; ++v) EXPECT_GT(fp8_e4m3_to_f32(uint8_t(v)), fp8_e4m3_to_f32(uint8_t(v - 1))) << v;
}

// A GGUF file written field by field, for the hostile cases.
class Bytes {
 public:
  template <typename T> Bytes& put(T v) {
    s_.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& v) {
    put<uint64_t>(v.size());
    s_ += v;
    return *this;
  }
  Bytes& pad(size_t align) {
    while (s_.size() % align) s_ += '\0';
    return *this;
  }
  Bytes& raw(size_t n) {
    s_.append(n, '\x11');
    return *this;
  }
  GgufFile parse() const {
    auto f = std::make_shared<MappedFile>();
    f->path = "hostile.gguf";
    f->data = reinterpret_cast<const uint8_t*>(s_.data());
    f->size = s_.size();
    f->mapped = false;
    return GgufFile::parse(f);
  }
  std::string s_;
};

// magic, version 3, one tensor, `kvs` metadata entries.
Bytes header(uint64_t tensors, uint64_t kvs) {
  Bytes b;
  b.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(tensors).put<uint64_t>(kvs);
  return b;
}

// One tensor entry: name, dims (GGUF order), type, offset.
Bytes& tensor(Bytes& b, const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
  b.str(name).put<uint32_t>(uint32_t(ne.size()));
  for (uint64_t n : ne) b.put<uint64_t>(n);
  return b.put<uint32_t>(type).put<uint64_t>(offset);
}

TEST(Gguf, AWellFormedHandWrittenFileReads) {
  Bytes b = header(1, 1);
  b.str("general.alignment").put<uint32_t>(4).put<uint32_t>(64);
  tensor(b, "w", {64, 2}, 8, 0).pad(64).raw(2 * 2 * 34);
  const GgufFile g = b.parse();
  EXPECT_EQ(g.get("w").shape, Shape({2, 64}));
  EXPECT_EQ(g.get("w").dtype, DType::q8_0);
  EXPECT_EQ(g.get("w").nbytes(), 4u * 34);
}

TEST(Gguf, HostileFilesAreRefusedNamingTheFileAndField) {
  expect_error([] { Bytes().put<uint32_t>(0x46554747).parse(); }, {"hostile.gguf", "truncated", "the version"});
  expect_error([] { Bytes().put<uint32_t>(0x12345678).put<uint32_t>(3).parse(); }, {"hostile.gguf", "not a GGUF"});
  expect_error([] { Bytes().put<uint32_t>(0x46554747).put<uint32_t>(1).put<uint64_t>(0).put<uint64_t>(0).parse(); },
               {"version 1", "expected 2 or 3"});
  expect_error([] { header(uint64_t(1) << 60, 0).parse(); }, {"claims", "tensors"});
  expect_error([] { header(0, 1).str("k").put<uint32_t>(9).put<uint32_t>(0).put<uint64_t>(uint64_t(1) << 40).parse(); },
               {"metadata 'k'", "claims"});
  expect_error([] { header(0, 1).str("k").put<uint32_t>(13).parse(); }, {"metadata 'k'", "value type 13"});
  expect_error([] { header(0, 1).str("k").put<uint32_t>(7).put<uint8_t>(2).parse(); }, {"'k'", "bool"});
  expect_error([] { header(0, 2).str("k").put<uint32_t>(0).put<uint8_t>(1).str("k").put<uint32_t>(0).put<uint8_t>(1).parse(); },
               {"'k'", "twice"});
  expect_error([] { header(0, 1).str("general.alignment").put<uint32_t>(4).put<uint32_t>(48).parse(); },
               {"general.alignment", "power of two"});
  expect_error([] {
    Bytes b = header(1, 0);
    tensor(b, "w", {64, 2}, 8, 0).pad(32).raw(100);
    b.parse();
  }, {"hostile.gguf", "tensor 'w'", "Q8_0", "runs past the end"});
  expect_error([] {
    Bytes b = header(1, 0);
    tensor(b, "w", {48, 2}, 8, 0).pad(32).raw(1000);
    b.parse();
  }, {"tensor 'w'", "not whole 32-element blocks"});
  expect_error([] {
    Bytes b = header(1, 0);
    tensor(b, "w", {32}, 8, 8).pad(32).raw(1000);
    b.parse();
  }, {"tensor 'w'", "alignment"});
  expect_error([] {
    Bytes b = header(1, 0);
    tensor(b, "w", {uint64_t(1) << 30, uint64_t(1) << 30}, 0, 0);
    b.parse();
  }, {"tensor 'w'", "2^40"});
  expect_error([] {
    Bytes c = header(1, 0);
    tensor(c, "w", {1, 1, 1, 1, 1}, 0, 0);
    c.parse();
  }, {"5 dimensions"});
  expect_error([] {
    Bytes b = header(2, 0);
    tensor(b, "w", {32}, 0, 0);
    tensor(b, "w", {32}, 0, 128);
    b.pad(32).raw(1024);
    b.parse();
  }, {"tensor 'w'", "twice"});
  // A type apus does not read opens, and is refused when fetched, by name.
  Bytes b = header(1, 0);
  tensor(b, "iq", {256}, 16, 0).pad(32).raw(1024);
  const GgufFile g = b.parse();
  expect_error([&] { g.get("iq"); }, {"hostile.gguf", "tensor 'iq'", "IQ2_XXS", "does not read"});
  expect_error([&] { g.get("missing"); }, {"hostile.gguf", "no tensor 'missing'"});
}

TEST(Gguf, EveryTruncationOfARealFileIsRefused) {
  const std::string whole = read_file(fixture("gguf/blocks.gguf"));
  // Cuts inside the header and metadata, and inside the tensor data (the last tensor, 408 bytes,
  // ends the file but for its padding).
  for (size_t cut : {size_t(3), size_t(20), size_t(100), size_t(700), whole.size() / 2, whole.size() - 200}) {
    SCOPED_TRACE(cut);
    Bytes b;
    b.s_ = whole.substr(0, cut);
    expect_error([&] { b.parse(); }, {"hostile.gguf"});
  }
}

}  // namespace
}  // namespace apus
