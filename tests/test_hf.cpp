// Models named as Hugging Face repositories: the local cache layout huggingface_hub writes, and
// `apus pull` against a mock hub on a free port (the real one is not reachable from CI): the file
// list from the API, the token, blobs by hash with links from the snapshot, resumed partial files,
// sha256 checks, refusals of paths outside the repository.
#include <httplib.h>
#include <openssl/evp.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "apus/apus.h"
#include "hub/hf_pull.h"
#include "io/hf_cache.h"
#include "test_util.h"

namespace apus {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kCommit = "0123456789abcdef0123456789abcdef01234567";

std::string sha256_hex(const std::string& data) {
  unsigned char digest[32];
  unsigned len = 0;
  EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr);
  std::string hex;
  char b[3];
  for (unsigned i = 0; i < len; ++i) {
    std::snprintf(b, sizeof b, "%02x", digest[i]);
    hex += b;
  }
  return hex;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A hub serving klein_tiny_a as apus/klein-tiny at kCommit: safetensors files as LFS (sha256),
// the rest as plain git blobs; it asks for the token hf_test.
class MockHub {
 public:
  MockHub() {
    const fs::path root = test::fixture("klein_tiny_a");
    for (const auto& e : fs::recursive_directory_iterator(root)) {
      if (!e.is_regular_file()) continue;
      const std::string rel = e.path().lexically_relative(root).string();
      files_[rel] = slurp(e.path().string());
    }
    server_.Get(R"(/api/models/apus/klein-tiny/revision/([^/]+))",
                [this](const httplib::Request& req, httplib::Response& res) {
                  if (!authorized(req, res)) return;
                  Json siblings = Json::array();
                  for (const auto& [path, data] : files_) {
                    const std::string sum = sha256_hex(data);
                    Json s = {{"rfilename", path}, {"size", data.size()}, {"blobId", sum.substr(0, 40)}};
                    if (path.find(".safetensors") != std::string::npos)
                      s["lfs"] = {{"sha256", sum}, {"size", data.size()}};
                    siblings.push_back(s);
                  }
                  if (!extra_sibling.empty())
                    siblings.push_back({{"rfilename", extra_sibling}, {"size", 1}, {"blobId", std::string(40, 'a')}});
                  res.set_content(Json{{"sha", kCommit}, {"siblings", siblings}}.dump(), "application/json");
                });
    server_.Get(R"(/apus/klein-tiny/resolve/([0-9a-f]+)/(.+))",
                [this](const httplib::Request& req, httplib::Response& res) {
                  if (!authorized(req, res)) return;
                  const auto it = files_.find(req.matches[2]);
                  if (req.matches[1] != kCommit || it == files_.end()) {
                    res.status = 404;
                    return;
                  }
                  if (req.has_header("Range")) ++ranged;
                  std::string data = it->second;
                  if (corrupt == it->first) data[data.size() / 2] ^= 1;
                  res.set_content(data, "application/octet-stream");
                });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~MockHub() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  const std::map<std::string, std::string>& files() const { return files_; }

  std::string corrupt, extra_sibling;
  int ranged = 0;

 private:
  bool authorized(const httplib::Request& req, httplib::Response& res) {
    if (req.get_header_value("Authorization") == "Bearer hf_test") return true;
    res.status = 401;
    return false;
  }
  std::map<std::string, std::string> files_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
};

class Hub : public ::testing::Test {
 protected:
  void SetUp() override {
    cache_ = ::testing::TempDir() + "apus_hf_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(cache_);
    ::setenv("HF_HUB_CACHE", cache_.c_str(), 1);
    ::setenv("HF_ENDPOINT", hub_.url().c_str(), 1);
    ::setenv("HF_TOKEN", "hf_test", 1);
  }
  std::string pull() {
    return hf_pull("apus/klein-tiny", "main", [&](const std::string& l) { lines_.push_back(l); });
  }
  MockHub hub_;
  std::string cache_;
  std::vector<std::string> lines_;
};

ImageRequest small_request() {
  ImageRequest r;
  r.prompt = "a red fox in tall grass";
  r.width = 64;
  r.height = 48;
  r.steps = 2;
  r.seed = 7;
  return r;
}

TEST_F(Hub, PulledRepositoryOpensByItsIdAndRendersTheSameImage) {
  const std::string snapshot = pull();
  EXPECT_EQ(snapshot, cache_ + "/models--apus--klein-tiny/snapshots/" + kCommit);
  EXPECT_EQ(lines_.size(), hub_.files().size());
  EXPECT_EQ(slurp(cache_ + "/models--apus--klein-tiny/refs/main"), kCommit);
  for (const auto& [path, data] : hub_.files()) {
    const std::string link = snapshot + "/" + path;
    ASSERT_TRUE(fs::is_symlink(link)) << path;
    EXPECT_EQ(fs::read_symlink(link).string().rfind("../", 0), 0u) << "relative link " << path;
    EXPECT_EQ(slurp(link), data) << path;
  }
  const auto model = ImageModel::open("apus/klein-tiny", Weights::per_stage);
  EXPECT_EQ(model->label(), "apus/klein-tiny");
  const auto direct = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  EXPECT_EQ(model->generate(small_request()).rgb, direct->generate(small_request()).rgb);
  // HF_HOME/hub when HF_HUB_CACHE is unset.
  const std::string home = cache_ + "_home";
  fs::create_directories(home);
  fs::create_directory_symlink(cache_, home + "/hub");
  ::unsetenv("HF_HUB_CACHE");
  ::setenv("HF_HOME", home.c_str(), 1);
  EXPECT_EQ(hf_cached_snapshot("apus/klein-tiny").value_or(""),
            home + "/hub/models--apus--klein-tiny/snapshots/" + kCommit);
}

TEST_F(Hub, PartialDownloadsResumeAndBadHashesAreRefused) {
  const std::string snapshot = pull();
  // A blob cut short and left as .incomplete is resumed with a range request.
  const std::string weights = "transformer/diffusion_pytorch_model.safetensors";
  const std::string data = hub_.files().at(weights);
  const std::string blob = cache_ + "/models--apus--klein-tiny/blobs/" + sha256_hex(data);
  ASSERT_TRUE(fs::exists(blob));
  fs::remove(blob);
  std::ofstream(blob + ".incomplete", std::ios::binary).write(data.data(), std::streamsize(data.size() / 3));
  pull();
  EXPECT_EQ(hub_.ranged, 1);
  EXPECT_EQ(slurp(snapshot + "/" + weights), data);
  EXPECT_FALSE(fs::exists(blob + ".incomplete"));
  // A file whose bytes do not hash to the hub's sha256 is refused and removed.
  fs::remove(blob);
  hub_.corrupt = weights;
  test::expect_error([&] { pull(); }, {weights, "sha256", "differs"});
  EXPECT_FALSE(fs::exists(blob));
  EXPECT_FALSE(fs::exists(blob + ".incomplete"));
}

TEST_F(Hub, RefusalsNameTheCause) {
  ::unsetenv("HF_TOKEN");
  ::setenv("HF_TOKEN_PATH", (cache_ + "_no_token").c_str(), 1);
  test::expect_error([&] { pull(); }, {"HTTP 401", "HF_TOKEN"});
  // The token file huggingface_hub writes.
  std::ofstream(cache_ + "_token") << "hf_test\n";
  ::setenv("HF_TOKEN_PATH", (cache_ + "_token").c_str(), 1);
  hub_.extra_sibling = "../../evil";
  test::expect_error([&] { pull(); }, {"../../evil", "outside the repository"});
  hub_.extra_sibling = "";
  test::expect_error([&] { hf_pull("apus/missing", "main", {}); }, {"HTTP 404", "no such repository"});
  test::expect_error([&] { hf_pull("not-a-repo", "main", {}); }, {"not a repository id"});
  test::expect_error([&] { hf_pull("apus/klein-tiny", "../x", {}); }, {"revision"});
  test::expect_error([&] { ImageModel::open("apus/none", Weights::per_stage); },
                     {"apus/none", "not in the Hugging Face cache", "apus pull apus/none"});
}

}  // namespace
}  // namespace apus
