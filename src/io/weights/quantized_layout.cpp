#include "io/weights/quantized_layout.h"

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/scaled_codes.h"

namespace apus {

namespace {

using nlohmann::json;

constexpr const char* kFormats = "float8_e4m3fn, float8_e5m2, int8_tensorwise, mxfp8 and nvfp4";

bool known_format(const std::string& f) {
  return f == "float8_e4m3fn" || f == "float8_e5m2" || f == "int8_tensorwise" || f == "mxfp8" || f == "nvfp4";
}

// The elements one block scale covers, 0 for a format without blocks.
int64_t format_block(const std::string& f) { return f == "mxfp8" ? 32 : f == "nvfp4" ? 16 : 0; }

std::string strip_suffix(const std::string& name, const std::string& suffix) {
  return name.substr(0, name.size() - suffix.size());
}

void refuse_convrot(const std::string& path, const std::string& where, const json& v) {
  APUS_CHECK(v.is_boolean(), path, ": ", where, " has convrot that is not true or false");
  APUS_CHECK(!v.get<bool>(), path, ": ", where,
             " sets convrot (ComfyUI's Hadamard-rotated int8 weights), which apus does not read");
}

// One layer's JSON, checked as comfy/ops.py reads it; returns its format. `where` names the tag.
std::string layer_format(const std::string& path, const std::string& where, const json& conf) {
  APUS_CHECK(conf.is_object(), path, ": ", where, " is not a JSON object");
  std::string format;
  const json* group_size = nullptr;
  for (auto it = conf.begin(); it != conf.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "format") {
      APUS_CHECK(v.is_string(), path, ": ", where, " has a format that is not a string");
      format = v.get<std::string>();
    } else if (key == "full_precision_matrix_mult") {
      // apus always multiplies the decoded weight: what this asks for.
      APUS_CHECK(v.is_boolean(), path, ": ", where, " has full_precision_matrix_mult that is not true or false");
    } else if (key == "group_size") {
      group_size = &v;
    } else if (key == "convrot") {
      refuse_convrot(path, where, v);
    } else if (key == "params") {
      APUS_CHECK(v.is_object(), path, ": ", where, " has params that are not a JSON object");
      for (auto p = v.begin(); p != v.end(); ++p) {
        APUS_CHECK(p.key() == "convrot" || p.key() == "convrot_groupsize", path, ": ", where, " has params key '",
                   p.key(), "', which apus does not know (it reads convrot, convrot_groupsize)");
        if (p.key() == "convrot") refuse_convrot(path, where, p.value());
      }
    } else if (key == "convrot_groupsize" || key == "orig_dtype") {
      // Without convrot the group size means nothing; orig_dtype is the compute dtype, apus's own.
    } else {
      fail(path, ": ", where, " has key '", key, "', which apus does not know (it reads format, ",
           "full_precision_matrix_mult, group_size, convrot, convrot_groupsize, params, orig_dtype)");
    }
  }
  APUS_CHECK(!format.empty(), path, ": ", where, " names no format");
  APUS_CHECK(known_format(format), path, ": ", where, " has format '", format, "', which apus does not read (it reads ",
             kFormats, ")");
  if (group_size) {
    const int64_t block = format_block(format);
    APUS_CHECK(group_size->is_number_integer() && block && group_size->get<int64_t>() == block, path, ": ", where,
               " has group_size ", group_size->dump(), ", expected ",
               block ? std::to_string(block) + " for " + format : "none for " + format);
  }
  return format;
}

json parse_json(const std::string& path, const std::string& where, const std::string& text) {
  json j = json::parse(text, nullptr, false);
  APUS_CHECK(!j.is_discarded(), path, ": ", where, " is not valid JSON");
  return j;
}

std::string tensor_text(const std::string& path, const SafetensorsFile& file, const std::string& name) {
  const Tensor& t = file.get(name);
  APUS_CHECK(t.dtype == DType::u8 && t.rank() == 1, path, ": tensor '", name, "' is ", dtype_name(t.dtype), " ",
             shape_str(t.shape), ", expected U8 bytes of JSON (ComfyUI's per-layer quantisation tag)");
  return std::string(static_cast<const char*>(t.data), size_t(t.numel()));
}

struct Tag {
  json conf;
  std::string where;
  bool legacy = false;  // scaled_fp8: the scale is .scale_weight
};

}  // namespace

