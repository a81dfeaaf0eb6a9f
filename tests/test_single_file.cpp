// Models from the files users download: klein's transformer as BFL's single file (which diffusers'
// own converter turns back into klein_tiny_a's folder exactly: tools/oracle/
// make_klein_single_file_fixtures.py), under ComfyUI's prefix, as a GGUF quantisation, and the
// text encoder and VAE as single files; each renders what the folder renders.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "apus/apus.h"
#include "core/error.h"
#include "core/scaled_codes.h"
#include "io/weights/gguf.h"
#include "io/weights/safetensors.h"
#include "io/weights/single_file.h"
#include "io/weights/synth.h"
#include "io/weights/weight_source.h"
#include "pipeline/registry.h"
#include "test_util.h"

namespace apus {
namespace {

using test::expect_error;
using test::fixture;

ImageRequest fox() {
  ImageRequest r;
  r.prompt = "a red fox in tall grass";
  r.width = 64;
  r.height = 48;
  r.seed = 7;
  return r;
}

std::vector<uint8_t> render(const ModelParts& parts, bool fp32 = false) {
  ImageRequest r = fox();
  r.fp32 = fp32;
  return ImageModel::open(parts, Weights::per_stage)->generate(r).rgb;
}

ModelParts single(const std::string& file) {
  ModelParts p;
  p.model = file;
  p.config = fixture("klein_tiny_a");
  return p;
}

// A single-file transformer renders, in bf16 and in fp32, exactly what `reference` (its values as
// another file: gguf-py's dequantisation, torch's scaled fp8) renders; returns the bf16 image.
std::vector<uint8_t> expect_renders_as(const std::string& file, const std::string& reference) {
  std::vector<uint8_t> bf16;
  for (const bool fp32 : {false, true}) {
    const std::vector<uint8_t> want = render(single(fixture(reference)), fp32);
    EXPECT_EQ(render(single(fixture(file)), fp32), want) << file << (fp32 ? " fp32" : " bf16");
    if (!fp32) bf16 = want;
  }
  return bf16;
}

// Every tensor of `from` under `prefix` + its name, as one file.
std::string rewritten(const std::string& name, const std::vector<std::string>& files, const std::string& prefix) {
  std::vector<SafetensorsFile> opened;
  std::vector<NamedTensor> tensors;
  for (const std::string& f : files) opened.push_back(SafetensorsFile::open(f));
  for (const SafetensorsFile& f : opened)
    for (const std::string& n : f.names()) tensors.push_back({prefix + n, f.get(n)});
  const std::string path = test::scratch_dir.path() + name;
  write_safetensors(path, tensors);
  return path;
}

TEST(SingleFile, BflTransformerRendersTheFoldersImage) {
  const std::vector<uint8_t> folder = render(ModelParts{fixture("klein_tiny_a")});
  EXPECT_EQ(render(single(fixture("klein_single/flux-2-klein-tiny.safetensors"))), folder);
  // ComfyUI's split file: the same keys under model.diffusion_model.
  const std::string comfy = rewritten(
      "comfy-klein.safetensors", {fixture("klein_single/flux-2-klein-tiny.safetensors")}, "model.diffusion_model.");
  EXPECT_EQ(render(single(comfy)), folder);
}

TEST(SingleFile, TextEncoderAndVaeFilesRenderTheFoldersImage) {
  const std::string root = fixture("klein_tiny_a");
  ModelParts p = single(fixture("klein_single/flux-2-klein-tiny.safetensors"));
  std::vector<std::string> shards;
  for (const auto& e : std::filesystem::directory_iterator(root + "/text_encoder"))
    if (e.path().extension() == ".safetensors") shards.push_back(e.path().string());
  p.text_encoder = rewritten("qwen3-tiny.safetensors", shards, "");
  p.vae = root + "/vae/diffusion_pytorch_model.safetensors";
  p.tokenizer = root + "/tokenizer";
  EXPECT_EQ(render(p), render(ModelParts{root}));
}

TEST(SingleFile, VaeInBflNamesRendersTheFoldersImage) {
  // klein_tiny_a's VAE in BFL's ldm names (quant convs nested, attention as 1x1 convs) and in the
  // convention diffusers' convert_ldm_vae_checkpoint reads ("vae.", quant convs at the top), both
  // checked by the oracle to convert back to the folder exactly; first_stage_model. as ComfyUI's
  // whole checkpoints carry it.
  const std::string root = fixture("klein_tiny_a");
  const std::vector<uint8_t> folder = render(ModelParts{root});
  ModelParts p{root};
  for (const std::string& vae :
       {fixture("klein_single/flux2-vae-tiny.safetensors"), fixture("klein_single/flux2-vae-tiny-sd.safetensors"),
        rewritten("ckpt-vae.safetensors", {fixture("klein_single/flux2-vae-tiny.safetensors")},
                  "first_stage_model.")}) {
    p = single(fixture("klein_single/flux-2-klein-tiny.safetensors"));
    p.vae = vae;
    EXPECT_EQ(render(p), folder) << vae;
  }
  // Editing runs the encoder: its names map too.
  ImageRequest edit = fox();
  Rgb8Image reference{64, 64, std::vector<uint8_t>(64 * 64 * 3)};
  for (size_t i = 0; i < reference.rgb.size(); ++i) reference.rgb[i] = uint8_t(i * 37 % 251);
  edit.references.push_back(reference);
  const auto folder_model = ImageModel::open(ModelParts{root}, Weights::per_stage);
  EXPECT_EQ(ImageModel::open(p, Weights::per_stage)->generate(edit).rgb, folder_model->generate(edit).rgb);
  // An ldm key FLUX.2's VAE does not have, and an ldm VAE without the latent batch norm.
  SafetensorsFile ldm = SafetensorsFile::open(fixture("klein_single/flux2-vae-tiny.safetensors"));
  std::vector<NamedTensor> tensors;
  for (const std::string& n : ldm.names()) tensors.push_back({n, ldm.get(n)});
  tensors.push_back({"decoder.up.0.attn.0.q.weight", ldm.get("decoder.conv_in.bias")});
  p.vae = test::scratch_dir.path() + "odd-vae.safetensors";
  write_safetensors(p.vae, tensors);
  expect_error([&] { render(p); }, {p.vae, "decoder.up.0.attn.0.q.weight", "not a FLUX.2 VAE key"});
  tensors.pop_back();
  std::erase_if(tensors, [](const NamedTensor& t) { return t.name.rfind("bn.", 0) == 0; });
  p.vae = test::scratch_dir.path() + "sd-vae.safetensors";
  write_safetensors(p.vae, tensors);
  expect_error([&] { render(p); }, {p.vae, "bn.running_mean", "not a FLUX.2 VAE"});
}

TEST(SingleFile, GgufQ8TransformerRendersWhatItsDequantisedWeightsRender) {
  // gguf-py's dequantisation of the file, as f32 in BFL's names: the model the GGUF holds. The
  // GGUF runs its blocks as stored, expanded panel by panel inside the linears.
  expect_renders_as("klein_single/flux-2-klein-tiny-Q8_0.gguf",
                    "klein_single/flux-2-klein-tiny-Q8_0-dequantized.safetensors");
}

// A Q8_0 block whose f16 scale is infinite or NaN used to render (its block's elements infinite):
// the request is refused naming the file, the tensor and the block.
// A BFL file with blocks its --config does not have (double_blocks.5 where num_layers is 2) used
// to render the smaller model without a word; one missing a block is refused too.
TEST(SingleFile, BlocksTheConfigDoesNotHaveAreRefusedNamingTheKey) {
  const SafetensorsFile bfl = SafetensorsFile::open(fixture("klein_single/flux-2-klein-tiny.safetensors"));
  const std::string path = ::testing::TempDir() + "apus_extra_blocks_" + std::to_string(::getpid()) + ".safetensors";
  for (const bool extra : {true, false}) {
    std::vector<NamedTensor> tensors;
    for (const std::string& n : bfl.names()) {
      const bool last_single =
          n.find("single_blocks.") != std::string::npos && n.find("single_blocks.0.") == std::string::npos;
      if (!extra && last_single) continue;  // only single block 0 left
      tensors.push_back({n, bfl.get(n)});
      if (extra && n.find("double_blocks.1.") != std::string::npos) {
        std::string copy = n;
        copy.replace(copy.find("double_blocks.1."), 16, "double_blocks.5.");
        tensors.push_back({copy, bfl.get(n)});
      }
    }
    write_safetensors(path, tensors);
    const std::string config = fixture("klein_tiny_a") + "/transformer/config.json";
    expect_error([&] { render(single(path)); },
                 extra
                     ? std::vector<std::string>{path, "double blocks up to index 5 (6)", config, "num_layers 2"}
                     : std::vector<std::string>{path, "single blocks up to index 0 (1)", config, "num_single_layers"});
  }
  std::filesystem::remove(path);
}

TEST(SingleFile, GgufBlockWithANonFiniteScaleIsRefusedNamingTheBlock) {
  const std::string source = fixture("klein_single/flux-2-klein-tiny-Q8_0.gguf");
  const std::string name = "double_blocks.0.img_attn.qkv.weight";
  const GgufFile original = GgufFile::open(source);
  ASSERT_EQ(original.get(name).dtype, DType::q8_0);
  std::ifstream in(source, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string first_block(static_cast<const char*>(original.get(name).data), 34);
  const size_t at = bytes.find(first_block);
  ASSERT_NE(at, std::string::npos);
  const int64_t block = 5, row_blocks = original.get(name).shape.back() / 32;
  for (const uint16_t bad : {uint16_t(0x7c00), uint16_t(0x7e00)}) {
    std::string spoiled = bytes;
    std::memcpy(&spoiled[at + size_t(block) * 34], &bad, 2);
    const std::string path = ::testing::TempDir() + "apus_q8_bad_scale_" + std::to_string(::getpid()) + ".gguf";
    std::ofstream(path, std::ios::binary) << spoiled;
    expect_error([&] { render(single(path)); },
                 {path, "tensor '" + name + "'", "Q8_0", "block 5 (row " + std::to_string(block / row_blocks) + ")",
                  "NaN or infinite scale"});
    std::filesystem::remove(path);
  }
}

TEST(SingleFile, GgufKQuantTransformerRendersWhatItsDequantisedWeightsRender) {
  // A mixed file as a Q4_K_M is: Q4_K and Q6_K where a row holds 256 values, Q8_0 elsewhere.
  const std::vector<uint8_t> bf16 = expect_renders_as("klein_single/flux-2-klein-tiny-Q4_K_M.gguf",
                                                      "klein_single/flux-2-klein-tiny-Q4_K_M-dequantized.safetensors");
  EXPECT_NE(bf16, render(single(fixture("klein_single/flux-2-klein-tiny.safetensors"))))
      << "the K blocks' random weights must change the image";
}

TEST(SingleFile, Fp8TransformerRendersWhatItsScaledWeightsRender) {
  // BFL's fp8 layout: float8_e4m3fn weights with per-tensor .weight_scale (and .input_scale, for
  // fp8 matmuls) against torch's weight.float() * weight_scale. Without the scales applied the
  // weights would be amax-normalised (up to 448): the test sees a dropped scale.
  expect_renders_as("klein_single/flux-2-klein-tiny-fp8.safetensors",
                    "klein_single/flux-2-klein-tiny-fp8-dequantized.safetensors");
}

TEST(SingleFile, ComfyQuantisedTransformerRendersWhatItsDequantisedWeightsRender) {
  // ComfyUI's mixed file (tools/oracle/make_comfy_quant_fixtures.py): every layout its loader reads
  // (fp8 e4m3 and e5m2, int8 with one scale and one a row, mxfp8, nvfp4) rotating over the linears,
  // tagged per layer or in the header, against comfy-kitchen's dequantisation of each weight.
  const std::vector<uint8_t> bf16 =
      expect_renders_as("klein_single/flux-2-klein-tiny-comfy-mixed.safetensors",
                        "klein_single/flux-2-klein-tiny-comfy-mixed-dequantized.safetensors");
  expect_renders_as("klein_single/flux-2-klein-tiny-comfy-header.safetensors",
                    "klein_single/flux-2-klein-tiny-comfy-mixed-dequantized.safetensors");
  EXPECT_NE(bf16, render(single(fixture("klein_single/flux-2-klein-tiny.safetensors"))))
      << "the quantisation must change the image";
  // ComfyUI's older scaled fp8 (a scaled_fp8 marker, .scale_weight) of the fp8 file's values.
  expect_renders_as("klein_single/flux-2-klein-tiny-scaled-fp8.safetensors",
                    "klein_single/flux-2-klein-tiny-fp8-dequantized.safetensors");
}

TEST(SingleFile, ComfyQuantisedWeightsDecodeAsComfyKitchenDequantisesThem) {
  // Each weight on its own, bit for bit: a block factor read from the wrong tile, nibble order,
  // e8m0 decoding or per-row scale shows here before it blurs into an image.
  const auto file = SingleFile::open(fixture("klein_single/flux-2-klein-tiny-comfy-mixed.safetensors"));
  const SafetensorsFile want =
      SafetensorsFile::open(fixture("klein_single/flux-2-klein-tiny-comfy-mixed-dequantized.safetensors"));
  std::set<std::string> layouts;
  EXPECT_EQ(file->stored_names().size(), want.names().size()) << "scales and tags are no model tensors";
  for (const std::string& name : want.names()) {
    const Tensor expected = want.get(name);
    const Tensor got = file->fetch(name, expected.shape);
    layouts.insert(std::string(dtype_name(got.dtype)) + (got.encoding.block_scales ? " blocks" : ""));
    const std::vector<float> a = to_f32_vector(got), b = to_f32_vector(expected);
    ASSERT_EQ(a.size(), b.size()) << name;
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_EQ(a[i], b[i]) << name << " element " << i << " (" << dtype_name(got.dtype) << ")";
  }
  EXPECT_EQ(layouts, (std::set<std::string>{"bf16", "fp8_e4m3", "fp8_e4m3 blocks", "fp8_e5m2", "i8", "i8 blocks",
                                            "fp4_e2m1 blocks"}));
}

TEST(SingleFile, ComfyQuantisedTextEncoderRendersWhatItsDequantisedWeightsRender) {
  // Transformers' names with ComfyUI's tags (qwen_3_4b_fp8_mixed.safetensors's layout): the
  // scales are the text encoder file's too.
  const std::string root = fixture("klein_tiny_a");
  for (const bool fp32 : {false, true}) {
    ModelParts p{root};
    p.text_encoder = fixture("klein_single/qwen3-tiny-comfy-mixed-dequantized.safetensors");
    const std::vector<uint8_t> want = render(p, fp32);
    p.text_encoder = fixture("klein_single/qwen3-tiny-comfy-mixed.safetensors");
    EXPECT_EQ(render(p, fp32), want) << (fp32 ? "fp32" : "bf16");
  }
  // Its fp8 e4m3 layers untagged, as BFL's fp8 files leave them: the scale beside the weight still
  // applies (it once did only in the transformer's reader).
  const SafetensorsFile comfy = SafetensorsFile::open(fixture("klein_single/qwen3-tiny-comfy-mixed.safetensors"));
  std::vector<NamedTensor> tensors;
  int untagged = 0;
  for (const std::string& n : comfy.names()) {
    const Tensor t = comfy.get(n);
    if (n.ends_with(".comfy_quant") &&
        std::string(static_cast<const char*>(t.data), size_t(t.numel())).find("float8_e4m3fn") != std::string::npos) {
      ++untagged;
      continue;
    }
    tensors.push_back({n, t});
  }
  ASSERT_GT(untagged, 0);
  ModelParts p{root};
  p.text_encoder = test::scratch_dir.path() + "qwen3-untagged-fp8.safetensors";
  write_safetensors(p.text_encoder, tensors);
  const std::vector<uint8_t> got = render(p, true);
  p.text_encoder = fixture("klein_single/qwen3-tiny-comfy-mixed-dequantized.safetensors");
  EXPECT_EQ(got, render(p, true));
}

TEST(SingleFile, ComfyQuantisationThatApusDoesNotReadIsRefusedNamingTheTensor) {
  const std::string source = fixture("klein_single/flux-2-klein-tiny-comfy-mixed.safetensors");
  const SafetensorsFile comfy = SafetensorsFile::open(source);
  const std::string path = test::scratch_dir.path() + "comfy-klein.safetensors";
  // The file with `edit` applied to its tensors, written to `path`.
  auto rewrite = [&](const std::function<void(std::vector<NamedTensor>&)>& edit,
                     const std::map<std::string, std::string>& metadata = {}) {
    std::vector<NamedTensor> tensors;
    for (const std::string& n : comfy.names()) tensors.push_back({n, comfy.get(n)});
    edit(tensors);
    write_safetensors(path, tensors, metadata);
    return path;
  };
  // A tag's JSON in place of another.
  auto tag = [](const std::string& json) {
    Tensor t = Tensor::heap({int64_t(json.size())}, DType::u8);
    std::memcpy(t.data, json.data(), json.size());
    return t;
  };
  auto find = [](std::vector<NamedTensor>& ts, const std::string& name) -> NamedTensor& {
    for (NamedTensor& t : ts)
      if (t.name == name) return t;
    throw std::runtime_error("no " + name);
  };
  auto tag_text = [&](const std::string& name) {
    const Tensor t = comfy.get(name);
    return std::string(static_cast<const char*>(t.data), size_t(t.numel()));
  };
  const std::string layer = "model.diffusion_model.double_blocks.0.img_attn.qkv";
  ASSERT_NE(tag_text(layer + ".comfy_quant").find("\"format\""), std::string::npos);
  struct Case {
    std::string json;
    std::vector<std::string> fragments;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"format": "convrot_w4a4"})", {"convrot_w4a4", "does not read", "nvfp4"}},
           {R"({"format": "int8_tensorwise", "convrot": true})", {"convrot", "Hadamard"}},
           {R"({"format": "mxfp8", "params": {"convrot": true}})", {"convrot"}},
           {R"({"format": "mxfp8", "block_layout": "row"})", {"block_layout", "does not know"}},
           {R"({"format": "mxfp8", "group_size": 16})", {"group_size 16", "expected 32"}},
           {R"({"full_precision_matrix_mult": true})", {"names no format"}},
           {R"({"format": "mxfp8")", {"not valid JSON"}},
           {R"(["mxfp8"])", {"not a JSON object"}},
       }) {
    rewrite([&](std::vector<NamedTensor>& ts) { find(ts, layer + ".comfy_quant").tensor = tag(c.json); });
    std::vector<std::string> fragments = {path, layer + ".comfy_quant"};
    fragments.insert(fragments.end(), c.fragments.begin(), c.fragments.end());
    expect_error([&] { render(single(path)); }, fragments);
  }
  // A format whose weight is stored otherwise, a missing scale, a tag of no weight, a block scale
  // of the wrong shape, a non-finite one, an activation smoothing factor.
  const std::string nvfp4 = "model.diffusion_model.final_layer.adaLN_modulation.1";
  std::string mxfp8;
  for (const std::string& n : comfy.names())
    if (n.ends_with(".comfy_quant") && tag_text(n).find("mxfp8") != std::string::npos)
      mxfp8 = n.substr(0, n.size() - 12);
  rewrite([&](std::vector<NamedTensor>& ts) {
    find(ts, mxfp8 + ".comfy_quant").tensor = tag(R"({"format": "int8_tensorwise"})");
  });
  expect_error([&] { render(single(path)); },
               {path, mxfp8 + ".weight", "has dtype fp8_e4m3, expected i8 for int8_tensorwise"});
  rewrite([&](std::vector<NamedTensor>& ts) {
    std::erase_if(ts, [&](const NamedTensor& t) { return t.name == nvfp4 + ".weight_scale_2"; });
  });
  expect_error([&] { render(single(path)); }, {path, nvfp4 + ".comfy_quant", "no per-tensor scale", "weight_scale_2"});
  rewrite([&](std::vector<NamedTensor>& ts) {
    ts.push_back({"model.diffusion_model.img_out.comfy_quant", tag(R"({"format": "nvfp4"})")});
  });
  expect_error([&] { render(single(path)); }, {path, "img_out.comfy_quant", "describes", "does not hold"});
  rewrite([&](std::vector<NamedTensor>& ts) {
    NamedTensor& s = find(ts, nvfp4 + ".weight_scale");
    s.tensor = s.tensor.rows(0, 64);
  });
  expect_error([&] { render(single(path)); },
               {path, nvfp4 + ".weight_scale", "[64, 4]", "expected fp8_e4m3 [128, 4]", "tiled"});
  rewrite([&](std::vector<NamedTensor>& ts) {
    NamedTensor& s = find(ts, nvfp4 + ".weight_scale");
    s.tensor = to_dtype(s.tensor, DType::f32);  // a heap copy to edit
    Tensor bytes = Tensor::heap(s.tensor.shape, DType::fp8_e4m3);
    std::memset(bytes.data, 0x38, bytes.nbytes());
    bytes.ptr<uint8_t>()[5] = 0x7f;
    s.tensor = bytes;
  });
  expect_error([&] { render(single(path)); }, {path, nvfp4 + ".weight_scale", "non-finite scale at 5"});
  rewrite([&](std::vector<NamedTensor>& ts) {
    ts.push_back({nvfp4 + ".pre_quant_scale", comfy.get(nvfp4 + ".weight_scale_2")});
  });
  expect_error([&] { render(single(path)); }, {path, nvfp4 + ".pre_quant_scale", "not read"});
  // The header's tags: a format apus does not read, keys it does not know.
  const auto header_file = [&](const std::string& meta) {
    return rewrite(
        [](std::vector<NamedTensor>& ts) {
          std::erase_if(ts, [](const NamedTensor& t) { return t.name.ends_with(".comfy_quant"); });
        },
        {{"_quantization_metadata", meta}});
  };
  header_file(R"({"format_version": "1.0", "layers": {")" + layer + R"(": {"format": "awq_w4a16"}}})");
  expect_error([&] { render(single(path)); }, {path, "_quantization_metadata", layer, "awq_w4a16", "does not read"});
  header_file(R"({"version": 2, "layers": {}})");
  expect_error([&] { render(single(path)); }, {path, "_quantization_metadata", "'version'", "does not know"});
}

