#include "io/weights/synth.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "io/cache_dir.h"
#include "io/files.h"
#include "io/model_dir.h"
#include "io/weights/safetensors.h"

namespace apus {
namespace {

namespace fs = std::filesystem;

struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t nbytes() const { return uint64_t(shape_numel(shape)) * dtype_size(dtype); }
};

struct FileSpec {
  std::string rel;  // relative to the checkpoint root
  std::vector<std::pair<std::string, std::string>> metadata;
  std::vector<TensorSpec> tensors;  // in on-disk order
};

struct Plan {
  std::vector<FileSpec> weights;
  std::vector<std::string> copies;  // relative paths copied byte for byte
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Regular files under dir (symlinks followed, as in a Hugging Face cache snapshot), sorted.
// Hidden entries (.git, .cache) belong to the download tool, not to the layout.
std::vector<std::string> list_files(const std::string& dir) {
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::follow_directory_symlink, ec);
  APUS_CHECK(!ec, dir, ": cannot list: ", ec.message());
  std::vector<std::string> out;
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    APUS_CHECK(!ec, dir, ": cannot list: ", ec.message());
    if (it->path().filename().string().front() == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    // Lexically: a linked file (a Hugging Face snapshot links every file to its blob) keeps its own name.
    if (it->is_regular_file()) out.push_back(it->path().lexically_relative(dir).generic_string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

Plan plan_from_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  const Json m = read_json(path);
  APUS_CHECK(m.is_object() && m.contains("files") && m["files"].is_array(), path, ": missing array 'files'");
  Plan plan;
  for (const Json& f : m["files"]) {
    APUS_CHECK(f.is_object() && f.contains("path") && f["path"].is_string() && f.contains("tensors") &&
                   f["tensors"].is_array(),
               path, ": every entry of 'files' needs a string 'path' and an array 'tensors'");
    FileSpec spec;
    spec.rel = f["path"].get<std::string>();
    const fs::path rel(spec.rel);
    APUS_CHECK(rel.is_relative() && std::find(rel.begin(), rel.end(), "..") == rel.end(), path, ": file path '",
               spec.rel, "' must stay inside the checkpoint");
    if (f.contains("metadata")) {
      APUS_CHECK(f["metadata"].is_object(), path, ": ", spec.rel, ": 'metadata' must be an object");
      for (auto it = f["metadata"].begin(); it != f["metadata"].end(); ++it) {
        APUS_CHECK(it.value().is_string(), path, ": ", spec.rel, ": metadata '", it.key(), "' must be a string");
        spec.metadata.emplace_back(it.key(), it.value().get<std::string>());
      }
    }
    for (const Json& t : f["tensors"]) {
      APUS_CHECK(t.is_object() && t.contains("name") && t["name"].is_string() && t.contains("dtype") &&
                     t["dtype"].is_string() && t.contains("shape") && t["shape"].is_array(),
                 path, ": ", spec.rel, ": every tensor needs a name, dtype and shape");
      TensorSpec ts{t["name"].get<std::string>(), DType::f32, {}};
      APUS_CHECK(dtype_from_safetensors(t["dtype"].get<std::string>(), ts.dtype), path, ": ", spec.rel, ": tensor '",
                 ts.name, "' has unsupported dtype ", t["dtype"].dump());
      for (const Json& d : t["shape"]) {
        APUS_CHECK(d.is_number_unsigned(), path, ": ", spec.rel, ": tensor '", ts.name, "' has shape ",
                   t["shape"].dump(), ", expected non-negative integers");
        ts.shape.push_back(d.get<int64_t>());
      }
      spec.tensors.push_back(std::move(ts));
    }
    plan.weights.push_back(std::move(spec));
  }
  for (const std::string& rel : list_files(dir))
    if (rel != "manifest.json" && rel != "README.md") plan.copies.push_back(rel);
  return plan;
}

Plan plan_from_checkpoint(const std::string& dir) {
  Plan plan;
  for (const std::string& rel : list_files(dir)) {
    if (!ends_with(rel, ".safetensors")) {
      plan.copies.push_back(rel);
      continue;
    }
    const SafetensorsFile f = SafetensorsFile::open(dir + "/" + rel);
    FileSpec spec{rel, {f.metadata().begin(), f.metadata().end()}, {}};
    // The reader indexes by name; the data offsets give back the order the writer chose.
    std::vector<std::string> names = f.names();
    std::stable_sort(names.begin(), names.end(),
                     [&](const std::string& a, const std::string& b) { return f.get(a).data < f.get(b).data; });
    for (const std::string& n : names) spec.tensors.push_back({n, f.get(n).dtype, f.get(n).shape});
    plan.weights.push_back(std::move(spec));
  }
  APUS_CHECK(!plan.weights.empty(), dir,
             ": neither a manifest.json nor any *.safetensors file to take the layout from");
  return plan;
}

std::string header_for(const FileSpec& f, const std::string& where) {
  std::vector<SafetensorsEntry> entries;
  for (const TensorSpec& t : f.tensors) entries.push_back({t.name, t.dtype, t.shape});
  return safetensors_header(entries, f.metadata, where);
}

uint64_t file_bytes(const FileSpec& f, const std::string& where) {
  uint64_t n = 8 + header_for(f, where).size();
  for (const TensorSpec& t : f.tensors) n += t.nbytes();
  return n;
}

// splitmix64: one multiply-xorshift finaliser per 64 bits, enough for weights nobody trains.
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t tensor_key(uint64_t seed, const std::string& rel, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over "file\0tensor"
  for (char c : rel + '\0' + name) h = (h ^ uint8_t(c)) * 0x100000001b3ull;
  return mix(seed ^ mix(h));
}

// How a tensor is initialised: values a trained model's loader and kernels see as ordinary,
// and that keep every stage finite (unit norms, identity batch-norm statistics).
struct Init {
  // rope: RoPE inverse frequencies 10000^(-2j / 2n) for a buffer of n, as the modules register
  // them (loaders check them against the module's own formula).
  enum Kind { zeros, ones, uniform, rope } kind;
  float amplitude;  // uniform on [-amplitude, amplitude]
  uint64_t key;
};

Init init_for(const TensorSpec& t, uint64_t key) {
  const bool floating = t.dtype == DType::f32 || t.dtype == DType::bf16 || t.dtype == DType::f16;
  // Integer buffers (bn.num_batches_tracked) and quantised types get zeros.
  if (!floating || ends_with(t.name, "running_mean")) return {Init::zeros, 0, key};
  if (ends_with(t.name, "running_var")) return {Init::ones, 0, key};
  if (t.shape.size() >= 2) {
    // std 1/sqrt(fan_in), as nn.Linear / nn.Conv2d initialise: activations keep their scale.
    const double fan_in = double(shape_numel(t.shape)) / double(t.shape[0]);
    return {Init::uniform, float(std::sqrt(3.0 / std::max(fan_in, 1.0))), key};
  }
  // A bias's fan-in is not in its shape; std 0.02 keeps it small next to the activations.
  if (ends_with(t.name, "bias")) return {Init::uniform, float(std::sqrt(3.0) * 0.02), key};
  if (ends_with(t.name, ".beta")) return {Init::zeros, 0, key};  // DynamicTanh's shift
  if (ends_with(t.name, "inv_freq")) return {Init::rope, 0, key};
  return {Init::ones, 0, key};  // norm scales
}

template <typename Store> void fill_uniform(const Init& in, int64_t first, int64_t count, Store store) {
  // Element i takes 16 bits from lane i % 4 of splitmix word i / 4, so any chunk of a tensor is
  // produced on its own and the result does not depend on the chunking.
  const float scale = in.amplitude / 32767.5f;
  const int64_t w0 = first / 4;
  for (int64_t i = 0; i < count;) {
    const uint64_t bits = mix(in.key + uint64_t(w0 + i / 4) * 0x9e3779b97f4a7c15ull);
    for (int lane = 0; lane < 4 && i < count; ++lane, ++i)
      store(i, (float(uint16_t(bits >> (16 * lane))) - 32767.5f) * scale);
  }
}

// Writes elements [first, first + count) of a tensor (first a multiple of 4) to out.
void generate(const TensorSpec& t, const Init& in, int64_t first, int64_t count, uint8_t* out) {
  if (in.kind == Init::zeros) {
    std::memset(out, 0, size_t(count) * dtype_size(t.dtype));
    return;
  }
  auto run = [&](auto store) {
    if (in.kind == Init::ones) {
      for (int64_t i = 0; i < count; ++i) store(i, 1.0f);
    } else if (in.kind == Init::rope) {
      const int64_t n = shape_numel(t.shape);
      for (int64_t i = 0; i < count; ++i) store(i, 1.0f / std::pow(10000.0f, float(2 * (first + i)) / float(2 * n)));
    } else {
      fill_uniform(in, first, count, store);
    }
  };
  switch (t.dtype) {
    case DType::bf16: {
      auto* p = reinterpret_cast<uint16_t*>(out);
      run([p](int64_t i, float v) { p[i] = f32_to_bf16(v); });
      break;
    }
    case DType::f16: {
      auto* p = reinterpret_cast<uint16_t*>(out);
      run([p](int64_t i, float v) { p[i] = f32_to_f16(v); });
      break;
    }
    case DType::f32: {
      auto* p = reinterpret_cast<float*>(out);
      run([p](int64_t i, float v) { p[i] = v; });
      break;
    }
    default:
      fail(dtype_safetensors_name(t.dtype), " tensor '", t.name, "' cannot hold random values");
  }
}

void write_weights(const FileSpec& f, const std::string& path, uint64_t seed, bool layout_only) {
  const std::string header = header_for(f, path);
  // Written beside its final name and renamed when complete, so an interrupted run never leaves a
  // plausible-looking truncated checkpoint behind.
  AtomicFile out(path);
  const uint64_t len = header.size();
  out.write(&len, 8);
  out.write(header.data(), header.size());
  if (layout_only) {
    uint64_t total = 8 + len;
    for (const TensorSpec& t : f.tensors) total += t.nbytes();
    out.resize(total);
    out.commit();
    return;
  }
  // Tensors are generated straight into a buffer that is handed to a writer thread when full,
  // while generation goes on in the other one: small tensors share a write, large ones stream
  // through, memory stays at two buffers, and generating costs no wall time next to the disk.
  std::vector<uint8_t> bufs[2] = {std::vector<uint8_t>(size_t(8) << 20), std::vector<uint8_t>(size_t(8) << 20)};
  std::future<void> writing;  // declared after bufs: its destructor waits before they go
  int cur = 0;
  size_t used = 0;
  const auto flush = [&] {
    if (writing.valid()) writing.get();
    writing = std::async(std::launch::async, [&out, p = bufs[cur].data(), n = used] { out.write(p, n); });
    cur ^= 1;
    used = 0;
  };
  for (const TensorSpec& t : f.tensors) {
    const Init in = init_for(t, tensor_key(seed, f.rel, t.name));
    const size_t es = dtype_size(t.dtype);
    const int64_t n = shape_numel(t.shape);
    for (int64_t first = 0; first < n;) {
      const int64_t room = int64_t((bufs[cur].size() - used) / es);
      int64_t count = std::min(n - first, room);
      if (count < n - first) count &= ~int64_t(3);  // later chunks must start on a word boundary
      if (count == 0) {
        flush();
        continue;
      }
      generate(t, in, first, count, bufs[cur].data() + used);
      used += size_t(count) * es;
      first += count;
    }
  }
  flush();
  writing.get();
  out.commit();
}

void make_dirs(const fs::path& p) {
  std::error_code ec;
  fs::create_directories(p, ec);
  APUS_CHECK(!ec, p.string(), ": cannot create directory: ", ec.message());
}

}  // namespace

std::string published_layout_dir(const std::string& name) {
  const char* env = std::getenv("APUS_DATA_DIR");
  if (env && *env) return std::string(env) + "/" + name;
  // An installed apus (cmake --install, the Debian package): PREFIX/bin/apus beside PREFIX/share/apus.
  std::error_code ec;
  const fs::path installed = fs::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "share/apus";
  if (!ec && fs::is_directory(installed / name, ec)) return (installed / name).string();
  return std::string(APUS_DATA_DIR) + "/" + name;
}

void synth_checkpoint(const std::string& template_dir, const std::string& out_dir, uint64_t seed,
                      const SynthProgress& progress, bool layout_only) {
  const auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  APUS_CHECK(is_directory(template_dir), template_dir, ": not a directory");
  {
    std::error_code e1, e2;
    const fs::path t = fs::weakly_canonical(template_dir, e1), o = fs::weakly_canonical(out_dir, e2);
    APUS_CHECK(!e1 && !e2, out_dir, ": cannot resolve path: ", (e1 ? e1 : e2).message());
    APUS_CHECK(std::mismatch(t.begin(), t.end(), o.begin(), o.end()).first != t.end(), out_dir,
               ": lies inside the template ", template_dir, "; choose another output folder");
  }
  const Plan plan = path_exists(template_dir + "/manifest.json") ? plan_from_manifest(template_dir)
                                                                 : plan_from_checkpoint(template_dir);
  make_dirs(out_dir);

  uint64_t total = 0, replaced = 0;
  for (const FileSpec& f : plan.weights) {
    const std::string dst = out_dir + "/" + f.rel;
    total += file_bytes(f, dst);
    std::error_code ec;
    if (fs::is_regular_file(dst, ec)) replaced += fs::file_size(dst, ec);
  }
  if (!layout_only) {
    struct statvfs vfs {};
    APUS_CHECK(::statvfs(out_dir.c_str(), &vfs) == 0, out_dir, ": cannot query free space: ", std::strerror(errno));
    const uint64_t free = uint64_t(vfs.f_bavail) * vfs.f_frsize;
    APUS_CHECK(free + replaced >= total, out_dir, ": needs ", bytes_text(double(total)), " for the weights, ",
               bytes_text(double(free + replaced)), " available");
  }
  say("synth: " + template_dir + " -> " + out_dir + ": " + std::to_string(plan.weights.size()) + " weight files, " +
      bytes_text(double(total)) + (layout_only ? " (layout only)" : ""));

  for (const std::string& rel : plan.copies) {
    const fs::path dst = fs::path(out_dir) / rel;
    make_dirs(dst.parent_path());
    std::error_code ec;
    fs::copy_file(fs::path(template_dir) / rel, dst, fs::copy_options::overwrite_existing, ec);
    APUS_CHECK(!ec, dst.string(), ": cannot copy from ", template_dir, "/", rel, ": ", ec.message());
  }

  const auto t0 = std::chrono::steady_clock::now();
  for (const FileSpec& f : plan.weights) {
    const fs::path dst = fs::path(out_dir) / f.rel;
    make_dirs(dst.parent_path());
    std::error_code ec;
    fs::remove(dst, ec);  // frees the old file's space before the new one is written
    const auto t1 = std::chrono::steady_clock::now();
    write_weights(f, dst.string(), seed, layout_only);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    uint64_t bytes = 0;
    for (const TensorSpec& t : f.tensors) bytes += t.nbytes();
    char line[512];
    std::snprintf(line, sizeof line, "  %-50s %4zu tensors %10s %7.1f s", f.rel.c_str(), f.tensors.size(),
                  bytes_text(double(bytes)).c_str(), s);
    say(line);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char line[256];
  if (layout_only)
    std::snprintf(line, sizeof line, "synth: wrote the layout of %s in %.1f s", bytes_text(double(total)).c_str(), s);
  else
    std::snprintf(line, sizeof line, "synth: wrote %s in %.1f s (%.0f MB/s)", bytes_text(double(total)).c_str(), s,
                  double(total) / 1e6 / std::max(s, 1e-9));
  say(line);
}

void synth_on_demand(const std::string& template_dir, const std::string& out_dir, uint64_t seed,
                     const SynthProgress& progress) {
  synth_checkpoint(template_dir, out_dir, seed, progress, /*layout_only=*/true);
  const std::string marker = Json{{"seed", seed}}.dump();
  write_whole_file(out_dir + "/" + kSyntheticValuesFile, marker.data(), marker.size());
}

void synth_values(uint64_t seed, const std::string& rel, const std::string& name, Tensor& out) {
  const TensorSpec t{name, out.dtype, out.shape};
  generate(t, init_for(t, tensor_key(seed, rel, name)), 0, out.numel(), static_cast<uint8_t*>(out.data));
}

void synth_published(const std::string& name, const std::string& out_dir, uint64_t seed,
                     const SynthProgress& progress) {
  const std::string dir = published_layout_dir(name);
  APUS_CHECK(path_exists(dir + "/manifest.json"), dir,
             "/manifest.json: missing; set APUS_DATA_DIR to the data/ folder of the apus sources");
  synth_checkpoint(dir, out_dir, seed, progress);
}

std::string synthetic_model_dir(const std::string& name, const SynthProgress& progress, bool on_demand) {
  const std::string dir = apus_cache_dir() + (on_demand ? "/synthetic-on-demand/" : "/synthetic/") + name;
  // Written under a temporary name and renamed, so an interrupted synthesis is never benched.
  if (path_exists(dir)) return dir;
  const std::string partial = dir + ".partial";
  std::error_code ec;
  std::filesystem::remove_all(partial, ec);
  if (on_demand) {
    const std::string layout = published_layout_dir(name);
    APUS_CHECK(path_exists(layout + "/manifest.json"), layout,
               "/manifest.json: missing; set APUS_DATA_DIR to the data/ folder of the apus sources");
    synth_on_demand(layout, partial, 0, progress);
  } else {
    synth_published(name, partial, 0, progress);
  }
  std::filesystem::rename(partial, dir, ec);
  APUS_CHECK(!ec, partial, ": cannot rename to ", dir, " (", ec.message(), ")");
  return dir;
}

}  // namespace apus
