// libFuzzer target for the LoRA readers: any file must be read into adapters or raise apus::Error,
// never crash or read outside the file (ASan watches), by klein's reader against klein_tiny_a's
// transformer shapes (one double and one single block, as the reader's name tables see them) and by
// Stable Audio 3's against a one-block differential DiT and the duration conditioner.
#include <cstdint>
#include <map>
#include <string>

#include "core/error.h"
#include "fuzz_file.h"
#include "pipeline/klein/lora.h"
#include "pipeline/sa3/lora.h"

namespace {

const std::map<std::string, apus::Shape>& weights() {
  static const std::map<std::string, apus::Shape> w = [] {
    std::map<std::string, apus::Shape> m;
    const int64_t h = 64, f = 192;
    m["x_embedder.weight"] = {h, 128};
    m["context_embedder.weight"] = {h, 96};
    m["proj_out.weight"] = {128, h};
    m["norm_out.linear.weight"] = {2 * h, h};
    for (const char* n : {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"})
      m[std::string("transformer_blocks.0.attn.") + n + ".weight"] = {h, h};
    m["transformer_blocks.0.attn.to_out.0.weight"] = {h, h};
    m["transformer_blocks.0.ff.linear_in.weight"] = {2 * f, h};
    m["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"] = {3 * h + 2 * f, h};
    m["single_transformer_blocks.0.attn.to_out.weight"] = {h, h + f};
    m["single_transformer_blocks.0.attn.norm_q.weight"] = {32};
    return m;
  }();
  return w;
}

const apus::sa3::LoraTargets& sa3_targets() {
  static const apus::sa3::LoraTargets t = [] {
    const int64_t d = 128, io = 16;
    std::map<std::string, apus::Shape> dit;
    dit["transformer_blocks.0.self_attn.to_qkv.weight"] = {5 * d, d};
    dit["transformer_blocks.0.ff.proj_in.weight"] = {8 * d, d};
    dit["transformer_blocks.0.to_local_embed.0.weight"] = {d, io + 1};
    dit["preprocess_conv.weight"] = {io, io, 1};
    dit["proj_in.weight"] = {d, io};
    return apus::sa3::lora_targets(dit, {{"linear.weight", {d, 256}}}, true);
  }();
  return t;
}

// Every factor's first and last element: inside the file.
void touch(const apus::Adapters& adapters, const std::string& name) {
  if (const auto* factors = adapters.find(name))
    for (const apus::LowRank& f : *factors)
      for (const apus::Factor* part : {&f.inner, &f.outer})
        for (const apus::Tensor* t : {&part->down, &part->up, &f.magnitude})
          if (t->defined()) {
            volatile float a = apus::load_f32(*t, 0), b = apus::load_f32(*t, t->numel() - 1);
            (void)a;
            (void)b;
          }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = apus::fuzz::write_input("lora.safetensors", data, size);
  apus::fuzz::expect_only_apus_errors([&] {
    apus::Adapters adapters;
    apus::flux2::read_lora({path, 0.75f}, weights(), 1, 1, adapters);
    for (const auto& [name, shape] : weights()) touch(adapters, name);
  });
  apus::fuzz::expect_only_apus_errors([&] {
    apus::Adapters adapters;
    apus::sa3::read_lora({path, 0.75f}, sa3_targets(), adapters);
    for (const auto& [module, target] : sa3_targets().official) touch(adapters, target.weight);
  });
  return 0;
}