TEST(SingleFile, GgufTextEncoderRendersWhatItsDequantisedWeightsRender) {
  // klein_tiny_a's Qwen3 as llama.cpp's GGUF (Q8_0, names from gguf-py's QWEN3 tensor map) against
  // gguf-py's dequantisation of it in transformers' names. The embedding table is Q8_0 too.
  const std::string root = fixture("klein_tiny_a");
  for (const bool fp32 : {false, true}) {
    ModelParts p{root};
    p.text_encoder = fixture("klein_single/qwen3-tiny-Q8_0-dequantized.safetensors");
    const std::vector<uint8_t> want = render(p, fp32);
    p.text_encoder = fixture("klein_single/qwen3-tiny-Q8_0.gguf");
    EXPECT_EQ(render(p, fp32), want) << (fp32 ? "fp32" : "bf16");
    // The tokenizer it carries (tokenizer.ggml.*) serves as --tokenizer.
    p.tokenizer = p.text_encoder;
    EXPECT_EQ(render(p, fp32), want) << (fp32 ? "fp32" : "bf16");
  }
  ModelParts no_tokenizer{root};
  no_tokenizer.tokenizer = fixture("klein_single/flux-2-klein-tiny-Q8_0.gguf");
  expect_error([&] { render(no_tokenizer); }, {"flux-2-klein-tiny-Q8_0.gguf", "carries no tokenizer"});
  ModelParts wrong{root};
  wrong.text_encoder = fixture("klein_single/flux-2-klein-tiny-Q8_0.gguf");
  expect_error([&] { render(wrong); },
               {"flux-2-klein-tiny-Q8_0.gguf", "not a Qwen3 text encoder", "token_embd.weight"});
}

