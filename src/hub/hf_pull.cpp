#include "hub/hf_pull.h"

#include <curl/curl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_cache.h"

namespace apus {

namespace {

namespace fs = std::filesystem;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : "";
}

std::string endpoint() {
  std::string e = env("HF_ENDPOINT").empty() ? "https://huggingface.co" : env("HF_ENDPOINT");
  while (!e.empty() && e.back() == '/') e.pop_back();
  return e;
}

std::string token() {
  if (!env("HF_TOKEN").empty()) return env("HF_TOKEN");
  std::string path = env("HF_TOKEN_PATH");
  if (path.empty()) path = (env("HF_HOME").empty() ? env("HOME") + "/.cache/huggingface" : env("HF_HOME")) + "/token";
  std::ifstream f(path);
  std::string t;
  std::getline(f, t);
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  return t;
}

// One transfer: a GET of `url` whose body goes to `sink`, from byte `offset` (resume) on.
struct Transfer {
  std::function<bool(const char*, size_t, long status)> sink;
  std::function<void(double done, double total)> progress;
  CURL* curl = nullptr;
};

long get(const std::string& url, int64_t offset, Transfer& t) {
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  APUS_CHECK(curl, url, ": cannot start a transfer");
  t.curl = curl.get();
  struct curl_slist* headers = nullptr;
  const std::string tok = token();
  if (!tok.empty()) headers = curl_slist_append(headers, ("Authorization: Bearer " + tok).c_str());
  headers = curl_slist_append(headers, "User-Agent: apus");
  std::unique_ptr<curl_slist, void (*)(curl_slist*)> header_list(headers, curl_slist_free_all);
  char error[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(t.curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(t.curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(t.curl, CURLOPT_FOLLOWLOCATION, 1L);  // LFS files redirect to a CDN
  curl_easy_setopt(t.curl, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(t.curl, CURLOPT_FAILONERROR, 0L);
  curl_easy_setopt(t.curl, CURLOPT_CONNECTTIMEOUT, 30L);
  if (offset > 0) curl_easy_setopt(t.curl, CURLOPT_RESUME_FROM_LARGE, curl_off_t(offset));
  curl_easy_setopt(t.curl, CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(
      t.curl, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t n, void* p) -> size_t {
        auto* tr = static_cast<Transfer*>(p);
        long status = 0;
        curl_easy_getinfo(tr->curl, CURLINFO_RESPONSE_CODE, &status);
        return tr->sink(data, size * n, status) ? size * n : 0;
      });
  if (t.progress) {
    curl_easy_setopt(t.curl, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(t.curl, CURLOPT_XFERINFODATA, &t);
    curl_easy_setopt(
        t.curl, CURLOPT_XFERINFOFUNCTION,
        +[](void* p, curl_off_t total, curl_off_t done, curl_off_t, curl_off_t) -> int {
          static_cast<Transfer*>(p)->progress(double(done), double(total));
          return 0;
        });
  }
  const CURLcode rc = curl_easy_perform(t.curl);
  long status = 0;
  curl_easy_getinfo(t.curl, CURLINFO_RESPONSE_CODE, &status);
  APUS_CHECK(rc == CURLE_OK || rc == CURLE_WRITE_ERROR, url, ": ", error[0] ? error : curl_easy_strerror(rc));
  return status;
}

std::string status_hint(long status) {
  if (status == 401 || status == 403)
    return " (a gated or private repository: accept its licence on the hub and set HF_TOKEN, or log in with "
           "huggingface-cli)";
  if (status == 404) return " (no such repository, revision or file)";
  return "";
}

// A repository path from the hub, as a relative path that stays inside the snapshot.
void check_path(const std::string& repo, const std::string& p) {
  bool ok = !p.empty() && p[0] != '/' && p.find('\\') == std::string::npos && p.find('\0') == std::string::npos;
  for (const auto& part : fs::path(p)) ok = ok && part != ".." && part != "." && !part.empty();
  APUS_CHECK(ok, repo, ": the hub lists a file '", p, "' outside the repository; refusing it");
}

bool is_hex(const std::string& s, size_t n) {
  return s.size() == n && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

}  // namespace

std::string sha256_of(const std::string& path) {
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  APUS_CHECK(ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1, path, ": cannot hash");
  std::ifstream f(path, std::ios::binary);
  std::vector<char> buf(1 << 20);
  while (f) {
    f.read(buf.data(), std::streamsize(buf.size()));
    EVP_DigestUpdate(ctx.get(), buf.data(), size_t(f.gcount()));
  }
  unsigned char digest[32];
  unsigned len = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &len);
  std::string hex;
  char b[3];
  for (unsigned i = 0; i < len; ++i) {
    std::snprintf(b, sizeof b, "%02x", digest[i]);
    hex += b;
  }
  return hex;
}

std::string hf_pull(const std::string& repo_id, const std::string& revision,
                    const std::function<void(const std::string&)>& say) {
  APUS_CHECK(is_repo_id(repo_id), "'", repo_id, "' is not a repository id (ORG/NAME)");
  APUS_CHECK(!revision.empty() && revision.find("..") == std::string::npos && revision[0] != '/' &&
                 revision.find('\\') == std::string::npos,
             "revision '", revision, "' is not a branch, tag or commit");
  curl_global_init(CURL_GLOBAL_DEFAULT);
  const std::string base = endpoint();
  std::string listing;
  Transfer info;
  info.sink = [&](const char* d, size_t n, long) {
    listing.append(d, n);
    return listing.size() < (size_t(64) << 20);
  };
  char* escaped = curl_easy_escape(nullptr, revision.c_str(), int(revision.size()));
  const std::string rev_url(escaped);
  curl_free(escaped);
  const std::string api = base + "/api/models/" + repo_id + "/revision/" + rev_url + "?blobs=true";
  const long status = get(api, 0, info);
  APUS_CHECK(status == 200, api, ": HTTP ", status, status_hint(status));
  const nlohmann::json meta = nlohmann::json::parse(listing, nullptr, false);
  APUS_CHECK(meta.is_object() && meta.contains("sha") && meta["sha"].is_string() && meta.contains("siblings") &&
                 meta["siblings"].is_array(),
             api, ": not the hub's model metadata (sha, siblings)");
  const std::string commit = meta["sha"];
  APUS_CHECK(is_hex(commit, 40), api, ": commit '", commit, "' is not a 40-digit hash");
  const std::string repo = hf_repo_dir(repo_id), snapshot = repo + "/snapshots/" + commit;
  fs::create_directories(repo + "/blobs");
  fs::create_directories(snapshot);
  const size_t count = meta["siblings"].size();
  size_t index = 0;
  for (const nlohmann::json& file : meta["siblings"]) {
    ++index;
    APUS_CHECK(file.is_object() && file.contains("rfilename") && file["rfilename"].is_string(), api,
               ": a sibling without rfilename");
    const std::string path = file["rfilename"];
    check_path(repo_id, path);
    const bool lfs = file.contains("lfs") && file["lfs"].is_object();
    const std::string hash = lfs ? file["lfs"].value("sha256", "") : file.value("blobId", "");
    APUS_CHECK(lfs ? is_hex(hash, 64) : is_hex(hash, 40), api, ": ", path, " has no usable hash ('", hash, "')");
    const int64_t size = lfs ? file["lfs"].value("size", int64_t(-1)) : file.value("size", int64_t(-1));
    const std::string blob = repo + "/blobs/" + hash, link = snapshot + "/" + path;
    if (!fs::exists(blob)) {
      const std::string part = blob + ".incomplete";
      int64_t have = fs::exists(part) ? int64_t(fs::file_size(part)) : 0;
      if (size >= 0 && have > size) have = 0;
      std::FILE* out = std::fopen(part.c_str(), have > 0 ? "ab" : "wb");
      APUS_CHECK(out, part, ": cannot write");
      bool restarted = false;
      Transfer t;
      t.sink = [&](const char* d, size_t n, long code) {
        if (code == 200 && have > 0 && !restarted) {  // the server ignored the range: start over
          restarted = true;
          if (std::fflush(out) != 0 || ::ftruncate(::fileno(out), 0) != 0 || std::fseek(out, 0, SEEK_SET) != 0)
            return false;
        }
        return code / 100 == 2 && std::fwrite(d, 1, n, out) == n;
      };
      int last = -1;
      t.progress = [&](double done, double total) {
        if (total <= 0 || size < (int64_t(64) << 20)) return;
        const int pct = int(100 * (done + double(restarted ? 0 : have)) / (total + double(restarted ? 0 : have)));
        if (pct / 5 != last / 5) {
          last = pct;
          say("  " + path + " " + std::to_string(pct) + " %");
        }
      };
      char* escaped_path = curl_easy_escape(nullptr, path.c_str(), int(path.size()));
      std::string url_path(escaped_path);
      curl_free(escaped_path);
      for (size_t at; (at = url_path.find("%2F")) != std::string::npos;) url_path.replace(at, 3, "/");
      const std::string url = base + "/" + repo_id + "/resolve/" + commit + "/" + url_path;
      const long code = get(url, have, t);
      APUS_CHECK(std::fclose(out) == 0, part, ": write failed");
      APUS_CHECK(code == 200 || code == 206, url, ": HTTP ", code, status_hint(code));
      const int64_t got = int64_t(fs::file_size(part));
      APUS_CHECK(size < 0 || got == size, url, ": ", got, " bytes, the hub lists ", size);
      if (lfs) {
        const std::string sum = sha256_of(part);
        if (sum != hash) {
          fs::remove(part);
          fail(url, ": sha256 ", sum, " differs from the hub's ", hash, "; the partial file was removed");
        }
      }
      fs::rename(part, blob);
    }
    // The snapshot's entry: a relative link into blobs/, as huggingface_hub makes it.
    fs::create_directories(fs::path(link).parent_path());
    std::string up = "../../";
    for (size_t i = 0; i < path.size(); ++i)
      if (path[i] == '/') up += "../";
    if (fs::is_symlink(link) || fs::exists(link)) fs::remove(link);
    fs::create_symlink(up + "blobs/" + hash, link);
    say("[" + std::to_string(index) + "/" + std::to_string(count) + "] " + path);
  }
  if (revision != commit) {
    fs::create_directories(repo + "/refs");
    std::ofstream(repo + "/refs/" + revision) << commit;
  }
  return snapshot;
}

}  // namespace apus
