#include "pipeline/klein/lora.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "io/weights/peft_config.h"
#include "io/weights/safetensors.h"
#include "pipeline/klein/single_file.h"

namespace apus::flux2 {

namespace {

// One adapted module's tensors as the file stores them, by role (down/up, LoHa's hada_w1_a ...,
// LoKr's lokr_w1 ...), with the key each came from.
struct Module {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> keys;
  std::optional<float> alpha;
  bool has(const std::string& role) const { return tensors.count(role) > 0; }
  std::string any_key() const { return keys.begin()->second; }
};

// The tensor suffixes of each adapter kind, and the role each names.
const std::pair<const char*, const char*> kRoles[] = {
    {".lora_A.weight", "down"},  {".lora_down.weight", "down"}, {".lora_B.weight", "up"},
    {".lora_up.weight", "up"},   {".hada_w1_a", "hada_w1_a"},   {".hada_w1_b", "hada_w1_b"},
    {".hada_w2_a", "hada_w2_a"}, {".hada_w2_b", "hada_w2_b"},   {".lokr_w1", "lokr_w1"},
    {".lokr_w1_a", "lokr_w1_a"}, {".lokr_w1_b", "lokr_w1_b"},   {".lokr_w2", "lokr_w2"},
    {".lokr_w2_a", "lokr_w2_a"}, {".lokr_w2_b", "lokr_w2_b"},   {".alpha", "alpha"}};

// The ΔW of a module's tensors and the rank its alpha divides (0: alpha is not used, as LyCORIS
// ignores it for a LoKr of two whole matrices).
struct Delta {
  LowRank change;
  int64_t rank = 0;
};

Tensor role(const Module& m, const std::string& name, const std::string& path) {
  const auto it = m.tensors.find(name);
  APUS_CHECK(it != m.tensors.end(), path, ": key '", m.any_key(), "' has no ", name, " tensor beside it");
  APUS_CHECK(it->second.rank() == 2, path, ": key '", m.keys.at(name), "' has shape ", shape_str(it->second.shape),
             ", expected a matrix");
  return it->second;
}

// A LoKr factor: whole (lokr_wN) or a low-rank pair (lokr_wN_a · lokr_wN_b).
Factor lokr_factor(const Module& m, const std::string& w, const std::string& path, int64_t& rank) {
  if (m.has(w)) {
    APUS_CHECK(!m.has(w + "_a") && !m.has(w + "_b"), path, ": key '", m.keys.at(w), "' stands beside ", w, "_a / ", w,
               "_b; a LoKr factor is one or the other");
    return Factor{Tensor(), role(m, w, path)};
  }
  const Tensor a = role(m, w + "_a", path), b = role(m, w + "_b", path);
  APUS_CHECK(a.dim(1) == b.dim(0), path, ": '", m.keys.at(w + "_a"), "' ", shape_str(a.shape), " and '",
             m.keys.at(w + "_b"), "' ", shape_str(b.shape), " are no low-rank pair");
  rank = b.dim(0);
  return Factor{b, a};
}

Delta module_delta(const Module& m, const std::string& path) {
  Delta d;
  if (m.has("down") || m.has("up")) {
    const Tensor down = role(m, "down", path), up = role(m, "up", path);
    APUS_CHECK(down.dim(0) == up.dim(1), path, ": '", m.keys.at("down"), "' ", shape_str(down.shape), " and '",
               m.keys.at("up"), "' ", shape_str(up.shape), " are no low-rank pair (expected [r, in] and [out, r])");
    d.change.inner = Factor{down, up};
    d.rank = down.dim(0);
  } else if (m.has("hada_w1_a") || m.has("hada_w1_b") || m.has("hada_w2_a") || m.has("hada_w2_b")) {
    // (A1·B1) ⊙ (A2·B2) = Σ_st (A1[:, s] ⊙ A2[:, t]) (B1[s, :] ⊙ B2[t, :]): a rank r1·r2 pair.
    const Tensor a1 = role(m, "hada_w1_a", path), b1 = role(m, "hada_w1_b", path);
    const Tensor a2 = role(m, "hada_w2_a", path), b2 = role(m, "hada_w2_b", path);
    const int64_t r1 = b1.dim(0), r2 = b2.dim(0), out = a1.dim(0), in = b1.dim(1);
    APUS_CHECK(a1.dim(1) == r1 && a2.dim(1) == r2 && a2.dim(0) == out && b2.dim(1) == in, path, ": '",
               m.keys.at("hada_w1_a"), "' ", shape_str(a1.shape), ", '", m.keys.at("hada_w1_b"), "' ",
               shape_str(b1.shape), ", '", m.keys.at("hada_w2_a"), "' ", shape_str(a2.shape), " and '",
               m.keys.at("hada_w2_b"), "' ", shape_str(b2.shape), " are no LoHa (expected [out, r1], [r1, in], ",
               "[out, r2], [r2, in])");
    Tensor down = Tensor::heap({r1 * r2, in}, DType::f32), up = Tensor::heap({out, r1 * r2}, DType::f32);
    for (int64_t s = 0; s < r1; ++s)
      for (int64_t t = 0; t < r2; ++t) {
        float* row = down.ptr<float>() + (s * r2 + t) * in;
        for (int64_t i = 0; i < in; ++i) row[i] = load_f32(b1, s * in + i) * load_f32(b2, t * in + i);
        for (int64_t o = 0; o < out; ++o)
          up.ptr<float>()[o * r1 * r2 + s * r2 + t] = load_f32(a1, o * r1 + s) * load_f32(a2, o * r2 + t);
      }
    d.change.inner = Factor{down, up};
    d.rank = r1;
  } else {
    // LyCORIS: alpha / the rank of w2's pair, else of w1's, else alpha unused.
    int64_t rank1 = 0, rank2 = 0;
    d.change.outer = lokr_factor(m, "lokr_w1", path, rank1);
    d.change.inner = lokr_factor(m, "lokr_w2", path, rank2);
    d.rank = rank2 ? rank2 : rank1;
  }
  return d;
}

// A factor with only rows [begin, end) of its matrix.
Factor factor_rows(const Factor& f, int64_t begin, int64_t end) { return Factor{f.down, f.up.rows(begin, end)}; }

// A factor with its two halves of rows swapped.
Factor swap_row_halves(const Factor& f) { return Factor{f.down, row_blocks_permuted(f.up, {1, 0})}; }

}  // namespace

void read_lora(const Lora& lora, const std::map<std::string, Shape>& weights, int64_t double_blocks,
               int64_t single_blocks, Adapters& into) {
  const std::string& path = lora.file;
  APUS_CHECK(std::isfinite(lora.scale), path, ": LoRA scale ", lora.scale, " is not a finite number");
  const auto file = std::make_shared<SafetensorsFile>(SafetensorsFile::open(path));
  // kohya's underscored module names -> BFL's or diffusers' dotted ones.
  std::map<std::string, std::string> underscored;
  auto underscore = [](std::string s) {
    for (char& ch : s)
      if (ch == '.') ch = '_';
    return s;
  };
  for (const std::string& m : bfl_modules(double_blocks, single_blocks))
    for (const char* prefix : {"lora_unet_", "lycoris_"}) underscored[prefix + underscore(m)] = m;
  // Trainers that name diffusers' modules the kohya way use any of these prefixes.
  for (const auto& [name, shape] : weights)
    if (name.ends_with(".weight"))
      for (const char* prefix : {"lora_transformer_", "lora_unet_", "lycoris_"})
        underscored.emplace(prefix + underscore(name.substr(0, name.size() - 7)), name.substr(0, name.size() - 7));

  std::map<std::string, Module> modules;  // dotted module name -> its tensors
  for (const std::string& key : file->names()) {
    for (const char* te : {"text_encoder.", "lora_te_", "lora_te1_", "lora_te2_", "te."})
      APUS_CHECK(!key.starts_with(te), path, ": key '", key,
                 "' adapts the text encoder; apus applies adapters to the transformer only");
    // Adapter kinds apus does not apply, by the marker in their keys.
    static const std::pair<const char*, const char*> kOtherKinds[] = {{".dora_scale", "DoRA"},
                                                                      {".lokr_t", "LoKr Tucker (convolution)"},
                                                                      {".hada_t", "LoHa Tucker (convolution)"},
                                                                      {".diff", "full-difference"},
                                                                      {".lora_mid", "LoCon mid"}};
    for (const auto& [marker, kind] : kOtherKinds)
      APUS_CHECK(key.find(marker) == std::string::npos, path, ": key '", key, "' is a ", kind,
                 " tensor; apus applies LoRA, LoHa and LoKr adapters of linears only");
    std::string name = key;
    for (const char* prefix : {"base_model.model.", "transformer.", "model.diffusion_model.", "diffusion_model."})
      if (name.starts_with(prefix)) name = name.substr(std::strlen(prefix));
    std::string kind;
    for (const auto& [suffix, named] : kRoles)
      if (name.ends_with(suffix)) {
        kind = named;
        name = name.substr(0, name.size() - std::strlen(suffix));
        break;
      }
    APUS_CHECK(!kind.empty(), path, ": key '", key, "' is no adapter tensor (expected .lora_A.weight / ",
               ".lora_B.weight, .lora_down.weight / .lora_up.weight, LoHa's .hada_w1_a ..., LoKr's .lokr_w1 ... or ",
               ".alpha)");
    if (name.starts_with("lora_unet_") || name.starts_with("lora_transformer_") || name.starts_with("lycoris_")) {
      const auto it = underscored.find(name);
      APUS_CHECK(it != underscored.end(), path, ": key '", key, "' names no module of this FLUX.2 transformer");
      name = it->second;
    }
    Module& m = modules[name];
    const Tensor& t = file->get(key);
    if (kind == "alpha") {
      APUS_CHECK(t.numel() == 1, path, ": key '", key, "' has shape ", shape_str(t.shape), ", expected one value");
      m.alpha = load_f32(t, 0);
      continue;
    }
    APUS_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f16 || t.dtype == DType::f32, path, ": key '", key,
               "' has dtype ", dtype_name(t.dtype), ", expected bf16, f16 or f32");
    m.tensors[kind] = t;
    m.keys[kind] = key;
  }
  APUS_CHECK(!modules.empty(), path, ": holds no LoRA tensors");
  const PeftConfig peft = read_peft_config(*file, path);
  std::vector<DiffusersTarget> targets;
  for (auto& [name, m] : modules) {
    APUS_CHECK(!m.tensors.empty(), path, ": the alpha of '", name, "' adapts nothing (no factors beside it)");
    Delta delta = module_delta(m, path);
    const double rank = double(delta.rank);
    const std::optional<double> alpha = m.alpha ? std::optional<double>(*m.alpha) : peft.alpha_of(name);
    const double per_rank = alpha && delta.rank ? peft.scaling(*alpha, rank) : 1.0;
    delta.change.scale = float(double(lora.scale) * per_rank);
    const std::string key = m.keys.count("up") ? m.keys.at("up") : m.any_key();
    delta.change.source = path + ": '" + key + "'";
    if (weights.count(name + ".weight")) {
      targets = {{name}};
    } else {
      APUS_CHECK(bfl_module_targets(name, targets), path, ": key '", key,
                 "' names no module of this FLUX.2 transformer (in diffusers' or BFL's names)");
    }
    for (const DiffusersTarget& t : targets) {
      const auto w = weights.find(t.module + ".weight");
      APUS_CHECK(w != weights.end(), path, ": key '", key, "' adapts '", t.module,
                 "', which this FLUX.2 transformer does not have");
      LowRank change = delta.change;
      // A fused weight's parts, and BFL's (shift, scale) rows as diffusers' (scale, shift), are
      // rows of ΔW: of its up factor, or of a Kronecker product's outer factor.
      Factor& rows = change.kronecker() ? change.outer : change.inner;
      if (t.parts > 1) {
        APUS_CHECK(rows.rows() % t.parts == 0, path, ": '", key, "' has ", rows.rows(), " rows",
                   change.kronecker() ? " in its outer Kronecker factor" : "", ", expected ", t.parts,
                   " stacked parts");
        rows = factor_rows(rows, t.part * rows.rows() / t.parts, (t.part + 1) * rows.rows() / t.parts);
      }
      if (t.swap_halves) {
        APUS_CHECK(rows.rows() % 2 == 0, path, ": '", key, "' has ", rows.rows(), " rows",
                   change.kronecker() ? " in its outer Kronecker factor" : "", ", expected two halves");
        rows = swap_row_halves(rows);
      }
      // The views keep the file mapped for as long as the request's adapters live.
      into.add(t.module + ".weight", w->second, std::move(change));
    }
  }
}

}  // namespace apus::flux2