TEST(SingleFile, FilesThatAreNotWhatTheyAreGivenAsAreRefusedNamingTheFile) {
  const std::string root = fixture("klein_tiny_a");
  const std::string vae = root + "/vae/diffusion_pytorch_model.safetensors";
  expect_error([&] { render(single(vae)); }, {vae, "not a FLUX.2 transformer", "single_stream_modulation"});
  // Which family a single file is, from what it holds; a file no family claims, refused naming
  // what each looks for.
  EXPECT_EQ(model_kind(single(fixture("klein_single/flux-2-klein-tiny.safetensors"))), ModelKind::image);
  EXPECT_EQ(model_kind(single(fixture("klein_single/flux-2-klein-tiny-Q8_0.gguf"))), ModelKind::image);
  expect_error([&] { model_kind(single(vae)); },
               {vae, "neither a Stable Audio 3 checkpoint", "nor a FLUX.2 transformer"});
  ModelParts p = single(fixture("klein_single/flux-2-klein-tiny.safetensors"));
  p.vae = fixture("klein_single/flux-2-klein-tiny.safetensors");
  expect_error([&] { render(p); },
               {"flux-2-klein-tiny.safetensors", "not a FLUX.2 VAE", "decoder.up.0.block.0.conv1.weight"});
  // A BFL key no FLUX.2 transformer has.
  SafetensorsFile bfl = SafetensorsFile::open(fixture("klein_single/flux-2-klein-tiny.safetensors"));
  std::vector<NamedTensor> tensors;
  for (const std::string& n : bfl.names()) tensors.push_back({n, bfl.get(n)});
  tensors.push_back({"double_blocks.0.img_attn.lora_up.weight", bfl.get("img_in.weight")});
  const std::string odd = test::scratch_dir.path() + "odd-klein.safetensors";
  write_safetensors(odd, tensors);
  expect_error([&] { render(single(odd)); }, {odd, "double_blocks.0.img_attn.lora_up.weight", "double-block key"});
  // A scale beside a weight that is not fp8, a scale of no weight, ComfyUI's mixed quantisation.
  tensors.pop_back();
  const Tensor one = bfl.get("double_blocks.0.img_attn.norm.key_norm.scale").rows(0, 1).reshape({});
  tensors.push_back({"double_blocks.0.img_attn.qkv.weight_scale", one});
  const std::string fp8 = test::scratch_dir.path() + "fp8-klein.safetensors";
  write_safetensors(fp8, tensors);
  expect_error([&] { render(single(fp8)); }, {fp8, "double_blocks.0.img_attn.qkv.weight", "beside the scale", "fp8"});
  tensors.back().name = "double_blocks.0.img_attn.qkvx.weight_scale";
  write_safetensors(fp8, tensors);
  expect_error([&] { render(single(fp8)); }, {fp8, "qkvx.weight_scale", "does not hold"});
  // An int8 weight with no scale beside it: its codes are not its values.
  tensors.pop_back();
  Tensor codes = Tensor::heap(bfl.get("img_in.weight").shape, DType::i8);
  std::memset(codes.data, 3, codes.nbytes());
  for (NamedTensor& t : tensors)
    if (t.name == "img_in.weight") t.tensor = codes;
  const std::string int8 = test::scratch_dir.path() + "int8-klein.safetensors";
  write_safetensors(int8, tensors);
  expect_error([&] { render(single(int8)); }, {int8, "tensor 'img_in.weight'", "int8 codes without a scale"});
  // Without --config, the tiny shape is no published klein.
  ModelParts bare;
  bare.model = fixture("klein_single/flux-2-klein-tiny.safetensors");
  expect_error([&] { render(bare); }, {"2 double and 3 single blocks", "--config"});
  // A folder takes no --config.
  ModelParts folder{root};
  folder.config = root;
  expect_error([&] { render(folder); }, {"--config", "only for a single-file --model"});
  // A transformer that is not the config's model: the error names the file, the config and its key.
  ModelParts other = single(fixture("klein_single/flux-2-klein-tiny.safetensors"));
  other.config = fixture("klein_tiny_9b");
  expect_error([&] { render(other); }, {"flux-2-klein-tiny.safetensors: holds single blocks up to index 2 (3)",
                                        "klein_tiny_9b/transformer/config.json", "num_single_layers 6"});
}

