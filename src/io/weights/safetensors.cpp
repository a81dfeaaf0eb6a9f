#include "io/weights/safetensors.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/files.h"

namespace apus {

using nlohmann::json;

SafetensorsFile SafetensorsFile::open(const std::string& path) { return parse(map_file(path)); }

SafetensorsFile SafetensorsFile::parse(std::shared_ptr<MappedFile> file) {
  const std::string& path = file->path;
  APUS_CHECK(file->size >= 8, path, ": truncated safetensors file (", file->size,
             " bytes, expected at least an 8-byte header length)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, file->data, 8);  // little-endian by format; x86 and ARM hosts are LE
  APUS_CHECK(header_len <= file->size - 8, path, ": not a safetensors file (its first 8 bytes, read as the header's ",
             "length, say ", header_len, " bytes, past the file's end at ", file->size, ")");
  APUS_CHECK(header_len <= (size_t(100) << 20), path, ": header length ", header_len,
             " exceeds the 100 MB the format allows");
  const char* hdr = reinterpret_cast<const char*>(file->data + 8);
  json header = json::parse(hdr, hdr + header_len, nullptr, /*allow_exceptions=*/false);
  APUS_CHECK(!header.is_discarded() && header.is_object(), path, ": header is not a valid JSON object");

  SafetensorsFile out;
  out.file_ = file;
  const uint8_t* base = file->data + 8 + header_len;
  const uint64_t data_size = file->size - 8 - header_len;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  // The tensor whose data ends furthest past the file's end: the header describes a longer file.
  std::string beyond_name;
  uint64_t beyond_end = 0;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& e = it.value();
    if (name == "__metadata__") {
      APUS_CHECK(e.is_object(), path, ": __metadata__ must be an object");
      for (auto m = e.begin(); m != e.end(); ++m) {
        APUS_CHECK(m.value().is_string(), path, ": __metadata__.", m.key(), " must be a string");
        out.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    APUS_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"), path,
               ": tensor '", name, "' needs dtype, shape and data_offsets");
    const json& jd = e["dtype"];
    const json& js = e["shape"];
    const json& jo = e["data_offsets"];
    APUS_CHECK(jd.is_string(), path, ": tensor '", name, "': dtype is not a string");
    Tensor t;
    APUS_CHECK(dtype_from_safetensors(jd.get<std::string>(), t.dtype), path, ": tensor '", name,
               "': unsupported dtype ", jd.get<std::string>());
    APUS_CHECK(js.is_array(), path, ": tensor '", name, "': shape is not an array");
    uint64_t numel = 1;
    for (const json& d : js) {
      APUS_CHECK(d.is_number_unsigned(), path, ": tensor '", name, "': shape entry ", d.dump(),
                 " is not a non-negative integer");
      const uint64_t v = d.get<uint64_t>();
      APUS_CHECK(v == 0 || numel <= (uint64_t(1) << 62) / v, path, ": tensor '", name, "': shape ", js.dump(),
                 " overflows");
      numel *= v;
      t.shape.push_back(int64_t(v));
    }
    APUS_CHECK(jo.is_array() && jo.size() == 2 && jo[0].is_number_unsigned() && jo[1].is_number_unsigned(), path,
               ": tensor '", name, "': data_offsets must be two non-negative integers");
    const uint64_t begin = jo[0].get<uint64_t>(), end = jo[1].get<uint64_t>();
    APUS_CHECK(begin <= end, path, ": tensor '", name, "': data_offsets [", begin, ", ", end,
               "] end before they begin");
    APUS_CHECK(end - begin == numel * dtype_size(t.dtype), path, ": tensor '", name, "': ", end - begin,
               " bytes for shape ", js.dump(), " of ", jd.get<std::string>(), " (expected ",
               numel * dtype_size(t.dtype), ")");
    if (end > data_size) {
      if (end > beyond_end) beyond_name = name, beyond_end = end;
      continue;
    }
    if (reinterpret_cast<uintptr_t>(base + begin) % dtype_size(t.dtype) == 0) {
      t.data = const_cast<uint8_t*>(base + begin);
      t.owner = file;
    } else {
      // The format packs tensors back to back: one after an odd-sized one (a kohya LoRA's bf16
      // alpha before f32 factors) is not aligned to its elements. Readers load whole elements, so
      // such a tensor is copied to aligned memory.
      Tensor aligned = Tensor::heap(t.shape, t.dtype);
      std::memcpy(aligned.data, base + begin, end - begin);
      t.data = aligned.data;
      t.owner = aligned.owner;
    }
    if (end > begin) ranges.push_back({begin, end});
    out.entries_.emplace(name, std::move(t));
  }
  const uint64_t needed = beyond_end > UINT64_MAX - 8 - header_len ? UINT64_MAX : 8 + header_len + beyond_end;
  APUS_CHECK(beyond_name.empty(), path, ": truncated: ", file->size, " of ", needed, " bytes (tensor '", beyond_name,
             "' needs bytes up to ", needed, ")");
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    APUS_CHECK(ranges[i].first >= ranges[i - 1].second, path, ": tensor data ranges overlap at byte ", ranges[i].first);
  return out;
}

const Tensor& SafetensorsFile::get(const std::string& name) const {
  auto it = entries_.find(name);
  APUS_CHECK(it != entries_.end(), path(), ": missing tensor '", name, "'");
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> v;
  for (const auto& [k, _] : entries_) v.push_back(k);
  return v;
}

std::string safetensors_header(const std::vector<SafetensorsEntry>& entries,
                               const std::vector<std::pair<std::string, std::string>>& metadata,
                               const std::string& where) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const SafetensorsEntry& t : entries) {
    APUS_CHECK(!h.contains(t.name), where, ": tensor '", t.name, "' is listed twice");
    const uint64_t bytes = uint64_t(shape_numel(t.shape)) * dtype_size(t.dtype);
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = dtype_safetensors_name(t.dtype);
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + bytes};
    h[t.name] = std::move(e);
    offset += bytes;
  }
  std::string s = h.dump();
  s.append((8 - s.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  return s;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, t.dtype, t.shape});
  const std::string h = safetensors_header(entries, {metadata.begin(), metadata.end()}, path);
  AtomicFile f(path);
  const uint64_t len = h.size();
  f.write(&len, 8);
  f.write(h.data(), h.size());
  for (const auto& [name, t] : tensors) {
    APUS_CHECK(t.data || t.nbytes() == 0, path, ": tensor '", name, "' has no data to write");
    f.write(t.data, t.nbytes());
  }
  f.commit();
}

}  // namespace apus
