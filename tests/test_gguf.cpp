// The GGUF reader against files gguf-py wrote (tools/oracle/make_gguf_fixtures.py): metadata of
// every value type, every block format dequantised bit for bit as gguf-py does, and hostile files
// refused naming the file and the field.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "core/quant_blocks.h"
#include "core/scaled_codes.h"
#include "io/model_dir.h"
#include "io/weights/gguf.h"
#include "io/weights/safetensors.h"
#include "test_util.h"
#include "text/bpe_tokenizer.h"
#include "text/klein_prompt.h"

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

// The GPU decodes a code format element by element (code_value), the CPU a row at a time through
// tables: both give every code the same bits (NaN's included), for each code format.
TEST(StoredCodes, ElementDecodeGivesTheRowDecodesBitsForEveryCode) {
  for (const DType t : {DType::fp8_e4m3, DType::fp8_e5m2, DType::i8, DType::fp4_e2m1}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const int64_t n = t == DType::fp4_e2m1 ? 512 : 256;  // every byte: both nibbles of each for fp4
    Tensor row = Tensor::heap({1, n}, t);
    for (int64_t b = 0; b < int64_t(row.nbytes()); ++b) row.ptr<uint8_t>()[b] = uint8_t(b);
    std::vector<float> by_row(size_t(n), 0.0f);
    decode_code_row(row, 0, by_row.data(), n);
    int64_t differ = 0, nan = 0;
    for (int64_t c = 0; c < n; ++c) {
      const float v = code_value(t, row.ptr<uint8_t>(), c);
      differ += std::memcmp(&v, &by_row[size_t(c)], 4) != 0;
      nan += std::isnan(v);
    }
    EXPECT_EQ(differ, 0) << " of " << n << " codes";
    EXPECT_EQ(nan, t == DType::fp8_e4m3 ? 2 : t == DType::fp8_e5m2 ? 6 : 0);
  }
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

// Metadata entries of GGUF's string (8), int32 (5) and array (9) types.
Bytes& meta_string(Bytes& b, const std::string& key, const std::string& value) {
  return b.str(key).put<uint32_t>(8).str(value);
}
Bytes& meta_strings(Bytes& b, const std::string& key, const std::vector<std::string>& values) {
  b.str(key).put<uint32_t>(9).put<uint32_t>(8).put<uint64_t>(values.size());
  for (const std::string& v : values) b.str(v);
  return b;
}
Bytes& meta_ints(Bytes& b, const std::string& key, const std::vector<int32_t>& values) {
  b.str(key).put<uint32_t>(9).put<uint32_t>(5).put<uint64_t>(values.size());
  for (int32_t v : values) b.put<int32_t>(v);
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
  expect_error(
      [] { header(0, 2).str("k").put<uint32_t>(0).put<uint8_t>(1).str("k").put<uint32_t>(0).put<uint8_t>(1).parse(); },
      {"'k'", "twice"});
  expect_error([] { header(0, 1).str("general.alignment").put<uint32_t>(4).put<uint32_t>(48).parse(); },
               {"general.alignment", "power of two"});
  expect_error([] { header(0, 1).str("general.alignment").put<uint32_t>(5).put<int32_t>(32).parse(); },
               {"general.alignment is stored as a signed integer (32)", "expected a uint32"});
  expect_error(
      [] {
        Bytes b = header(1, 0);
        tensor(b, "w", {32, 0}, 0, 0);
        b.parse();
      },
      {"tensor 'w'", "has a dimension of 0"});
  expect_error(
      [] {
        Bytes b = header(1, 0);
        tensor(b, "w", {64, 2}, 8, 0).pad(32).raw(100);
        b.parse();
      },
      {"hostile.gguf", "tensor 'w'", "Q8_0", "runs past the end"});
  expect_error(
      [] {
        Bytes b = header(1, 0);
        tensor(b, "w", {48, 2}, 8, 0).pad(32).raw(1000);
        b.parse();
      },
      {"tensor 'w'", "not whole 32-element blocks"});
  expect_error(
      [] {
        Bytes b = header(1, 0);
        tensor(b, "w", {32}, 8, 8).pad(32).raw(1000);
        b.parse();
      },
      {"tensor 'w'", "alignment"});
  expect_error(
      [] {
        Bytes b = header(1, 0);
        tensor(b, "w", {uint64_t(1) << 30, uint64_t(1) << 30}, 0, 0);
        b.parse();
      },
      {"tensor 'w'", "2^40"});
  expect_error(
      [] {
        Bytes c = header(1, 0);
        tensor(c, "w", {1, 1, 1, 1, 1}, 0, 0);
        c.parse();
      },
      {"5 dimensions"});
  expect_error(
      [] {
        Bytes b = header(2, 0);
        tensor(b, "w", {32}, 0, 0);
        tensor(b, "w", {32}, 0, 128);
        b.pad(32).raw(1024);
        b.parse();
      },
      {"tensor 'w'", "twice"});
  // A type apus does not read opens, and is refused when fetched, by name.
  Bytes b = header(1, 0);
  tensor(b, "iq", {256}, 16, 0).pad(32).raw(1024);
  const GgufFile g = b.parse();
  expect_error([&] { g.get("iq"); }, {"hostile.gguf", "tensor 'iq'", "IQ2_XXS", "does not read"});
  expect_error([&] { g.get("missing"); }, {"hostile.gguf", "no tensor 'missing'"});
}

// As ggml's reader, the tensors' data must tile the data section in the order of their infos (each
// where the previous ends, padded to the alignment): sharing, swapping or relabelling is refused.
TEST(Gguf, TensorDataMustFollowOneAnother) {
  auto file = [](std::vector<std::tuple<std::string, uint32_t, uint64_t>> entries, size_t data_bytes) {
    Bytes b = header(entries.size(), 0);
    for (const auto& [name, type, offset] : entries) tensor(b, name, {16}, type, offset);
    b.pad(32).raw(data_bytes);
    return b;
  };
  // Two F32 tensors of 64 bytes, the second at 64: reads.
  EXPECT_EQ(file({{"a", 0, 0}, {"b", 0, 64}}, 128).parse().get("b").numel(), 16);
  expect_error(
      [&] {
        file({{"a", 0, 0}, {"b", 0, 0}}, 128).parse();
      },
      {"hostile.gguf", "tensor 'b'", "data offset 0, expected 64", "tensor 'a'", "follow one another"});
  expect_error(
      [&] {
        file({{"a", 0, 64}, {"b", 0, 0}}, 128).parse();
      },
      {"tensor 'a'", "data offset 64, expected 0", "the start of the data"});
  // An F32 tensor relabelled F16 (type 1): read from half its bytes, the next one no longer where it
  // ends; as the last tensor, its other half left over.
  expect_error([&] { file({{"a", 1, 0}, {"b", 0, 64}}, 128).parse(); }, {"tensor 'b'", "data offset 64, expected 32"});
  expect_error(
      [&] {
        file({{"a", 0, 0}, {"b", 1, 64}}, 128).parse();
      },
      {"hostile.gguf", "32 bytes of tensor data follow the last tensor 'b'", "does not match"});
}

// A block's f16 scale (or min) that is NaN or infinite is refused when the tensor is fetched,
// naming the tensor, the block and its row: Q8_0's d, Q4_K's dmin, Q6_K's d at the block's end.
TEST(Gguf, NonFiniteBlockScalesAreRefusedNamingTheBlock) {
  struct Case {
    uint32_t type;
    uint64_t row, block_bytes, at;
    const char* name;
  };
  for (const Case& c : {Case{8, 32, 34, 0, "Q8_0"}, Case{12, 256, 144, 2, "Q4_K"}, Case{14, 256, 210, 208, "Q6_K"}})
    for (const uint16_t bad : {uint16_t(0x7e00), uint16_t(0x7c00), uint16_t(0xfc00)}) {
      SCOPED_TRACE(std::string(c.name) + " " + std::to_string(bad));
      Bytes b = header(1, 0);
      tensor(b, "w", {c.row, 3}, c.type, 0).pad(32);
      const size_t data = b.s_.size();
      b.s_.append(3 * c.block_bytes, '\0');  // zero scales: finite
      EXPECT_NO_THROW(b.parse().get("w"));
      std::memcpy(&b.s_[data + 2 * c.block_bytes + c.at], &bad, 2);
      const GgufFile g = b.parse();
      expect_error([&] { g.get("w"); },
                   {"hostile.gguf", "tensor 'w'", c.name, "block 2 (row 2)", "NaN or infinite scale"});
      expect_error([&] { g.get("w"); }, {"block 2"});  // refused again, not let through the second time
    }
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

// A GGUF carrying only a tokenizer, as llama.cpp's converter writes one, in a file.
struct TokenizerMetadata {
  std::string model = "gpt2", pre = "qwen2";
  std::vector<std::string> tokens = {"a", "b", "ab", "\xc4\xa0", "<|x|>", "<y>", "[PAD6]"};
  std::vector<int32_t> types = {1, 1, 1, 1, 3, 4, 5};
  std::vector<std::string> merges = {"a b"};
  std::string write(const std::string& name) const {
    Bytes b = header(0, 5);
    meta_string(b, "tokenizer.ggml.model", model);
    meta_string(b, "tokenizer.ggml.pre", pre);
    meta_strings(b, "tokenizer.ggml.tokens", tokens);
    meta_ints(b, "tokenizer.ggml.token_type", types);
    meta_strings(b, "tokenizer.ggml.merges", merges);
    const std::string path = (std::filesystem::path(::testing::TempDir()) / name).string();
    std::ofstream(path, std::ios::binary) << b.s_;
    return path;
  }
};

// The tokenizer a text encoder's GGUF carries (klein_tiny_a's, written as llama.cpp's
// convert_hf_to_gguf writes it) tokenizes every reference case as Hugging Face's tokenizer.json does.
TEST(GgufTokenizer, TheTextEncodersOwnEncodesAsHuggingFace) {
  const BpeTokenizer gguf = BpeTokenizer::load(fixture("klein_single/qwen3-tiny-Q8_0.gguf"));
  const BpeTokenizer folder = BpeTokenizer::load(fixture("klein_tiny_a/tokenizer"));
  const Json cases = read_json(fixture("tokenizer_cases.json"));
  ASSERT_EQ(cases["tokenizer"], "klein_tiny_a/tokenizer/tokenizer.json");
  ASSERT_FALSE(cases["cases"].empty());
  for (const Json& c : cases["cases"]) {
    const auto text = c["text"].get<std::string>();
    EXPECT_EQ(gguf.encode(text), c["ids"].get<std::vector<int32_t>>()) << Json(text).dump();
  }
  for (const Json& c : cases["templated"]) {
    const auto prompt = c["prompt"].get<std::string>();
    EXPECT_EQ(encode_klein_prompt(gguf, prompt, cases["max_length"].get<int>(), nullptr),
              c["input_ids"].get<std::vector<int32_t>>())
        << Json(prompt).dump();
  }
  for (const auto& [token, id] : cases["special_ids"].items()) EXPECT_EQ(gguf.token_id(token), id.get<int32_t>());
  // The padding rows past the tokenizer ([PADn], unused) are no tokens.
  EXPECT_EQ(gguf.max_id(), folder.max_id());
  expect_error([&] { gguf.token_id("[PAD2687]"); }, {"[PAD2687]"});
}

TEST(GgufTokenizer, NormalControlAndUserDefinedTokensMerge) {
  const BpeTokenizer t = BpeTokenizer::load(TokenizerMetadata().write("tok.gguf"));
  EXPECT_EQ(t.encode("ab<|x|>a<y> b"), (std::vector<int32_t>{2, 4, 0, 5, 3, 1}));
  EXPECT_EQ(t.max_id(), 5);
}

TEST(GgufTokenizer, WhatIsNotAByteLevelBpeIsRefusedNamingTheKey) {
  TokenizerMetadata m;
  m.model = "llama";
  expect_error([&] { BpeTokenizer::load(m.write("spm.gguf")); }, {"spm.gguf", "tokenizer.ggml.model 'llama'", "gpt2"});
  m = {};
  m.pre = "llama-bpe";
  expect_error([&] { BpeTokenizer::load(m.write("pre.gguf")); }, {"pre.gguf", "tokenizer.ggml.pre 'llama-bpe'"});
  m = {};
  m.types[1] = 6;
  expect_error([&] { BpeTokenizer::load(m.write("byte.gguf")); }, {"byte.gguf", "tokenizer.ggml.token_type[1] is 6"});
  m = {};
  m.types.pop_back();
  expect_error([&] { BpeTokenizer::load(m.write("count.gguf")); }, {"count.gguf", "token_type has 6 entries for 7"});
  m = {};
  m.merges = {"a c"};
  expect_error([&] { BpeTokenizer::load(m.write("merge.gguf")); },
               {"merge.gguf (tokenizer.ggml.*)", "model.merges[0]"});
  // A GGUF without a tokenizer (a DiT's) is refused naming what a tokenizer GGUF has.
  expect_error([] { BpeTokenizer::load(fixture("klein_single/flux-2-klein-tiny-Q8_0.gguf")); },
               {"flux-2-klein-tiny-Q8_0.gguf", "carries no tokenizer"});
}

}  // namespace
}  // namespace apus