TEST(SingleFile, TheCliTakesTheParts) {
  const std::string out = test::scratch_dir.path() + "single.png", want = test::scratch_dir.path() + "folder.png";
  const std::string common = " --prompt 'a red fox in tall grass' -W 64 -H 48 --seed 7";
  ASSERT_EQ(test::run_cli("image --model " + fixture("klein_tiny_a") + common + " -o " + want).status, 0);
  const test::CliRun r = test::run_cli("image --model " + fixture("klein_single/flux-2-klein-tiny-Q8_0.gguf") +
                                       " --config " + fixture("klein_tiny_a") + " --vae " + fixture("klein_tiny_a") +
                                       "/vae/diffusion_pytorch_model.safetensors" + common + " -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(std::filesystem::file_size(out) > 0);
  const test::CliRun bad =
      test::run_cli("image --model " + fixture("klein_single/flux-2-klein-tiny.safetensors") + common + " -o " + out);
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("--config"), std::string::npos) << bad.output;
}

// A single file of a published shape takes klein's tokenizer from a text encoder GGUF that carries
// one, else from the Hugging Face cache, when --tokenizer is absent (the layout apus carries holds
// a stand-in), and says where it looks when
// the cache has none. klein 4B's layout as sparse files (no data: opening reads configs and the
// tokenizer only).
TEST(SingleFile, ThePublishedTokenizerComesFromTheHuggingFaceCache) {
  const std::string layout = test::scratch_dir.path() + "klein4b_layout", cache = test::scratch_dir.path() + "hub";
  synth_checkpoint(published_layout_dir("flux2-klein-4b"), layout, 1, {}, /*layout_only=*/true);
  ModelParts p;
  p.model = layout + "/transformer/diffusion_pytorch_model.safetensors";
  p.vae = layout + "/vae/diffusion_pytorch_model.safetensors";
  p.text_encoder = layout + "/text_encoder/model-00001-of-00002.safetensors";
  std::filesystem::create_directories(cache);
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  expect_error([&] { ImageModel::open(p, Weights::per_stage); },
               {"--tokenizer DIR", "black-forest-labs/FLUX.2-klein-4B's tokenizer/ folder"});
  const std::string repo = cache + "/models--black-forest-labs--FLUX.2-klein-4B";
  std::filesystem::create_directories(repo + "/refs");
  std::ofstream(repo + "/refs/main") << "0123abcd";
  const std::string tokenizer = repo + "/snapshots/0123abcd/tokenizer";
  std::filesystem::create_directories(tokenizer);
  std::ofstream(tokenizer + "/tokenizer.json") << "{}";
  // The cached folder is the one read: its (broken) tokenizer is refused naming it.
  expect_error([&] { ImageModel::open(p, Weights::per_stage); }, {tokenizer});
  // A text encoder GGUF's own tokenizer comes before the cache's.
  ModelParts with_gguf = p;
  with_gguf.text_encoder = fixture("klein_single/qwen3-tiny-Q8_0.gguf");
  EXPECT_NO_THROW(ImageModel::open(with_gguf, Weights::per_stage));
  std::filesystem::copy(published_layout_dir("flux2-klein-4b") + "/tokenizer", tokenizer,
                        std::filesystem::copy_options::overwrite_existing | std::filesystem::copy_options::recursive);
  EXPECT_EQ(ImageModel::open(p, Weights::per_stage)->label(), "diffusion_pytorch_model.safetensors");
  ::unsetenv("HF_HUB_CACHE");
}