QuantizedLayout read_quantized_layout(const std::string& path, const SafetensorsFile& file) {
  QuantizedLayout out;
  const std::vector<std::string> names = file.names();
  std::map<std::string, Tag> tags;  // layer -> its tag
  const auto header = file.metadata().find("_quantization_metadata");
  if (header != file.metadata().end()) {
    const std::string where = "header entry _quantization_metadata";
    const json meta = parse_json(path, where, header->second);
    APUS_CHECK(meta.is_object() && meta.contains("layers") && meta["layers"].is_object(), path, ": ", where,
               " is not {\"layers\": {...}}");
    for (auto it = meta.begin(); it != meta.end(); ++it)
      APUS_CHECK(it.key() == "layers" || it.key() == "format_version", path, ": ", where, " has key '", it.key(),
                 "', which apus does not know (it reads layers, format_version)");
    for (auto it = meta["layers"].begin(); it != meta["layers"].end(); ++it)
      tags[it.key()] = {it.value(), where + ", layer '" + it.key() + "'"};
  } else {
    // ComfyUI reads the older scaled fp8 only without the header entry.
    for (const std::string& n : names)
      if (n == "scaled_fp8" || n.ends_with(".scaled_fp8")) out.sidecars.insert(n);
    if (!out.sidecars.empty())
      for (const std::string& n : names)
        if (n.ends_with(".scale_weight"))
          tags[strip_suffix(n, ".scale_weight")] = {json{{"format", "float8_e4m3fn"}}, "tensor '" + n + "'", true};
  }
  for (const std::string& n : names) {
    if (!n.ends_with(".comfy_quant")) continue;
    out.sidecars.insert(n);
    const std::string layer = strip_suffix(n, ".comfy_quant");
    const std::string where = "tensor '" + n + "'";
    if (!tags.count(layer)) tags[layer] = {parse_json(path, where, tensor_text(path, file, n)), where};
  }
  for (const auto& [layer, tag] : tags) {
    QuantizedWeight q;
    q.format = layer_format(path, tag.where, tag.conf);
    const std::string weight = layer + ".weight";
    APUS_CHECK(file.contains(weight), path, ": ", tag.where, " describes '", weight, "', which the file does not hold");
    q.scale = layer + (tag.legacy ? ".scale_weight" : ".weight_scale");
    APUS_CHECK(file.contains(q.scale), path, ": ", tag.where, " (", q.format, ") has no scale tensor '", q.scale, "'");
    if (q.format == "nvfp4") {
      q.scale_2 = layer + ".weight_scale_2";
      APUS_CHECK(file.contains(q.scale_2), path, ": ", tag.where, " (nvfp4) has no per-tensor scale '", q.scale_2, "'");
      out.sidecars.insert(q.scale_2);
    }
    APUS_CHECK(!file.contains(layer + ".pre_quant_scale"), path, ": tensor '", layer,
               ".pre_quant_scale' (an activation smoothing factor) is not read by apus");
    out.sidecars.insert(q.scale);
    out.weights[weight] = q;
  }
  for (const std::string& n : names) {
    if (n.ends_with(".input_scale") || n.ends_with(".scale_input")) out.sidecars.insert(n);
    if (out.sidecars.count(n)) continue;
    APUS_CHECK(!n.ends_with(".weight_scale_2"), path, ": tensor '", n, "' is an nvfp4 scale of no nvfp4-tagged layer");
    if (!n.ends_with(".weight_scale")) continue;
    // BFL's fp8 files tag nothing: an fp8 weight's per-tensor scale sits beside it.
    const std::string weight = strip_suffix(n, "_scale");
    APUS_CHECK(file.contains(weight), path, ": tensor '", n, "' scales '", weight, "', which the file does not hold");
    const DType dt = file.get(weight).dtype;
    APUS_CHECK(dt == DType::fp8_e4m3 || dt == DType::fp8_e5m2, path, ": tensor '", weight, "' has dtype ",
               dtype_name(dt), " beside the scale '", n, "', expected fp8 (an untagged scale is a per-tensor fp8 one)");
    out.weights[weight] = {dt == DType::fp8_e4m3 ? "float8_e4m3fn" : "float8_e5m2", n, ""};
    out.sidecars.insert(n);
  }
  return out;
}

