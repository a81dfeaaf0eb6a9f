// fixture_gen DIR: writes every weight fixture under DIR that is committed as a recipe
// (FILE.recipe -> FILE), byte for byte, and checks each against the sha256 the recipe carries.
//
// Why: a device call carries the tracked tree (issue 38: under 40 MiB), and random weights do
// not compress. Most of their bytes are one draw of torch's CPU generator through a float32
// operation or two, which TorchGenerator replays bit for bit, so the oracle's draws are committed
// as their streams (draw_streams.json: a seed and the draws made from it) and each file as the
// bytes that are not draws plus where the draws go (tools/oracle/fixture_recipes.py writes both).
// A file already there with the right size and hash is left alone; a wrong one is rewritten.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "hub/hf_pull.h"
#include "io/files.h"
#include "sampling/torch_rng.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void fail(const std::string& what) { throw Failure(what); }

struct Call {
  std::string kind, dtype;
  int64_t numel = 0;
};

// The draws a set of recipes needs, replayed stream by stream.
class Draws {
 public:
  Draws(const json& streams, const std::set<std::pair<int, int>>& needed) {
    std::map<int, int> last;
    for (auto [s, c] : needed) last[s] = std::max(last[s], c);
    for (auto [s, upto] : last) {
      if (s < 0 || s >= int(streams.size())) fail("draw_streams.json: no stream " + std::to_string(s));
      const json& st = streams[s];
      apus::TorchGenerator gen(st.at("seed").get<uint64_t>());
      const json& calls = st.at("calls");
      if (upto >= int(calls.size()))
        fail("draw_streams.json: stream " + std::to_string(s) + " has no draw " + std::to_string(upto));
      for (int c = 0; c <= upto; ++c) {
        const Call call{calls[c][0].get<std::string>(), calls[c][1].get<std::string>(), calls[c][2].get<int64_t>()};
        std::vector<float> v = draw(gen, call);
        if (needed.count({s, c})) values_[{s, c}] = std::move(v);
      }
    }
  }
  const std::vector<float>& at(int s, int c) const { return values_.at({s, c}); }

 private:
  static std::vector<float> draw(apus::TorchGenerator& gen, const Call& call) {
    std::vector<float> v(static_cast<size_t>(call.numel));
    if (call.kind == "randn" && call.dtype == "float32") {
      gen.randn(v.data(), call.numel);
    } else if (call.kind == "randn" && call.dtype == "bfloat16") {
      std::vector<uint16_t> b(v.size());
      gen.randn_bf16(b.data(), call.numel);
      std::transform(b.begin(), b.end(), v.begin(), apus::bf16_to_f32);
    } else if (call.kind == "rand" && call.dtype == "float32") {
      gen.rand(v.data(), call.numel);
    } else {
      fail("draw_streams.json: cannot replay torch." + call.kind + " in " + call.dtype);
    }
    return v;
  }
  std::map<std::pair<int, int>, std::vector<float>> values_;
};

float parse_hex_float(const std::string& s) { return float(std::strtod(s.c_str(), nullptr)); }