// roofline counts a single file as the folder it was made from; bench runs it; serve refuses the
// parts options without a single-file model.
TEST(SingleFile, RooflineBenchAndServeTakeTheParts) {
  const std::string file = fixture("klein_single/flux-2-klein-tiny-Q8_0.gguf"), root = fixture("klein_tiny_a");
  const std::string size = " -W 64 -H 48 --json";
  const test::CliRun folder = test::run_cli("roofline --chip cpu --model " + root + size);
  ASSERT_EQ(folder.status, 0) << folder.output;
  const test::CliRun single = test::run_cli("roofline --chip cpu --model " + file + " --config " + root + size);
  ASSERT_EQ(single.status, 0) << single.output;
  auto totals = [](const std::string& out) {
    Json j = Json::parse(out.substr(out.find('{')));
    return std::pair{j.at("total").at("flops"), j.at("total").at("weight_bytes")};
  };
  // The same FLOPs; the weights priced at what the file stores (Q8_0's 34 bytes per 32 values).
  EXPECT_EQ(totals(single.output).first, totals(folder.output).first);
  EXPECT_LT(totals(single.output).second.get<double>(), totals(folder.output).second.get<double>());
  const std::string report = test::scratch_dir.path() + "single-bench.json";
  const test::CliRun bench = test::run_cli("bench --model " + file + " --config " + root +
                                           " -W 64 -H 48 --steps 1 --reps 1 --warmup 0 --json " + report);
  ASSERT_EQ(bench.status, 0) << bench.output;
  EXPECT_EQ(Json::parse(read_file(report)).at("model"), "flux-2-klein-tiny-Q8_0.gguf");
  const test::CliRun serve = test::run_cli("serve --model " + root + " --vae " + file + " --port 0");
  EXPECT_NE(serve.status, 0);
  EXPECT_NE(serve.output.find("for a single-file --model"), std::string::npos) << serve.output;
}

}  // namespace
}  // namespace apus
