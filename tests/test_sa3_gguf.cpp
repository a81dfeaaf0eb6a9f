// sa3.cpp's GGUF files (tools/oracle/make_sa3_gguf_fixtures.py: the tiny official checkpoints
// re-laid by gguf-py as sa3.cpp's converters lay them out) against the official folder they were
// made from: the same clip where the files hold the same values, within the format's own error
// where they do not, and refusals naming the file.
#include <cstring>
#include <filesystem>
#include <fstream>

#include "apus/apus.h"
#include "io/files.h"
#include "io/weights/gguf.h"
#include "io/weights/safetensors.h"
#include "io/weights/single_file.h"
#include "models/sa3/same_decoder.h"
#include "models/sa3/same_encoder.h"
#include "pipeline/registry.h"
#include "pipeline/sa3/gguf_checkpoint.h"
#include "pipeline/sa3/model_config.h"
#include "pipeline/sa3/official_checkpoint.h"
#include "pipeline/sa3/sa3_model.h"
#include "sa3_fixtures.h"
#include "test_util.h"
#include "text/bpe_tokenizer.h"
#include "text/sentencepiece_tokenizer.h"

namespace apus {
namespace {

namespace fs = std::filesystem;
using test::official_dir;
using test::official_small_dir;
using test::reference_request;

std::string gguf_fixture(const std::string& file) { return test::fixture("sa3_gguf/" + file); }
const std::string kDit = "medium/stable-audio-3-medium-dit-tiny-v1.0-F32.gguf";
const std::string kDitQ8 = "medium/stable-audio-3-medium-dit-tiny-v1.0-Q8_0.gguf";
const std::string kSame = "medium/stable-audio-3-medium-same-l-v1.0-F32.gguf";
const std::string kConditioner = "medium/stable-audio-3-medium-conditioner-v1.0-F32.gguf";
const std::string kT5 = "medium/t5gemma-b-b-ul2-encoder-tiny-v1.0-F32.gguf";
const std::string kVocab = "medium/t5gemma-b-b-ul2-v1.0-vocab.gguf";

ModelParts gguf_parts(const std::string& dit = kDit) {
  ModelParts p;
  p.model = gguf_fixture(dit);
  p.config = official_dir();
  return p;
}

// Every F32 tensor holds the official value (SAME's mappings folded once in float64, as apus
// folds them at load), so the clip is the official folder's to within the fold's rounding.
TEST(Sa3Gguf, Sa3cppFilesGiveTheOfficialFoldersClip) {
  for (const bool fp32 : {true, false}) {
    const AudioRequest r = reference_request(fp32);
    const std::vector<float> want = AudioModel::open(official_dir(), Weights::per_stage)->generate(r).samples;
    const std::unique_ptr<AudioModel> model = AudioModel::open(gguf_parts(), Weights::per_stage);
    const std::vector<float> got = model->generate(r).samples;
    ASSERT_EQ(got.size(), want.size());
    const double err = test::rel_l2(got, want);
    std::printf("[ measure ] sa3 gguf F32 %s: rel L2 to the official folder's clip %.3e\n", fp32 ? "fp32" : "bf16",
                err);
    EXPECT_EQ(got, want);
  }
  // Resident (as apus serve holds it), through AnyModel (what the file is, from its metadata).
  const AudioRequest r = reference_request(false);
  EXPECT_EQ(AnyModel::open(gguf_parts(), Weights::resident).audio()->generate(r).samples,
            AudioModel::open(official_dir(), Weights::per_stage)->generate(r).samples);
}

// The weights of `files` under the official names, decoded to f32, as an official folder's
// model.safetensors beside the tiny model's config and T5Gemma.
std::string decoded_official_folder(const std::string& name, const std::vector<std::string>& files) {
  const std::string d = test::scratch_dir.path() + name;
  fs::create_directories(d);
  for (const char* part : {"model_config.json", "t5gemma-b-b-ul2"})
    fs::create_symlink(fs::absolute(official_dir() + "/" + part), d + "/" + part);
  std::vector<std::shared_ptr<SingleFile>> opened;
  for (const std::string& f : files) opened.push_back(SingleFile::open(gguf_fixture(f)));
  const auto gguf = sa3::gguf_checkpoint(opened);
  const SafetensorsFile official = SafetensorsFile::open(official_dir() + "/model.safetensors");
  std::vector<NamedTensor> tensors;
  for (const std::string& n : official.names()) {
    if (!gguf->contains(n)) continue;
    tensors.push_back({n, to_dtype(gguf->fetch(n, official.get(n).shape), DType::f32)});
  }
  // The folded mappings, under the name the folded weight goes by.
  for (const char* mapping :
       {"pretransform.model.decoder.layers.3.mapping.weight", "pretransform.model.encoder.layers.0.mapping.weight"}) {
    const Shape v = official.get(std::string(mapping) + "_v").shape;
    tensors.push_back({mapping, to_dtype(gguf->fetch(mapping, v), DType::f32)});
  }
  write_safetensors(d + "/model.safetensors", tensors);
  return d;
}

// A Q8_0 DiT (sa3.cpp's quantiser's rule: the 2-D weights whose rows are whole 32-blocks; the
// 16-wide convs and the 17-wide local embedding stay F32) renders what the official folder renders
// with the Q8_0 values decoded (GgufBlocks holds the decode to gguf-py's bit for bit), and moves
// the clip by the format's error only.
TEST(Sa3Gguf, Q8DitRendersItsDecodedWeights) {
  const GgufFile q8 = GgufFile::open(gguf_fixture(kDitQ8));
  EXPECT_STREQ(q8.type_name("dit.0.self.qkv.weight"), "Q8_0");
  EXPECT_STREQ(q8.type_name("dit.pre_conv.weight"), "F32");
  EXPECT_STREQ(q8.type_name("dit.0.local.0.weight"), "F32");
  // The DiT holds such a weight as stored; its linears decode a panel at a time.
  EXPECT_EQ(ConvertTo(DType::bf16).apply("x.weight", q8.get("dit.0.self.qkv.weight")).dtype, DType::q8_0);
  const AudioRequest r = reference_request(true);
  const std::vector<float> got = AudioModel::open(gguf_parts(kDitQ8), Weights::per_stage)->generate(r).samples;
  const std::string decoded = decoded_official_folder("sa3_q8_decoded", {kDitQ8, kSame, kConditioner});
  EXPECT_EQ(got, AudioModel::open(decoded, Weights::per_stage)->generate(r).samples);
  const std::vector<float> f32 = AudioModel::open(gguf_parts(), Weights::per_stage)->generate(r).samples;
  const std::vector<float> bf16 =
      AudioModel::open(gguf_parts(), Weights::per_stage)->generate(reference_request(false)).samples;
  const double err = test::rel_l2(got, f32), bf16_gap = test::rel_l2(bf16, f32);
  std::printf("[ measure ] sa3 gguf Q8_0 DiT fp32: rel L2 to the F32 files' clip %.3e (bf16's: %.3e)\n", err, bf16_gap);
  EXPECT_GT(err, 0);
  EXPECT_LT(err, bf16_gap);
}

// SAME-S (the small models') from an F16 file: both mappings kernel 3, stored by sa3.cpp as one
// matrix a tap. Run in fp32, its decode and encode against the official fp32 ones: F16 rounds
// each weight to 2^-11 of itself, eight times finer than bf16 (and the activations stay fp32),
// so it must land well inside the official bf16 run's own distance.
TEST(Sa3Gguf, SameSFromF16TapsMatchesTheOfficialCodec) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_small_ref.safetensors"));
  const sa3::OfficialConfig config = sa3::read_official_config(official_small_dir() + "/model_config.json");
  ASSERT_EQ(config.same.mapping_kernel, 3);
  const std::string file = gguf_fixture("small/stable-audio-3-small-music-same-s-v1.0-F16.gguf");
  const GgufFile f16 = GgufFile::open(file);
  EXPECT_STREQ(f16.type_name("ae.dec.mapping.w2"), "F16");
  EXPECT_FALSE(f16.contains("ae.dec.mapping.weight"));
  const auto source = sa3::OfficialCheckpoint::same(sa3::gguf_checkpoint({SingleFile::open(file)}),
                                                    "pretransform.model.", config.same.differential);
  Arena arena;
  Context ctx{&arena, DType::f32};
  auto bound = [](const char* what, const std::vector<float>& ours, const std::vector<float>& fp32,
                  const std::vector<float>& bf16) {
    const double err = test::rel_l2(ours, fp32), gap = test::rel_l2(bf16, fp32);
    std::printf("[ measure ] %s from F16 taps, fp32: rel L2 %.3e (the official bf16 run's %.3e)\n", what, err, gap);
    EXPECT_LT(err, gap / 4) << what;
  };
  const auto decoder = sa3::SameDecoder::load(config.same, WeightLoader(source), DType::f32);
  const int64_t batch = ref.get("same.latents").shape[0];
  bound("same_s decode", to_f32_vector(decoder.decode(ctx, test::frames_major(ref.get("same.latents")), batch)),
        to_f32_vector(ref.get("same.fp32.audio")), to_f32_vector(ref.get("same.bf16.audio")));
  const auto encoder = sa3::SameEncoder::load(config.encoder, WeightLoader(source), DType::f32);
  bound("same_s encode", to_f32_vector(encoder.encode(ctx, ref.get("encode.audio"))),
        to_f32_vector(test::frames_major(ref.get("encode.fp32.latents"))),
        to_f32_vector(test::frames_major(ref.get("encode.bf16.latents"))));
}

// A copy of fixture `file` in `dir` with the bytes `from` (a tensor name in its header) replaced
// by `to`, of the same length.
std::string patched_copy(const std::string& file, const std::string& dir, const std::string& from,
                         const std::string& to) {
  std::string bytes = read_file(gguf_fixture(file));
  const size_t at = bytes.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(bytes.find(from, at + 1), std::string::npos) << from << " is not unique";
  bytes.replace(at, from.size(), to);
  fs::create_directories(dir);
  const std::string out = dir + "/" + fs::path(file).filename().string();
  std::ofstream(out, std::ios::binary) << bytes;
  return out;
}

// The medium files linked into `dir` (all but those in `skip`).
void link_medium(const std::string& dir, const std::vector<std::string>& skip = {}) {
  fs::create_directories(dir);
  for (const std::string& f : {kDit, kSame, kConditioner, kT5, kVocab})
    if (std::find(skip.begin(), skip.end(), f) == skip.end())
      fs::create_symlink(fs::absolute(gguf_fixture(f)), dir + "/" + fs::path(f).filename().string());
}

TEST(Sa3Gguf, WhatIsNotSa3cppsLayoutIsRefusedNamingTheFile) {
  const std::string root = test::scratch_dir.path() + "sa3_gguf_refusals/";
  // Without --config the DiT is held to the published layout its general.finetune names.
  ModelParts bare;
  bare.model = gguf_fixture(kDit);
  test::expect_error([&] { AudioModel::open(bare, Weights::per_stage); },
                     {kDit, "dit.io is 16", "stable-audio-3-medium/model_config.json says 256", "--config"});
  // Each part is what its flag says.
  ModelParts p = gguf_parts();
  p.vae = gguf_fixture(kDit);
  test::expect_error([&] { AudioModel::open(p, Weights::per_stage); },
                     {kDit, "general.architecture is 'sa3-dit'", "expected sa3-ae"});
  p = gguf_parts(kSame);
  test::expect_error([&] { AudioModel::open(p, Weights::per_stage); },
                     {kSame, "general.architecture is 'sa3-ae'", "expected sa3-dit"});
  // Parts found beside the DiT: none, or two of a kind.
  link_medium(root + "no_same", {kSame});
  p.model = root + "no_same/" + fs::path(kDit).filename().string();
  test::expect_error([&] { AudioModel::open(p, Weights::per_stage); }, {"no SAME autoencoder beside it", "--vae"});
  link_medium(root + "two_same");
  fs::copy_file(gguf_fixture(kSame), root + "two_same/copy-same-l.gguf");
  p.model = root + "two_same/" + fs::path(kDit).filename().string();
  test::expect_error([&] { AudioModel::open(p, Weights::per_stage); },
                     {"2 files beside it are sa3.cpp's SAME autoencoder", "copy-same-l.gguf", "--vae"});
  p.vae = gguf_fixture(kSame);
  EXPECT_NO_THROW(AudioModel::open(p, Weights::per_stage));
  // Two conditioners: no flag names one, so the refusal says what to do instead.
  link_medium(root + "two_conditioners");
  fs::copy_file(gguf_fixture(kConditioner), root + "two_conditioners/copy-conditioner.gguf");
  p = gguf_parts();
  p.model = root + "two_conditioners/" + fs::path(kDit).filename().string();
  test::expect_error([&] { AudioModel::open(p, Weights::per_stage); },
                     {"2 files beside it are sa3.cpp's conditioner", "keep only one beside the DiT"});
  // A corrupt GGUF, or one whose general.architecture is no string, beside the DiT is no part of
  // it: skipped (once it stopped every run, even with every part named).
  link_medium(root + "junk");
  std::ofstream(root + "junk/junk.gguf", std::ios::binary) << std::string("GGUF\xff\xff\xff\xff", 8);
  p.model = root + "junk/" + fs::path(kDit).filename().string();
  EXPECT_NO_THROW(AudioModel::open(p, Weights::per_stage)->count(reference_request(true)));
  // Every tensor is one of the layout's: an unknown name is refused, a missing one named.
  const std::string unknown = patched_copy(kDit, root + "unknown", "dit.0.ssg", "dit.0.sss");
  link_medium(root + "unknown", {kDit});
  p = gguf_parts();
  p.model = unknown;
  test::expect_error([&] { AudioModel::open(p, Weights::per_stage); },
                     {unknown, "tensor 'dit.0.sss' is no tensor of sa3.cpp's sa3-dit files"});
  const std::string missing = patched_copy(kDit, root + "missing", "dit.0.ssg", "dit.7.ssg");
  link_medium(root + "missing", {kDit});
  p.model = missing;
  test::expect_error([&] { AudioModel::open(p, Weights::per_stage)->generate(reference_request(true)); },
                     {missing, "no tensor for 'model.model.transformer.layers.0.to_scale_shift_gate'"});
}

// sa3.cpp's vocabulary (tok.tokens and tok.merges of Gemma's tokenizer.json) and that
// tokenizer.json itself give HF's GemmaTokenizer's ids on every prompt of the tokenizer fixture
// (spaces, digits, tabs, unicode, byte fallback), and decode back to the text.
TEST(Sa3Gguf, VocabularyFileTokenizesAsHuggingFace) {
  const Json cases = read_json(test::fixture("t5gemma_tokenizer_cases.json"));
  const BpeTokenizer vocab = BpeTokenizer::load(gguf_fixture(kVocab));
  const BpeTokenizer json = BpeTokenizer::load(gguf_fixture("medium/gemma-tokenizer.json"));
  EXPECT_EQ(vocab.max_id() + 1, cases["vocab_size"].get<int>());
  EXPECT_EQ(vocab.token_id("<pad>"), 0);
  int n = 0;
  for (const Json& c : cases["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const auto want = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(vocab.encode(text), want) << text;
    EXPECT_EQ(json.encode(text), want) << text;
    // Decoding turns every U+2581 into a space, a literal one in the text too (as HF's decoder).
    std::string spaced = text;
    for (size_t at; (at = spaced.find("\xE2\x96\x81")) != std::string::npos;) spaced.replace(at, 3, " ");
    EXPECT_EQ(vocab.decode(want), spaced) << text;
    ++n;
  }
  EXPECT_GE(n, 8);
  // A folder saved by transformers 5 holds tokenizer.json alone: it serves where tokenizer.model is asked for.
  const std::string saved = test::scratch_dir.path() + "gemma_json_only";
  fs::create_directories(saved);
  fs::copy_file(gguf_fixture("medium/gemma-tokenizer.json"), saved + "/tokenizer.json");
  const GemmaTokenizer from_folder = GemmaTokenizer::load(saved + "/tokenizer.model");
  const GemmaTokenizer from_vocab = GemmaTokenizer::load(gguf_fixture(kVocab));
  const SentencePieceTokenizer spm = SentencePieceTokenizer::load(test::fixture("t5gemma_tok/tokenizer.model"));
  for (const GemmaTokenizer* t : {&from_folder, &from_vocab}) {
    EXPECT_EQ(t->encode(cases["cases"][0]["text"].get<std::string>()),
              cases["cases"][0]["ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(t->pad_id(), spm.pad_id());
    EXPECT_EQ(t->bos_id(), spm.bos_id());
    EXPECT_EQ(t->eos_id(), spm.eos_id());
    EXPECT_EQ(t->vocab_size(), spm.vocab_size());
  }
  // HF matches Gemma's control tokens whole; the file's <name> pieces stand for them.
  EXPECT_EQ(vocab.encode("a<eos>b"), json.encode("a<eos>b"));
  EXPECT_EQ(vocab.encode("a<eos>b")[1], 1);
}

// The whole pipeline from sa3.cpp's files alone (no --config: the tiny widths are held to an
// official folder made of the tiny config and nothing else, so the tokenizer is the vocabulary
// file found beside the DiT) gives the official folder's clip.
TEST(Sa3Gguf, FilesAloneWithTheirVocabularyGiveTheOfficialClip) {
  const std::string config = test::scratch_dir.path() + "sa3_gguf_config_only";
  fs::create_directories(config + "/t5gemma-b-b-ul2");
  fs::create_symlink(fs::absolute(official_dir() + "/model_config.json"), config + "/model_config.json");
  for (const char* f : {"config.json", "tokenizer_config.json"})
    fs::create_symlink(fs::absolute(official_dir() + "/t5gemma-b-b-ul2/" + f), config + "/t5gemma-b-b-ul2/" + f);
  ModelParts p;
  p.model = gguf_fixture(kDit);
  p.config = config;
  const AudioRequest r = reference_request(true);
  const std::vector<float> want = AudioModel::open(official_dir(), Weights::per_stage)->generate(r).samples;
  EXPECT_EQ(AudioModel::open(p, Weights::per_stage)->generate(r).samples, want);
}

}  // namespace
}  // namespace apus