Tensor quantized_weight(const std::string& path, const SafetensorsFile& file, const std::string& stored,
                        const QuantizedWeight& q) {
  Tensor w = file.get(stored);
  auto expect_dtype = [&](DType want) {
    APUS_CHECK(w.dtype == want, path, ": tensor '", stored, "' has dtype ", dtype_name(w.dtype), ", expected ",
               dtype_name(want), " for ", q.format);
  };
  auto scalar = [&](const std::string& name) {
    const Tensor& s = file.get(name);
    APUS_CHECK(s.numel() == 1 && (s.dtype == DType::f32 || s.dtype == DType::bf16 || s.dtype == DType::f16), path,
               ": tensor '", name, "' is ", dtype_name(s.dtype), " ", shape_str(s.shape),
               ", expected one float (a per-tensor scale)");
    const float v = load_f32(s, 0);
    APUS_CHECK(std::isfinite(v) && v > 0, path, ": tensor '", name, "' is ", v, ", expected a positive scale");
    return v;
  };
  if (q.format == "float8_e4m3fn" || q.format == "float8_e5m2") {
    expect_dtype(q.format == "float8_e4m3fn" ? DType::fp8_e4m3 : DType::fp8_e5m2);
    w.encoding.code_scale = scalar(q.scale);
    return w;
  }
  if (q.format == "nvfp4") {
    expect_dtype(DType::u8);
    APUS_CHECK(w.rank() == 2, path, ": tensor '", stored, "' is ", shape_str(w.shape), ", expected a matrix (nvfp4)");
    w.dtype = DType::fp4_e2m1;  // two codes a byte
    w.shape[1] *= 2;
  } else {
    expect_dtype(q.format == "int8_tensorwise" ? DType::i8 : DType::fp8_e4m3);
    APUS_CHECK(w.rank() == 2, path, ": tensor '", stored, "' is ", shape_str(w.shape), ", expected a matrix (",
               q.format, ")");
  }
  const int64_t rows = w.shape[0], cols = w.shape[1];
  Tensor s = file.get(q.scale);
  auto blocks = std::make_shared<BlockScales>();
  if (q.format == "int8_tensorwise") {
    if (s.numel() == 1) {
      w.encoding.code_scale = scalar(q.scale);
      return w;
    }
    APUS_CHECK(((s.rank() == 1 && s.shape[0] == rows) || (s.rank() == 2 && s.shape == Shape{rows, 1})) &&
                   (s.dtype == DType::f32 || s.dtype == DType::bf16 || s.dtype == DType::f16),
               path, ": tensor '", q.scale, "' is ", dtype_name(s.dtype), " ", shape_str(s.shape),
               ", expected one float or one a row of '", stored, "' ([", rows, "] or [", rows, ", 1])");
    blocks->factors = s.reshape({rows});
    blocks->block = cols;
    blocks->per_row = 1;
    for (int64_t r = 0; r < rows; ++r) {
      const float v = load_f32(s, r);
      APUS_CHECK(std::isfinite(v) && v > 0, path, ": tensor '", q.scale, "' row ", r, " is ", v,
                 ", expected a positive scale");
    }
  } else {
    const int64_t block = format_block(q.format);
    const DType scale_dtype = q.format == "mxfp8" ? DType::e8m0 : DType::fp8_e4m3;
    APUS_CHECK(cols % block == 0, path, ": tensor '", stored, "' has ", cols, " columns, expected whole blocks of ",
               block, " (", q.format, ")");
    const Shape tiled = {(rows + 127) / 128 * 128, (cols / block + 3) / 4 * 4};
    APUS_CHECK((s.dtype == scale_dtype || s.dtype == DType::u8) && s.shape == tiled, path, ": tensor '", q.scale,
               "' is ", dtype_name(s.dtype), " ", shape_str(s.shape), ", expected ", dtype_name(scale_dtype), " ",
               shape_str(tiled), " (", q.format, "'s block scales of '", stored, "' in cuBLAS's tiled order)");
    s.dtype = scale_dtype;  // ComfyUI views U8 bytes as the scale dtype
    const uint8_t* bytes = s.ptr<uint8_t>();
    for (int64_t i = 0; i < s.numel(); ++i)
      APUS_CHECK(q.format == "mxfp8" ? bytes[i] != 0xff : (bytes[i] & 0x7f) != 0x7f, path, ": tensor '", q.scale,
                 "' holds a non-finite scale at ", i);
    blocks->factors = s;
    blocks->block = block;
    blocks->per_row = cols / block;
    blocks->tiled = true;
    if (q.format == "nvfp4") w.encoding.code_scale = scalar(q.scale_2);
  }
  w.encoding.block_scales = std::move(blocks);
  return w;
}

}  // namespace apus