// One recipe piece's bytes: a run of a draw through its float32 operations, stored as the file
// stores it.
void append_draw(std::string& out, const std::vector<float>& r, const json& piece) {
  std::vector<std::pair<char, float>> ops;
  for (const json& op : piece.at("ops"))
    ops.emplace_back(op[0].get<std::string>()[0], parse_hex_float(op[1].get<std::string>()));
  const std::string store = piece.at("store").get<std::string>();
  const size_t first = piece.value("first", size_t(0)), count = piece.value("count", r.size());
  if (first + count > r.size()) fail("a piece reads past its draw");
  auto each = [&](auto put) {
    for (size_t i = first; i < first + count; ++i) {
      float x = r[i];
      for (auto [op, c] : ops) x = op == 'm' ? x * c : op == 'd' ? x / c : x + c;
      put(x);
    }
  };
  auto append = [&out](auto v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  if (store == "f32") each([&](float x) { append(x); });
  else if (store == "f32_of_bf16") each([&](float x) { append(apus::round_bf16(x)); });
  else if (store == "bf16") each([&](float x) { append(apus::f32_to_bf16(x)); });
  else if (store == "f16") each([&](float x) { append(apus::f32_to_f16(x)); });
  else fail("unknown store " + store);
}

// gguf-py's Q8_0 dequantisation (the reference it wrote): each 34-byte block is an f16 scale and
// 32 int8 codes, an element the float32 product of the two (exact: 11 by 8 significant bits).
void append_q8_0_dequantized(std::string& out, std::string_view blocks) {
  if (blocks.size() % 34 != 0) fail("a Q8_0 copy is not whole blocks");
  for (size_t b = 0; b < blocks.size(); b += 34) {
    uint16_t h;
    std::memcpy(&h, blocks.data() + b, 2);
    const float d = apus::f16_to_f32(h);
    for (size_t i = 0; i < 32; ++i) {
      const float x = d * float(int8_t(blocks[b + 2 + i]));
      out.append(reinterpret_cast<const char*>(&x), 4);
    }
  }
}

struct Recipe {
  json head;
  std::string literal;
};

Recipe read_recipe(const fs::path& p) {
  const std::string all = apus::read_file(p);
  const size_t nl = all.find('\n');
  if (nl == std::string::npos) fail(p.string() + ": no header line");
  return {json::parse(all.substr(0, nl)), all.substr(nl + 1)};
}

// The fixtures under one directory: each recipe's file written once, after the files it copies from.
class Fixtures {
 public:
  explicit Fixtures(fs::path dir) : dir_(std::move(dir)) {
    for (const auto& e : fs::recursive_directory_iterator(dir_))
      if (e.path().extension() == ".recipe")
        recipes_.emplace(fs::relative(e.path(), dir_).replace_extension().string(), read_recipe(e.path()));
  }

  size_t count() const { return recipes_.size(); }

  // Writes every missing or stale file; returns how many.
  int write_stale() {
    std::set<std::pair<int, int>> needed;
    for (auto& [rel, r] : recipes_) {
      if (up_to_date(rel, r)) {
        fresh_.insert(rel);
        continue;
      }
      for (const json& piece : r.head.at("pieces"))
        if (piece.contains("draw")) needed.insert({piece["draw"][0].get<int>(), piece["draw"][1].get<int>()});
    }
    if (!needed.empty()) {
      const json streams = json::parse(apus::read_file(dir_ / "draw_streams.json")).at("streams");
      draws_ = std::make_unique<Draws>(streams, needed);
    }
    int written = 0;
    for (auto& [rel, r] : recipes_)
      if (!fresh_.count(rel)) {
        write(rel);
        ++written;
      }
    return written;
  }

 private:
  bool up_to_date(const std::string& rel, const Recipe& r) const {
    std::error_code ec;
    const fs::path target = dir_ / rel;
    if (fs::file_size(target, ec) != r.head.at("size").get<uintmax_t>() || ec) return false;
    return apus::sha256_of(target) == r.head.at("sha256").get<std::string>();
  }

  // A file a copy reads: written first when it is a recipe's and is not there yet.
  const std::string& source(const std::string& rel) {
    if (recipes_.count(rel) && !fresh_.count(rel)) write(rel);
    auto it = sources_.find(rel);
    if (it == sources_.end()) it = sources_.emplace(rel, apus::read_file(dir_ / rel)).first;
    return it->second;
  }

  void write(const std::string& rel) {
    if (!writing_.insert(rel).second) fail(rel + ".recipe: copies from itself through other recipes");
    const Recipe& r = recipes_.at(rel);
    std::string out;
    out.reserve(r.head.at("size").get<size_t>());
    size_t lit = 0;
    for (const json& piece : r.head.at("pieces")) {
      if (piece.contains("bytes")) {
        const size_t n = piece["bytes"].get<size_t>();
        if (lit + n > r.literal.size()) fail(rel + ".recipe: its bytes end early");
        out.append(r.literal, lit, n);
        lit += n;
      } else if (piece.contains("copy")) {
        const std::string& from = source(piece["copy"].get<std::string>());
        const size_t at = piece.at("at").get<size_t>(), n = piece.at("count").get<size_t>();
        if (at + n > from.size()) fail(rel + ".recipe: a copy reads past " + piece["copy"].get<std::string>());
        const std::string_view bytes = std::string_view(from).substr(at, n);
        if (piece.contains("dequantize")) append_q8_0_dequantized(out, bytes);
        else out.append(bytes);
      } else {
        append_draw(out, draws_->at(piece.at("draw")[0].get<int>(), piece.at("draw")[1].get<int>()), piece);
      }
    }
    const fs::path target = dir_ / rel, tmp = target.string() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(out.data(), std::streamsize(out.size()));
      if (!f) fail(tmp.string() + ": cannot write");
    }
    const std::string sum = apus::sha256_of(tmp);
    if (out.size() != r.head.at("size").get<size_t>() || sum != r.head.at("sha256").get<std::string>()) {
      fs::remove(tmp);
      fail(rel + ": rebuilt " + std::to_string(out.size()) + " bytes with sha256 " + sum + ", its recipe says " +
           r.head.at("size").dump() + " bytes with " + r.head.at("sha256").get<std::string>());
    }
    fs::rename(tmp, target);
    sources_[rel] = std::move(out);
    fresh_.insert(rel);
  }

  fs::path dir_;
  std::map<std::string, Recipe> recipes_;
  std::set<std::string> fresh_, writing_;
  std::map<std::string, std::string> sources_;
  std::unique_ptr<Draws> draws_;
};

int run(const fs::path& dir) {
  Fixtures fixtures(dir);
  const int written = fixtures.write_stale();
  std::cerr << "fixture_gen: " << fixtures.count() << " recipes, " << written << " files written\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fixture_gen FIXTURES_DIR\n";
    return 2;
  }
  try {
    return run(argv[1]);
  } catch (const std::exception& e) {
    std::cerr << "fixture_gen: " << e.what() << "\n";
    return 1;
  }
}
