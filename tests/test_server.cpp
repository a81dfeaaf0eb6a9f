// `apus serve` over real HTTP on a free port: the tiny klein and Stable Audio 3 models behind the
// OpenAI-style routes and jobs, their answers against the engine's own results, and every refusal
// (key, JSON, fields, limits, full queue) with its status and a JSON error naming the field.
#include <httplib.h>

#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <signal.h>
#include <sndfile.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>

#include "apus/apus.h"
#include "core/cost.h"
#include "io/files.h"
#include "io/media/audio.h"
#include "io/media/image.h"
#include "io/media/png.h"
#include "io/media/resize.h"
#include "sa3_fixtures.h"
#include "server/fields.h"
#include "server/server.h"
#include "test_util.h"

extern char** environ;

namespace apus {
namespace {

using Json = nlohmann::json;

std::vector<uint8_t> unbase64(const std::string& s) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::vector<uint8_t> out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    const int v = value(c);
    if (v < 0) break;
    acc = acc << 6 | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t(acc >> bits));
    }
  }
  return out;
}

// The bytes of a file the server sent, read back through the file readers.
std::string as_file(const std::vector<uint8_t>& bytes, const std::string& name) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return path;
}

// The engine's request a served image is checked against (sides absent: the references').
ImageRequest engine_request(const std::string& prompt, std::optional<int> width, std::optional<int> height, int steps,
                            uint64_t seed) {
  ImageRequest r;
  r.prompt = prompt;
  r.width = width;
  r.height = height;
  r.steps = steps;
  r.seed = seed;
  return r;
}

// A PNG of 1 x 1 pixels whose header says width x height (its IHDR's CRC made to match).
std::string png_claiming(uint32_t width, uint32_t height) {
  const std::vector<uint8_t> real = encode_png(1, 1, {7, 7, 7}, {}, "dot");
  std::string png(real.begin(), real.end());
  for (int i = 0; i < 4; ++i) {
    png[size_t(16 + i)] = char(width >> (24 - 8 * i));
    png[size_t(20 + i)] = char(height >> (24 - 8 * i));
  }
  uint32_t crc = 0xffffffffu;  // over the chunk type and data, bytes 12..28
  for (size_t i = 12; i < 29; ++i) {
    crc ^= uint8_t(png[i]);
    for (int k = 0; k < 8; ++k) crc = crc & 1 ? (crc >> 1) ^ 0xedb88320u : crc >> 1;
  }
  crc ^= 0xffffffffu;
  for (int i = 0; i < 4; ++i) png[size_t(29 + i)] = char(crc >> (24 - 8 * i));
  return png;
}

// Whether /metrics on `port` shows every one of `lines` within ten seconds.
bool metrics_show(int port, const std::vector<std::string>& lines) {
  httplib::Client c("127.0.0.1", port);
  for (int i = 0; i < 2000; ++i) {
    const auto m = c.Get("/metrics");
    if (m && std::all_of(lines.begin(), lines.end(),
                         [&](const std::string& l) { return m->body.find(l) != std::string::npos; }))
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// A raw TCP connection to the server on loopback (for what an HTTP client library would not do:
// hang up mid-request, hold many streams open).
int raw_connection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return fd;
}

class Serve : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server::ServeOptions o;
    o.models = {ModelParts{test::fixture("klein_tiny_a")}, ModelParts{test::official_dir()}};
    o.port = 0;
    o.queue = 1;
    o.api_key = "sekret";
    o.max_body = 64 << 10;
    server_ = new server::Server(o);
    port_ = server_->start();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  httplib::Client client(bool key = true) const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(120, 0);
    if (key) c.set_bearer_token_auth("sekret");
    return c;
  }
  // Expects a JSON error of `status` whose message holds `fragment` (and names `param`).
  static void expect_refusal(const httplib::Result& r, int status, const std::string& fragment,
                             const std::string& param = "") {
    ASSERT_TRUE(r) << "no response";
    EXPECT_EQ(r->status, status) << r->body;
    const Json j = Json::parse(r->body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << r->body;
    EXPECT_NE(j["error"]["message"].get<std::string>().find(fragment), std::string::npos) << r->body;
    if (!param.empty()) EXPECT_EQ(j["error"]["param"], param) << r->body;
  }
  // A job's state once it has left queued and running (empty, and a failure, if it never does).
  Json finished_job(const std::string& id) const {
    for (int i = 0; i < 600; ++i) {
      const Json j = Json::parse(client().Get(("/v1/jobs/" + id).c_str())->body);
      if (j["state"] != "queued" && j["state"] != "running") return j;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << id << " never finished";
    return Json();
  }
  static std::string image_id() { return model_id(test::fixture("klein_tiny_a")); }
  static std::string model_id(const std::string& dir) { return ImageModel::open(dir, Weights::none)->label(); }
  static server::Server* server_;
  static int port_;
};
server::Server* Serve::server_ = nullptr;
int Serve::port_ = 0;

TEST_F(Serve, HealthModelsAndTheKey) {
  auto r = client(false).Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body), (Json{{"status", "ok"}, {"version", version()}}));
  expect_refusal(client(false).Get("/v1/models"), 401, "API key");
  r = client().Get("/v1/models");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  const Json j = Json::parse(r->body);
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["data"][0]["kind"], "image");
  EXPECT_EQ(j["data"][1]["kind"], "audio");
}

// Two images in one request: the engine's own bytes for seeds 42 and 43.
TEST_F(Serve, ImagesAreTheEnginesImages) {
  const Json body = {{"prompt", "a red fox in tall grass"}, {"size", "64x48"},  {"n", 2}, {"seed", 42}, {"steps", 2},
                     {"response_format", "b64_json"},       {"user", "someone"}};
  const auto r = client().Post("/v1/images/generations", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const Json j = Json::parse(r->body);
  ASSERT_EQ(j["data"].size(), 2u);
  // OpenAI's ImagesResponse: created (integer seconds), data[] with b64_json.
  EXPECT_TRUE(j["created"].is_number_integer());
  EXPECT_NEAR(double(j["created"].get<int64_t>()), double(std::time(nullptr)), 60.0);
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  for (int i = 0; i < 2; ++i) {
    ImageRequest want = engine_request("a red fox in tall grass", 64, 48, 2, 42 + i);
    const PngImage png = read_png(as_file(unbase64(j["data"][i]["b64_json"]), "serve_image.png"));
    EXPECT_EQ(png.width, 64);
    EXPECT_EQ(png.rgb, model->generate(want).rgb) << "image " << i;
    EXPECT_EQ(j["data"][i]["seed"], 42 + i);
  }
}

// What apps written for OpenAI send: its model names (the server's image model answers), url
// responses (the job's kept file, fetched), JPEG and WebP outputs (output_compression their
// quality; WebP at 100 lossless, the engine's pixels exactly).
TEST_F(Serve, OpenAiModelNamesUrlsAndOutputFormats) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  const std::vector<uint8_t> want = model->generate(engine_request("a red fox", 64, 48, 2, 42)).rgb;
  for (const char* name : {"gpt-image-1", "dall-e-3"}) {
    const Json body = {
        {"model", name}, {"prompt", "a red fox"},    {"size", "64x48"},         {"seed", 42},
        {"steps", 2},    {"response_format", "url"}, {"output_format", "webp"}, {"output_compression", 100}};
    const auto r = client().Post("/v1/images/generations", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const std::string url = Json::parse(r->body)["data"][0]["url"];
    const size_t path = url.find("/v1/jobs/");
    ASSERT_NE(path, std::string::npos) << url;
    EXPECT_EQ(url.rfind("http://", 0), 0u) << url;
    const auto file = client().Get(url.substr(path).c_str());
    ASSERT_TRUE(file);
    ASSERT_EQ(file->status, 200) << file->body;
    EXPECT_EQ(file->get_header_value("Content-Type"), "image/webp");
    const Rgb8Image got = decode_image(file->body, "webp");
    EXPECT_EQ(got.rgb, want) << name;
    expect_refusal(client().Get((url.substr(path, url.rfind('/') - path) + "/5").c_str()), 404, "not a file 5",
                   "files");
  }
  const Json jpeg = {{"prompt", "a red fox"},   {"size", "64x48"},         {"seed", 42}, {"steps", 2},
                     {"output_format", "jpeg"}, {"output_compression", 90}};
  const auto r = client().Post("/v1/images/generations", jpeg.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const std::vector<uint8_t> bytes = unbase64(Json::parse(r->body)["data"][0]["b64_json"]);
  ASSERT_GT(bytes.size(), 4u);
  EXPECT_EQ(bytes[0], 0xff);
  EXPECT_EQ(bytes[1], 0xd8);  // a JPEG's start of image
  // The engine's pixels through the same encoder at quality 90: the same JPEG pixels.
  const std::vector<uint8_t> same = encode_jpeg(Rgb8Image{64, 48, want}, 90, "", "want");
  EXPECT_EQ(decode_image(std::string(bytes.begin(), bytes.end()), "jpeg").rgb,
            decode_image(std::string(same.begin(), same.end()), "want").rgb);
  expect_refusal(
      client().Post("/v1/images/generations", R"({"prompt": "x", "output_format": "gif"})", "application/json"), 400,
      "'gif' is not one of png, jpeg, webp", "output_format");
  expect_refusal(
      client().Post("/v1/images/generations", R"({"prompt": "x", "response_format": "file"})", "application/json"), 400,
      "expected b64_json or url", "response_format");
  expect_refusal(client().Post("/v1/images/generations", R"({"prompt": "x", "model": "sd_xl"})", "application/json"),
                 404, "'sd_xl' is not loaded", "model");
}

// OpenAI's streamed generation (the SDK's images.generate(stream=True, partial_images=N)): the live
// previews as partial images spread over the steps, then the completed image, the engine's own.
TEST_F(Serve, OpenAiStreamsPartialImagesThenTheImage) {
  const Json body = {{"prompt", "a red fox"}, {"size", "64x48"},    {"seed", 42}, {"steps", 4},
                     {"stream", true},        {"partial_images", 2}};
  const auto r = client().Post("/v1/images/generations", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type").rfind("text/event-stream", 0), 0u);
  std::vector<Json> events;
  for (size_t at = r->body.find("data: "); at != std::string::npos; at = r->body.find("data: ", at + 1))
    events.push_back(Json::parse(r->body.substr(at + 6, r->body.find('\n', at) - at - 6)));
  ASSERT_EQ(events.size(), 3u) << r->body;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(events[size_t(i)]["type"], "image_generation.partial_image");
    EXPECT_EQ(events[size_t(i)]["partial_image_index"], i);
    EXPECT_GT(read_png(as_file(unbase64(events[size_t(i)]["b64_json"]), "serve_partial.png")).width, 0);
  }
  EXPECT_EQ(events[2]["type"], "image_generation.completed");
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  EXPECT_EQ(read_png(as_file(unbase64(events[2]["b64_json"]), "serve_streamed.png")).rgb,
            model->generate(engine_request("a red fox", 64, 48, 4, 42)).rgb);
  expect_refusal(
      client().Post("/v1/images/generations", R"({"prompt": "x", "stream": true, "n": 2})", "application/json"), 400,
      "one image", "n");
  expect_refusal(client().Post("/v1/images/generations", R"({"prompt": "x", "partial_images": 2})", "application/json"),
                 400, "stream: true", "partial_images");
}

// A clip: the file itself, the engine's samples (bf16, as the resident model serves).
TEST_F(Serve, AudioIsTheEnginesClip) {
  const Json body = {{"prompt", "warm lo-fi hip hop"}, {"seconds", 1.4}, {"seed", 42}, {"format", "wav-float"}};
  const auto r = client().Post("/v1/audio/generations", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "audio/wav");
  EXPECT_EQ(r->get_header_value("X-Seed"), "42");
  const Audio got = read_audio(as_file(std::vector<uint8_t>(r->body.begin(), r->body.end()), "serve_clip.wav"),
                               test::kTestClipSeconds);
  AudioRequest want;
  want.prompt = "warm lo-fi hip hop";
  want.seconds = 1.4;
  want.seed = 42;
  EXPECT_EQ(got.samples, AudioModel::open(test::official_dir(), Weights::per_stage)->generate(want).samples);
}

// OpenAI's speech route, as its SDK calls it (client.audio.speech.create(model="tts-1", voice=...,
// input=..., response_format="flac")): the same clip as /v1/audio/generations with that prompt.
TEST_F(Serve, OpenAiSpeechIsTheAudioRoute) {
  const Json speech = {{"model", "tts-1"},          {"voice", "alloy"}, {"input", "warm lo-fi hip hop"},
                       {"response_format", "flac"}, {"seconds", 1.4},   {"seed", 42}};
  const auto r = client().Post("/v1/audio/speech", speech.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "audio/flac");
  const Json same = {{"prompt", "warm lo-fi hip hop"}, {"format", "flac"}, {"seconds", 1.4}, {"seed", 42}};
  const auto g = client().Post("/v1/audio/generations", same.dump(), "application/json");
  ASSERT_TRUE(g && g->status == 200);
  EXPECT_EQ(r->body, g->body);
  auto post = [&](const Json& extra) {
    Json b = {{"model", "tts-1"}, {"voice", "alloy"}, {"input", "rain"}, {"seconds", 1.4}};
    b.update(extra);
    return client().Post("/v1/audio/speech", b.dump(), "application/json");
  };
  expect_refusal(post({{"response_format", "mp3"}}), 400, "expected wav or flac", "response_format");
  expect_refusal(post({{"speed", 1.5}}), 400, "'speed'", "speed");
  expect_refusal(post({{"instructions", "whisper"}}), 400, "'instructions'", "instructions");
  expect_refusal(client().Post("/v1/audio/speech", R"({"voice": "alloy"})", "application/json"), 400, "'input'",
                 "input");
}

std::string base64_of(const std::string& bytes) {
  static const char* table = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const uint32_t v = uint32_t(uint8_t(bytes[i])) << 16 |
                       (i + 1 < bytes.size() ? uint32_t(uint8_t(bytes[i + 1])) << 8 : 0) |
                       (i + 2 < bytes.size() ? uint32_t(uint8_t(bytes[i + 2])) : 0);
    out += table[(v >> 18) & 63];
    out += table[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? table[(v >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? table[v & 63] : '=';
  }
  return out;
}

// A clip's title and comment, as players read them.
std::pair<std::string, std::string> metadata_of(const std::string& path) {
  SF_INFO info{};
  SNDFILE* sf = sf_open(path.c_str(), SFM_READ, &info);
  EXPECT_NE(sf, nullptr) << path;
  if (!sf) return {};
  auto text = [&](int key) {
    const char* t = sf_get_string(sf, key);
    return std::string(t ? t : "");
  };
  std::pair<std::string, std::string> m{text(SF_STR_TITLE), text(SF_STR_COMMENT)};
  sf_close(sf);
  return m;
}

// The same request's clip carries the same metadata from the CLI and from the server: guidance,
// precision and the inputs included, a clip sent to the server named by its field, not a file.
TEST_F(Serve, AudioMetadataIsTheClisForTheSameRequest) {
  const std::string init = test::fixture("sa3_tiny/inputs/init.wav"),
                    inpaint = test::fixture("sa3_tiny/inputs/inpaint.wav");
  struct Case {
    std::string cli;
    Json body;
    std::vector<std::pair<std::string, std::string>> names;
  };
  const std::vector<Case> cases = {
      {"--cfg 2 --apg 0.5", {{"cfg", 2}, {"apg", 0.5}}, {}},
      {"--init-audio " + init + " --init-noise-level 0.6",
       {{"init_audio", base64_of(read_file(init))}, {"init_noise_level", 0.6}},
       {{init, "init_audio"}}},
      {"--inpaint-audio " + inpaint + " --inpaint-start 0.3 --inpaint-end 0.8",
       {{"inpaint_audio", base64_of(read_file(inpaint))}, {"inpaint_regions", {{0.3, 0.8}}}},
       {{inpaint, "inpaint_audio"}}},
  };
  const std::string out = ::testing::TempDir() + "apus_cli_meta.wav";
  for (const Case& c : cases) {
    const test::CliRun cli = test::run_cli("audio --model " + test::official_dir() + " -p 'rain on a tin roof' " +
                                           "--seconds 1.4 --steps 2 --seed 9 " + c.cli + " -o " + out);
    ASSERT_EQ(cli.status, 0) << cli.output;
    Json body = {{"prompt", "rain on a tin roof"}, {"seconds", 1.4}, {"steps", 2}, {"seed", 9}};
    body.update(c.body);
    const auto r = client().Post("/v1/audio/generations", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const auto served = metadata_of(as_file(std::vector<uint8_t>(r->body.begin(), r->body.end()), "serve_meta.wav"));
    auto [title, comment] = metadata_of(out);
    for (const auto& [file, field] : c.names) {
      ASSERT_NE(comment.find(file), std::string::npos) << comment;
      comment.replace(comment.find(file), file.size(), field);
    }
    EXPECT_EQ(served.first, title);
    EXPECT_EQ(served.second, comment);
    EXPECT_NE(comment.find("Precision: bf16"), std::string::npos) << comment;
  }
  EXPECT_NE(metadata_of(out).second.find("Inpaint audio: " + inpaint + ", Inpaint: 0.3-0.8 s"), std::string::npos);
  std::filesystem::remove(out);
}

// The same request's image is the same file from the CLI and from the server, byte for byte: pixels,
// the parameters text (guidance and precision included) and the software's name.
TEST_F(Serve, ImageFileIsTheClisForTheSameRequest) {
  const std::string out = ::testing::TempDir() + "apus_cli_meta.png";
  const test::CliRun cli = test::run_cli("image --model " + test::fixture("klein_tiny_a") +
                                         " -p 'a red fox' -W 32 -H 48 --steps 2 --seed 9 -o " + out);
  ASSERT_EQ(cli.status, 0) << cli.output;
  const Json body = {
      {"prompt", "a red fox"}, {"size", "32x48"}, {"steps", 2}, {"seed", 9}, {"response_format", "b64_json"}};
  const auto r = client().Post("/v1/images/generations", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const std::vector<uint8_t> served = unbase64(Json::parse(r->body)["data"][0]["b64_json"]);
  const std::string file = read_file(out);
  EXPECT_EQ(std::string(served.begin(), served.end()), file);
  EXPECT_NE(file.find("Seed: 9, Size: 32x48"), std::string::npos);
  EXPECT_NE(file.find("Software"), std::string::npos);
  std::filesystem::remove(out);
}

// OpenAI's images/edits (a multipart form, the images as files) and the jobs API (the images as
// base64) give the engine's edit of the same references.
TEST_F(Serve, EditsAreTheEnginesEdits) {
  const std::string ref0 = read_file(test::fixture("klein_tiny_a_edit/ref0.png")),
                    ref1 = read_file(test::fixture("images/baseline.jpg"));
  ImageRequest want = engine_request("night", std::nullopt, std::nullopt, 2, 5);
  want.references = {decode_image(ref0, "ref0"), decode_image(ref1, "ref1")};
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  // The JPEG is 40x24: under the pipeline's 64-pixel minimum.
  test::expect_error([&] { model->generate(want); }, {"reference image 2 is 40x24"});
  want.references.pop_back();
  const std::vector<uint8_t> expected = model->generate(want).rgb;

  const httplib::MultipartFormDataItems form = {{"prompt", "night", "", ""},
                                                {"steps", "2", "", ""},
                                                {"seed", "5", "", ""},
                                                {"response_format", "b64_json", "", ""},
                                                {"image[]", ref0, "ref0.png", "image/png"}};
  const auto r = client().Post("/v1/images/edits", form);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const Json j = Json::parse(r->body);
  ASSERT_EQ(j["data"].size(), 1u);
  const PngImage png = read_png(as_file(unbase64(j["data"][0]["b64_json"]), "serve_edit.png"));
  EXPECT_EQ(png.width, 64) << "the size of the first image";
  EXPECT_EQ(png.rgb, expected);

  const Json job = {
      {"kind", "image"}, {"prompt", "night"}, {"steps", 2}, {"seed", 5}, {"images", Json::array({base64_of(ref0)})}};
  const auto submitted = client().Post("/v1/jobs", job.dump(), "application/json");
  ASSERT_TRUE(submitted);
  ASSERT_EQ(submitted->status, 202) << submitted->body;
  const Json state = finished_job(Json::parse(submitted->body)["id"]);
  ASSERT_EQ(state["state"], "done") << state.dump();
  EXPECT_EQ(read_png(as_file(unbase64(state["results"][0]["b64"]), "serve_job_edit.png")).rgb, expected);

  // Refusals naming the field.
  const httplib::MultipartFormDataItems no_image = {{"prompt", "night", "", ""}};
  expect_refusal(client().Post("/v1/images/edits", no_image), 400, "'image' is required", "image");
  const httplib::MultipartFormDataItems small = {{"prompt", "x", "", ""}, {"image", ref1, "a.jpg", "image/jpeg"}};
  expect_refusal(client().Post("/v1/images/edits", small), 400, "reference image 1 is 40x24");
  const httplib::MultipartFormDataItems junk = {{"prompt", "x", "", ""},
                                                {"image", "not an image", "a.png", "image/png"}};
  expect_refusal(client().Post("/v1/images/edits", junk), 400, "images[0]: not a PNG, JPEG or WebP image", "images");
  expect_refusal(client().Post("/v1/images/generations", R"({"prompt": "x", "size": "auto"})", "application/json"), 400,
                 "'size' auto takes the first of 'images'", "size");
}

// Inpainting over HTTP: OpenAI's edits with their mask (a PNG transparent where to repaint, its
// colours ignored) and the jobs API with a diffusers mask (white repaints) and a reference, each
// the engine's own inpainting of the same inputs.
TEST_F(Serve, InpaintingIsTheEnginesInpainting) {
  const std::string dir = test::fixture("klein_tiny_a_inpaint/");
  const std::string image = read_file(dir + "image.png"), mask = read_file(dir + "mask.png"),
                    openai = read_file(dir + "mask_openai.png"), reference = read_file(dir + "reference.png");
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  ImageRequest want = engine_request("a door", std::nullopt, std::nullopt, 2, 3);
  const PngImage transparent = decode_png(openai, "mask_openai.png", /*with_alpha=*/true);
  Rgb8Image white{transparent.width, transparent.height, std::vector<uint8_t>(transparent.rgb.size())};
  for (size_t i = 0; i < transparent.alpha.size(); ++i)
    std::memset(&white.rgb[3 * i], transparent.alpha[i] ? 0 : 255, 3);
  want.inpaint = Inpainting{decode_image(image, "image"), white, 0.7};
  const ImageResult expected = model->generate(want);

  const httplib::MultipartFormDataItems form = {{"prompt", "a door", "", ""},
                                                {"steps", "2", "", ""},
                                                {"seed", "3", "", ""},
                                                {"strength", "0.7", "", ""},
                                                {"image", image, "image.png", "image/png"},
                                                {"mask", openai, "mask.png", "image/png"}};
  const auto r = client().Post("/v1/images/edits", form);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const PngImage png = read_png(as_file(unbase64(Json::parse(r->body)["data"][0]["b64_json"]), "serve_inpaint.png"));
  EXPECT_EQ(png.width, expected.width);
  EXPECT_EQ(png.rgb, expected.rgb);
  bool strength = false;
  for (const auto& [k, v] : png.text)
    strength |= k == "parameters" && v.find("Denoising strength: 0.7,") != std::string::npos;
  EXPECT_TRUE(strength);

  want.inpaint->mask = decode_image(mask, "mask");
  want.inpaint->strength = 0.8;
  want.references = {decode_image(reference, "reference")};
  const std::vector<uint8_t> with_reference = model->generate(want).rgb;
  const Json job = {
      {"kind", "image"}, {"prompt", "a door"},      {"steps", 2},
      {"seed", 3},       {"mask", base64_of(mask)}, {"images", Json::array({base64_of(image), base64_of(reference)})}};
  const auto submitted = client().Post("/v1/jobs", job.dump(), "application/json");
  ASSERT_TRUE(submitted);
  ASSERT_EQ(submitted->status, 202) << submitted->body;
  const Json state = finished_job(Json::parse(submitted->body)["id"]);
  ASSERT_EQ(state["state"], "done") << state.dump();
  EXPECT_EQ(read_png(as_file(unbase64(state["results"][0]["b64"]), "serve_job_inpaint.png")).rgb, with_reference);

  // Refusals naming the field.
  const httplib::MultipartFormDataItems opaque = {
      {"prompt", "x", "", ""}, {"image", image, "a.png", "image/png"}, {"mask", mask, "m.png", "image/png"}};
  expect_refusal(client().Post("/v1/images/edits", opaque), 400, "'mask' has no fully transparent pixel", "mask");
  const httplib::MultipartFormDataItems jpeg_mask = {
      {"prompt", "x", "", ""},
      {"image", image, "a.png", "image/png"},
      {"mask", read_file(test::fixture("images/baseline.jpg")), "m.jpg", "image/jpeg"}};
  expect_refusal(client().Post("/v1/images/edits", jpeg_mask), 400, "mask: not a PNG file", "mask");
  const Json strength_alone = {{"prompt", "x"}, {"strength", 0.5}, {"images", Json::array({base64_of(image)})}};
  expect_refusal(client().Post("/v1/images/generations", strength_alone.dump(), "application/json"), 400,
                 "'strength' is for inpainting", "strength");
  const Json no_image = {{"prompt", "x"}, {"mask", base64_of(mask)}};
  expect_refusal(client().Post("/v1/images/generations", no_image.dump(), "application/json"), 400,
                 "'mask' repaints the first of 'images'", "mask");
  const Json too_strong = {
      {"prompt", "x"}, {"mask", base64_of(mask)}, {"strength", 2}, {"images", Json::array({base64_of(image)})}};
  expect_refusal(client().Post("/v1/images/generations", too_strong.dump(), "application/json"), 400,
                 "strength 2 outside [0, 1]");
}

// Audio-to-audio and inpainting over HTTP: the clips as base64 files; the engine's own samples.
TEST_F(Serve, AudioInputsAreTheEnginesClips) {
  const auto model = AudioModel::open(test::official_dir(), Weights::per_stage);
  auto clip = [](const std::string& rel) {
    Audio a = read_audio(test::fixture(rel), test::kTestClipSeconds);
    return AudioClip{a.rate, a.channels, std::move(a.samples)};
  };
  struct Case {
    Json fields;
    AudioRequest want;
  };
  AudioRequest base;
  base.prompt = "warm lo-fi hip hop";
  base.seconds = 1.4;
  base.seed = 42;
  AudioRequest a2a = base, inpaint = base;
  a2a.init_audio = clip("sa3_tiny/inputs/init.wav");
  a2a.init_noise_level = 0.6;
  inpaint.inpaint_audio = clip("sa3_tiny/inputs/inpaint.wav");
  inpaint.inpaint_regions = {{0.3, 0.8}, {1.0, 1.2}};
  const std::string init_b64 = base64_of(read_file(test::fixture("sa3_tiny/inputs/init.wav")));
  const std::string inpaint_b64 = base64_of(read_file(test::fixture("sa3_tiny/inputs/inpaint.wav")));
  const Json common = {{"prompt", base.prompt}, {"seconds", 1.4}, {"seed", 42}, {"format", "wav-float"}};
  for (const Case& k :
       {Case{{{"init_audio", init_b64}, {"init_noise_level", 0.6}}, a2a},
        Case{{{"inpaint_audio", inpaint_b64}, {"inpaint_regions", {{0.3, 0.8}, {1.0, 1.2}}}}, inpaint}}) {
    Json body = common;
    body.update(k.fields);
    const auto r = client().Post("/v1/audio/generations", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const Audio got = read_audio(as_file(std::vector<uint8_t>(r->body.begin(), r->body.end()), "serve_input.wav"),
                                 test::kTestClipSeconds);
    EXPECT_EQ(got.samples, model->generate(k.want).samples) << k.fields.begin().key();
  }
  auto post = [&](const Json& extra) {
    Json body = common;
    body.update(extra);
    return client().Post("/v1/audio/generations", body.dump(), "application/json");
  };
  expect_refusal(post({{"init_audio", "not base64!"}}), 400, "base64", "init_audio");
  expect_refusal(post({{"init_audio", base64_of("RIFF but not a wave file")}}), 400, "not an audio file", "init_audio");
  expect_refusal(post({{"inpaint_audio", inpaint_b64}, {"inpaint_regions", {1, 2}}}), 400, "[start, end]",
                 "inpaint_regions");
  expect_refusal(post({{"inpaint_audio", inpaint_b64}, {"inpaint_regions", {{0.2, 9.0}}}}), 400, "inpaint region");
  expect_refusal(post({{"init_audio", init_b64}, {"init_noise_level", 2}}), 400, "init_noise_level 2 outside (0, 1]");
  // The CLI's checks, through the engine: the same words.
  expect_refusal(post({{"init_noise_level", 0.5}}), 400,
                 "init_noise_level 0.5 is for audio-to-audio: it needs an init audio clip");
  for (const double tiny : {1e-5, 1e-320}) expect_refusal(post({{"seconds", tiny}}), 400, "outside [0.000488281, ");
  // A 4 kB FLAC whose header claims 2^32 - 1 frames: refused from its header, nothing decoded.
  expect_refusal(post({{"init_audio", base64_of(test::flac_claiming((int64_t(1) << 32) - 1))}}), 400,
                 "init_audio: the header claims 4294967295 frames, more than a file of", "init_audio");
  // A WAV of no frames says what the CLI says of one.
  static const char header[] = "RIFF\x24\0\0\0WAVEfmt \x10\0\0\0\x01\0\x01\0\x44\xac\0\0\x88\x58\x01\0\x02\0\x10\0data";
  const std::string empty_wav = std::string(header, sizeof header - 1) + std::string(4, '\0');
  expect_refusal(post({{"init_audio", base64_of(empty_wav)}}), 400, "init_audio: holds no audio", "init_audio");
}

// One bound, one message: a limit the CLI refuses, the server refuses (400, naming its field) and
// count() refuses, each with the engine's words.
TEST_F(Serve, LimitsAreRefusedWithOneMessageByTheCliTheServerAndCount) {
  const auto image = ImageModel::open(test::fixture("klein_tiny_a"), Weights::none);
  const auto audio = AudioModel::open(test::official_dir(), Weights::none);
  const std::string out = ::testing::TempDir() + "apus_limits";
  struct Case {
    std::string cli, route;
    Json body;
    std::string field;
    std::function<void()> count;
  };
  ImageRequest steps, side, square;
  steps.width = square.width = square.height = 64;
  steps.height = 48;
  steps.steps = 201;
  side.width = 4112;
  side.height = 48;
  AudioRequest long_clip, many_steps;
  long_clip.seconds = std::floor(audio->max_seconds()) + 1;
  char too_long[32];
  std::snprintf(too_long, sizeof too_long, "%g", *long_clip.seconds);
  many_steps.seconds = 1;
  many_steps.steps = 201;
  const std::string klein = "image --model " + test::fixture("klein_tiny_a") + " -p x -o " + out + ".png ";
  const std::string sa3 = "audio --model " + test::official_dir() + " -p x -o " + out + ".wav ";
  const std::vector<Case> cases = {
      {klein + "-W 64 -H 48 --steps 201",
       "/v1/images/generations",
       {{"size", "64x48"}, {"steps", 201}},
       "steps",
       [&] { image->count(steps); }},
      {klein + "-W 4112 -H 48", "/v1/images/generations", {{"size", "4112x48"}}, "size", [&] { image->count(side); }},
      {klein + "-W 64 -H 64 -n 65",
       "/v1/images/generations",
       {{"size", "64x64"}, {"n", 65}},
       "n",
       [&] { image->count(square, 65); }},
      {sa3 + "--seconds " + too_long,
       "/v1/audio/generations",
       {{"seconds", *long_clip.seconds}},
       "seconds",
       [&] { audio->count(long_clip); }},
      {sa3 + "--seconds 1 --steps 201",
       "/v1/audio/generations",
       {{"seconds", 1}, {"steps", 201}},
       "steps",
       [&] { audio->count(many_steps); }},
  };
  for (const Case& c : cases) {
    const std::string counted = test::refusal(c.count).message;
    const test::CliRun cli = test::run_cli(c.cli);
    EXPECT_EQ(cli.status, 1) << c.cli;
    EXPECT_EQ(cli.output, "error: " + counted + "\n") << c.cli;
    Json body = c.body;
    body["prompt"] = "x";
    const auto r = client().Post(c.route.c_str(), body.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    const Json error = Json::parse(r->body)["error"];
    EXPECT_EQ(error["message"], counted) << c.cli;
    EXPECT_EQ(error["param"], c.field) << c.cli;
  }
}

TEST_F(Serve, BadRequestsAreRefusedNamingTheField) {
  auto post = [&](const std::string& path, const std::string& body) {
    return client().Post(path.c_str(), body, "application/json");
  };
  const std::string images = "/v1/images/generations", audio = "/v1/audio/generations";
  expect_refusal(post(images, "{not json"), 400, "not valid JSON: parse error at line 1, column 3");
  expect_refusal(post(images, "[1, 2]"), 400, "the body is JSON array, expected an object");
  // What is wrong and where, never the client's bytes echoed back.
  expect_refusal(post(images, R"({"prompt": "x", "cfg": 1e999})"), 400,
                 "number overflow parsing '1e999' (beyond the range of a double)");
  expect_refusal(post(images, "{\"prompt\": \"ab\xff\"}"), 400,
                 "not valid JSON: parse error at line 1, column 15: syntax error while parsing value - invalid string: "
                 "ill-formed UTF-8 byte");
  expect_refusal(post(images, R"({"prompt": "x", "bogus": 1})"), 400, "unrecognized request argument", "bogus");
  expect_refusal(post(images, R"({"size": "64x64"})"), 400, "'prompt' is required", "prompt");
  expect_refusal(post(images, R"({"prompt": 7})"), 400, "'prompt' must be a string", "prompt");
  expect_refusal(post(images, R"({"prompt": "x", "size": "100x100"})"), 400, "multiples of 16", "size");
  expect_refusal(post(images, R"({"prompt": "x", "size": "64x64", "n": 65})"), 400, "batch 65 outside 1..64", "n");
  expect_refusal(post(images, R"({"prompt": "x", "size": "64x64", "response_format": "link"})"), 400, "b64_json or url",
                 "response_format");
  expect_refusal(post(images, R"({"prompt": "x", "model": "nope"})"), 404, "'nope' is not loaded", "model");
  expect_refusal(post(images, Json{{"prompt", std::string(5000, 'a')}}.dump()), 400, "longer than", "prompt");
  expect_refusal(post(audio, R"({"prompt": "x", "seconds": 0})"), 400, "seconds 0 outside [", "seconds");
  expect_refusal(post(audio, R"({"prompt": "x", "seconds": 1, "format": "mp3"})"), 400, "mp3", "format");
  expect_refusal(post(audio, R"({"prompt": "x", "seconds": 1, "steps": 0})"), 400, "steps 0 outside 1..200", "steps");
  expect_refusal(post(audio, Json{{"prompt", "x"}, {"model", image_id()}}.dump()), 400, "makes image, not audio",
                 "model");
  // What the engine itself refuses is answered before the job is queued.
  expect_refusal(post(audio, R"({"prompt": "x", "seconds": 1, "cfg": 500})"), 400, "cfg 500 outside");
  expect_refusal(post(audio, R"({"prompt": "x", "seconds": 1, "negative_prompt": "hiss"})"), 400,
                 "a negative prompt needs guidance");
  expect_refusal(post(images, R"({"prompt": "x", "size": "64x64", "cfg": 3})"), 400, "cfg 3 is for the -base models",
                 "cfg");
  // A given 0 is a value, not "the model's default" (absent is).
  expect_refusal(post(images, R"({"prompt": "x", "size": "64x64", "cfg": 0})"), 400, "cfg 0 outside (0, 100]", "cfg");
  expect_refusal(post(images, R"({"prompt": "x", "size": "64x64", "steps": 0})"), 400, "steps 0 outside 1..200",
                 "steps");
  expect_refusal(post(images, R"({"prompt": "x", "size": "0x0"})"), 400, "width 0 outside 16..4096", "size");
  expect_refusal(post(images, R"({"prompt": "x", "size": "64by64"})"), 400, "'size' is \"64by64\", expected WxH",
                 "size");
  // An image whose header claims 16384 x 16384 pixels is refused before it is decoded.
  expect_refusal(post(images, Json{{"prompt", "x"}, {"images", {base64_of(png_claiming(16384, 16384))}}}.dump()), 400,
                 "images[0]: 16384x16384 pixels, over the 67108864 this reader decodes", "images");
  expect_refusal(post(images, R"({"prompt": "x", "size": "64x64", "negative_prompt": "blur"})"), 400,
                 "a negative prompt is for the -base models", "negative_prompt");
  expect_refusal(post(images, Json{{"prompt", std::string(70000, 'a')}}.dump()), 413, "larger");
  expect_refusal(client().Get("/v1/jobs/job-nope"), 404, "no job");
  expect_refusal(post("/v1/jobs", R"({"prompt": "x"})"), 400, "'kind'", "kind");
}

// Jobs: an id at once, progress, the result; a full queue answers 429 with Retry-After; a
// cancelled job ends as cancelled and the next one still runs.
TEST_F(Serve, JobsQueueAndCancel) {
  const std::string clip =
      Json{{"kind", "audio"}, {"prompt", "rain on a tin roof"}, {"seconds", 1.4}, {"seed", 3}}.dump();
  std::vector<std::string> accepted;
  int refused = 0;
  for (int i = 0; i < 5; ++i) {
    const auto r = client().Post("/v1/jobs", clip, "application/json");
    ASSERT_TRUE(r);
    if (r->status == 202) {
      accepted.push_back(Json::parse(r->body)["id"]);
    } else {
      expect_refusal(r, 429, "queue");
      EXPECT_EQ(r->get_header_value("Retry-After"), "5");
      ++refused;
    }
  }
  // One runs, one waits: at least three of five quick submissions are turned away.
  EXPECT_GE(refused, 3);
  ASSERT_GE(accepted.size(), 1u);
  const auto cancel = client().Delete(("/v1/jobs/" + accepted.back()).c_str());
  ASSERT_TRUE(cancel);
  EXPECT_EQ(cancel->status, 200);
  auto state_of = [&](const std::string& id) {
    for (int tries = 0; tries < 600; ++tries) {
      const auto r = client().Get(("/v1/jobs/" + id).c_str());
      const Json j = Json::parse(r->body);
      const std::string s = j["state"];
      if (s == "done" || s == "failed" || s == "cancelled") return j;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return Json();
  };
  const Json last = state_of(accepted.back());
  EXPECT_EQ(last["state"], accepted.size() == 1 ? last["state"] : Json("cancelled"));
  for (size_t i = 0; i + 1 < accepted.size(); ++i) {
    const Json j = state_of(accepted[i]);
    ASSERT_EQ(j["state"], "done") << j.dump();
    EXPECT_EQ(j["steps"], 8);
    EXPECT_EQ(j["progress"], 1.0);
    const auto bytes = unbase64(j["results"][0]["b64"]);
    EXPECT_EQ(read_audio(as_file(bytes, "serve_job.wav"), test::kTestClipSeconds).frames(), int64_t(1.4 * 2048));
  }
  // The queue is free again.
  const auto again = client().Post("/v1/jobs", clip, "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 202) << again->body;
  EXPECT_EQ(state_of(Json::parse(again->body)["id"])["state"], "done");
}

// A full queue is answered before any file of the request is decoded (a request it turns away
// costs no pixels), and a form cut short says what is wrong with it.
TEST_F(Serve, AFullQueueRefusesBeforeDecodingAndFormsSayWhatIsWrong) {
  const Json long_job = {{"kind", "image"}, {"prompt", "a fox"}, {"size", "1024x1024"}, {"steps", 100}, {"seed", 1}};
  std::vector<std::string> ids;
  for (int i = 0; i < 2; ++i) {  // one runs, one waits: the queue (1) is full
    const auto r = client().Post("/v1/jobs", long_job.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 202) << r->body;
    ids.push_back(Json::parse(r->body)["id"]);
    // The first leaves the queue for the worker before the second comes: on a loaded machine the
    // second could otherwise find it still waiting and the queue full.
    for (int wait = 0; i == 0 && wait < 200; ++wait) {
      const auto job = client().Get("/v1/jobs/" + ids[0]);
      ASSERT_TRUE(job);
      if (Json::parse(job->body)["state"] != "queued") break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  // Its image is no image at all: a 400 if it were decoded first.
  const Json with_junk = {{"prompt", "x"}, {"images", Json::array({"bm90IGFuIGltYWdl"})}};
  expect_refusal(client().Post("/v1/images/generations", with_junk.dump(), "application/json"), 429, "queue");
  const std::string form =
      "--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx\r\n"
      "--b\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n\r\n\x89PNG";
  expect_refusal(client().Post("/v1/images/edits", form, "multipart/form-data; boundary=b"), 400,
                 "multipart body: part 2 ('image'): no boundary closes it: the body is truncated");
  for (const std::string& id : ids) ASSERT_TRUE(client().Delete(("/v1/jobs/" + id).c_str()));
  for (const std::string& id : ids) EXPECT_EQ(finished_job(id)["state"], "cancelled");
}

// Finished jobs are kept by the bytes of their files: past the bound the oldest is dropped.
TEST(ServeKept, FinishedJobsAreKeptByBytes) {
  server::ServeOptions o;
  o.models = {ModelParts{test::official_dir()}};
  o.port = 0;
  o.kept_results_bytes = 1;  // less than any clip: only the newest job stays
  server::Server srv(o);
  httplib::Client c("127.0.0.1", srv.start());
  auto finished = [&](const std::string& id) {
    for (int i = 0; i < 600; ++i) {
      const auto r = c.Get(("/v1/jobs/" + id).c_str());
      if (r && r->status == 200 && Json::parse(r->body)["state"] == "done") return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
  const std::string clip = Json{{"kind", "audio"}, {"prompt", "rain"}, {"seconds", 1}, {"seed", 3}}.dump();
  const std::string first = Json::parse(c.Post("/v1/jobs", clip, "application/json")->body)["id"];
  ASSERT_TRUE(finished(first));
  const std::string second = Json::parse(c.Post("/v1/jobs", clip, "application/json")->body)["id"];
  ASSERT_TRUE(finished(second));
  EXPECT_EQ(c.Get(("/v1/jobs/" + first).c_str())->status, 404);
  EXPECT_EQ(Json::parse(c.Get(("/v1/jobs/" + second).c_str())->body)["results"].size(), 1u);
}

// The AUTOMATIC1111 routes: txt2img with its field names (fields apus does not know ignored, as
// A1111 ignores them), images and the JSON-string info; progress and interrupt.
TEST_F(Serve, Automatic1111Txt2Img) {
  const Json body = {{"prompt", "a lighthouse at dawn"},
                     {"width", 48},
                     {"height", 80},
                     {"steps", 2},
                     {"seed", 11},
                     {"batch_size", 1},
                     {"negative_prompt", ""},
                     {"cfg_scale", 7},
                     {"sampler_name", "Euler"},
                     {"restore_faces", false}};
  const auto r = client().Post("/sdapi/v1/txt2img", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const Json j = Json::parse(r->body);
  ASSERT_EQ(j["images"].size(), 1u);
  const Json info = Json::parse(j["info"].get<std::string>());
  EXPECT_EQ(info["seed"], 11);
  EXPECT_EQ(info["width"], 48);
  ImageRequest want = engine_request("a lighthouse at dawn", 48, 80, 2, 11);
  const PngImage png = read_png(as_file(unbase64(j["images"][0]), "serve_a1111.png"));
  EXPECT_EQ(png.rgb, ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage)->generate(want).rgb);
  // A1111's response shapes, key by key and type by type (modules/api/models.py).
  EXPECT_TRUE(j["images"][0].is_string());
  EXPECT_TRUE(j["parameters"].is_object());
  EXPECT_TRUE(j["info"].is_string());
  const auto p = client().Get("/sdapi/v1/progress");
  ASSERT_TRUE(p);
  const Json progress = Json::parse(p->body);
  EXPECT_TRUE(progress["progress"].is_number());
  EXPECT_TRUE(progress["eta_relative"].is_number());
  EXPECT_TRUE(progress["current_image"].is_null() || progress["current_image"].is_string());
  EXPECT_TRUE(progress["textinfo"].is_null() || progress["textinfo"].is_string());
  for (const char* key : {"skipped", "interrupted"}) EXPECT_TRUE(progress["state"][key].is_boolean()) << key;
  for (const char* key : {"job", "job_timestamp"}) EXPECT_TRUE(progress["state"][key].is_string()) << key;
  for (const char* key : {"job_count", "job_no", "sampling_step", "sampling_steps"})
    EXPECT_TRUE(progress["state"][key].is_number_integer()) << key;
  EXPECT_EQ(progress["state"]["job_count"], 0);
  EXPECT_EQ(progress["state"]["sampling_steps"], 2);
  // A distilled model runs no guidance, so a negative prompt (which A1111's clients send) has
  // nothing to steer, as in A1111 and Forge: the same image, the prompt echoed in the info.
  Json negative = body;
  negative["negative_prompt"] = "blur";
  const auto n = client().Post("/sdapi/v1/txt2img", negative.dump(), "application/json");
  ASSERT_TRUE(n);
  ASSERT_EQ(n->status, 200) << n->body;
  const Json nj = Json::parse(n->body);
  EXPECT_EQ(read_png(as_file(unbase64(nj["images"][0]), "serve_a1111_negative.png")).rgb, png.rgb);
  EXPECT_EQ(Json::parse(nj["info"].get<std::string>())["negative_prompt"], "blur");
  // n_iter batches of batch_size: seeds 11, 12, ..., each image the one it is alone.
  Json iterations = body;
  iterations["n_iter"] = 2;
  const auto it = client().Post("/sdapi/v1/txt2img", iterations.dump(), "application/json");
  ASSERT_TRUE(it);
  ASSERT_EQ(it->status, 200) << it->body;
  const Json ij = Json::parse(it->body);
  ASSERT_EQ(ij["images"].size(), 2u);
  const Json iinfo = Json::parse(ij["info"].get<std::string>());
  EXPECT_EQ(iinfo["all_seeds"], Json::array({11, 12}));
  EXPECT_EQ(iinfo["n_iter"], 2);
  EXPECT_EQ(iinfo["batch_size"], 1);
  EXPECT_EQ(read_png(as_file(unbase64(ij["images"][0]), "serve_a1111_iter.png")).rgb, png.rgb);
  const auto stop = client().Post("/sdapi/v1/interrupt", "", "application/json");
  ASSERT_TRUE(stop);
  EXPECT_EQ(stop->status, 200);
}

// A1111's img2img is klein's inpainting: with a mask its white repainted (its black with
// inpainting_mask_invert), without one the whole image, from denoising_strength of the way; the
// image as base64 or as a data URL. Each the engine's own render of the same inputs.
TEST_F(Serve, Automatic1111Img2ImgIsTheEnginesInpainting) {
  const std::string dir = test::fixture("klein_tiny_a_inpaint/");
  const std::string image = read_file(dir + "image.png"), mask = read_file(dir + "mask.png");
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  const Rgb8Image picture = decode_image(image, "image"), white = decode_image(mask, "mask");
  Rgb8Image inverted = white, whole = white;
  for (uint8_t& v : inverted.rgb) v = uint8_t(255 - v);
  std::fill(whole.rgb.begin(), whole.rgb.end(), uint8_t(255));
  struct Case {
    Json fields;
    Rgb8Image mask;
    double strength;
  };
  const std::vector<Case> cases = {
      {{{"mask", base64_of(mask)}, {"denoising_strength", 0.6}}, white, 0.6},
      {{{"mask", "data:image/png;base64," + base64_of(mask)}, {"inpainting_mask_invert", 1}}, inverted, 0.75},
      {{{"denoising_strength", 0.5}, {"mask_blur", 4}, {"sampler_name", "Euler"}}, whole, 0.5},
  };
  for (const Case& c : cases) {
    Json body = {{"prompt", "a door"},
                 {"steps", 4},
                 {"seed", 9},
                 {"cfg_scale", 7},
                 {"init_images", Json::array({base64_of(image)})}};
    body.update(c.fields);
    ImageRequest want = engine_request("a door", std::nullopt, std::nullopt, 4, 9);
    want.inpaint = Inpainting{picture, c.mask, c.strength};
    const ImageResult expected = model->generate(want);
    const auto r = client().Post("/sdapi/v1/img2img", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const Json j = Json::parse(r->body);
    const PngImage png = read_png(as_file(unbase64(j["images"][0]), "serve_img2img.png"));
    EXPECT_EQ(png.width, expected.width);
    EXPECT_EQ(png.rgb, expected.rgb) << "mask marks / strength " << c.strength;
    EXPECT_EQ(Json::parse(j["info"].get<std::string>())["denoising_strength"], c.strength);
  }
  auto post = [&](const Json& fields) {
    Json body = {{"prompt", "x"}, {"init_images", Json::array({base64_of(image)})}};
    body.update(fields);
    return client().Post("/sdapi/v1/img2img", body.dump(), "application/json");
  };
  expect_refusal(post({{"init_images", Json::array()}}), 400, "'init_images' must hold the image", "init_images");
  expect_refusal(post({{"init_images", Json::array({base64_of(image), base64_of(image)})}}), 400,
                 "'init_images' holds 2 images", "init_images");
  expect_refusal(post({{"init_images", Json::array({"%%"})}}), 400, "'init_images[0]' must be an image", "init_images");
  expect_refusal(post({{"init_images", Json::array({base64_of("not an image")})}}), 400, "init_images[0]",
                 "init_images");
  expect_refusal(post({{"denoising_strength", 2}}), 400, "strength 2 outside [0, 1]", "denoising_strength");
  // img2img's answer to `body`: a PNG of the size asked, the engine's render of `want`.
  auto expect_render = [&](const Json& body, const ImageRequest& want, int width, int height, const char* file) {
    const ImageResult expected = model->generate(want);
    const auto r = client().Post("/sdapi/v1/img2img", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const PngImage png = read_png(as_file(unbase64(Json::parse(r->body)["images"][0]), file));
    EXPECT_EQ(png.width, width);
    EXPECT_EQ(png.height, height);
    EXPECT_EQ(png.rgb, expected.rgb);
  };
  // Another size than the image's: the image and mask resized to it first (A1111's "just resize").
  {
    Json body = {{"prompt", "a door"},
                 {"steps", 4},
                 {"seed", 9},
                 {"cfg_scale", 7},
                 {"width", 32},
                 {"height", 48},
                 {"mask", base64_of(mask)},
                 {"init_images", Json::array({base64_of(image)})}};
    ImageRequest want = engine_request("a door", std::nullopt, std::nullopt, 4, 9);
    want.inpaint = Inpainting{resize_lanczos(picture, 32, 48), resize_lanczos(white, 32, 48), 0.75};
    expect_render(body, want, 32, 48, "serve_img2img_resized.png");
  }
  // resize_mode 1, "crop and resize", as A1111's images.resize_image: scaled to cover 48x32 keeping
  // the aspect (the 100x84 image to 48x40, the 75x61 mask to 48x39), then the middle rows.
  {
    Json body = {{"prompt", "a door"},
                 {"steps", 4},
                 {"seed", 9},
                 {"width", 48},
                 {"height", 32},
                 {"resize_mode", 1},
                 {"mask", base64_of(mask)},
                 {"init_images", Json::array({base64_of(image)})}};
    auto middle_rows = [](const Rgb8Image& im, int first) {
      return Rgb8Image{im.width, 32,
                       std::vector<uint8_t>(im.rgb.begin() + size_t(first) * im.width * 3,
                                            im.rgb.begin() + size_t(first + 32) * im.width * 3)};
    };
    ImageRequest want = engine_request("a door", std::nullopt, std::nullopt, 4, 9);
    want.inpaint = Inpainting{middle_rows(resize_lanczos(picture, 48, 40), 4),
                              middle_rows(resize_lanczos(white, 48, 39), 3), 0.75};
    expect_render(body, want, 48, 32, "serve_img2img_cropped.png");
  }
  expect_refusal(post({{"resize_mode", 2}}), 400, "'resize_mode' is 2", "resize_mode");
  expect_refusal(post({{"inpainting_mask_invert", 2}}), 400, "'inpainting_mask_invert' is 2", "inpainting_mask_invert");
}

// The checkpoint A1111's routes render with: listed by sd-models, read and set through options
// (other option keys ignored, as A1111 ignores keys it does not know).
TEST_F(Serve, Automatic1111OptionsPickTheCheckpoint) {
  const auto listed = client().Get("/sdapi/v1/sd-models");
  ASSERT_TRUE(listed);
  ASSERT_EQ(listed->status, 200) << listed->body;
  const Json models = Json::parse(listed->body);
  ASSERT_EQ(models.size(), 1u) << models.dump();  // the audio model is no checkpoint of A1111's
  const std::string id = models[0]["title"];
  EXPECT_EQ(models[0]["model_name"], id);
  const Json options = Json::parse(client().Get("/sdapi/v1/options")->body);
  EXPECT_EQ(options["sd_model_checkpoint"], id);
  const auto set =
      client().Post("/sdapi/v1/options", Json{{"sd_model_checkpoint", id}, {"CLIP_stop_at_last_layers", 2}}.dump(),
                    "application/json");
  ASSERT_TRUE(set);
  EXPECT_EQ(set->status, 200) << set->body;
  expect_refusal(
      client().Post("/sdapi/v1/options", Json{{"sd_model_checkpoint", "sd_xl_base_1.0"}}.dump(), "application/json"),
      400, "'sd_xl_base_1.0' is not loaded", "sd_model_checkpoint");
  const Json audio = Json::parse(client().Get("/v1/models")->body)["data"];
  for (const Json& m : audio)
    if (m["kind"] == "audio")
      expect_refusal(
          client().Post("/sdapi/v1/options", Json{{"sd_model_checkpoint", m["id"]}}.dump(), "application/json"), 400,
          "makes audio, not image", "sd_model_checkpoint");
  EXPECT_EQ(Json::parse(client().Get("/sdapi/v1/options")->body)["sd_model_checkpoint"], id);
}

// A1111's progress while a render runs: the step, the time left, and the live preview as
// current_image; jobs of the other routes count too.
TEST_F(Serve, Automatic1111ProgressFollowsTheRunningJob) {
  const Json body = {{"prompt", "a lighthouse"}, {"width", 128}, {"height", 128}, {"steps", 40}, {"seed", 3}};
  std::atomic<bool> done{false};
  int status = 0;
  std::string answered;
  auto post = [&] {
    const auto r = client().Post("/sdapi/v1/txt2img", body.dump(), "application/json");
    status = r ? r->status : 0;
    answered = r ? r->body : "no answer";
    done = true;
  };
  std::thread render(post);
  bool seen_midway = false, seen_image = false;
  while (!done) {
    const auto p = client().Get("/sdapi/v1/progress");
    ASSERT_TRUE(p);
    const Json j = Json::parse(p->body);
    const int step = j["state"]["sampling_step"];
    if (step > 0 && step < 40 && j["state"]["job"] != "") {
      seen_midway = true;
      EXPECT_EQ(j["state"]["sampling_steps"], 40);
      EXPECT_NEAR(j["progress"].get<double>(), step / 40.0, 1e-9);
      EXPECT_GE(j["eta_relative"].get<double>(), 0.0);
      EXPECT_GE(j["state"]["job_count"].get<int>(), 1);
      if (j["current_image"].is_string()) {
        seen_image = true;
        const PngImage preview = read_png(as_file(unbase64(j["current_image"]), "serve_progress.png"));
        EXPECT_GT(preview.width, 0);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  render.join();
  EXPECT_EQ(status, 200) << answered;
  EXPECT_TRUE(seen_midway) << "no progress seen between the first and last step of 40";
  EXPECT_TRUE(seen_image) << "no live preview seen as current_image";
  // Interrupted midway: the call answers 200 with the image decoded from where it got (A1111's
  // interrupt), long before its 40 steps.
  done = false;
  std::thread stopped(post);
  for (;;) {
    const Json j = Json::parse(client().Get("/sdapi/v1/progress")->body);
    if (done || j["state"]["sampling_step"].get<int>() >= 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const auto stop = client().Post("/sdapi/v1/interrupt", "", "application/json");
  ASSERT_TRUE(stop);
  EXPECT_EQ(stop->status, 200);
  stopped.join();
  ASSERT_EQ(status, 200) << answered;
  const Json answer = Json::parse(answered);
  ASSERT_EQ(answer["images"].size(), 1u);
  EXPECT_EQ(read_png(as_file(unbase64(answer["images"][0]), "serve_interrupted.png")).width, 128);
  EXPECT_EQ(Json::parse(client().Get("/sdapi/v1/progress")->body)["state"]["job_count"], 0);
}

// The route table is the server: every route it lists answers its method (a request the route
// refuses is still the route's answer, never the transport's "no such route" or 405), and
// docs/USAGE.md's list of routes is that table, row for row.
TEST_F(Serve, EveryRouteOfTheTableAnswersAndIsDocumented) {
  auto path_of = [](std::string pattern) {
    for (const auto& [group, example] : {std::pair<std::string, std::string>{"([A-Za-z0-9-]+)", "{id}"},
                                         std::pair<std::string, std::string>{"([0-9]{1,4})", "{n}"}})
      for (size_t at; (at = pattern.find(group)) != std::string::npos;) pattern.replace(at, group.size(), example);
    return pattern;
  };
  std::set<std::string> table;
  for (const auto& [method, pattern] : server::Server::route_list()) {
    const std::string documented = path_of(pattern);
    EXPECT_TRUE(table.insert(method + " " + documented).second) << method << " " << pattern << " listed twice";
    std::string path = documented;
    for (const auto& [name, value] : {std::pair<std::string, std::string>{"{id}", "job-none"}, {"{n}", "0"}})
      for (size_t at; (at = path.find(name)) != std::string::npos;) path.replace(at, name.size(), value);
    const auto r = method == "GET"    ? client().Get(path)
                   : method == "POST" ? client().Post(path, "{}", "application/json")
                                      : client().Delete(path);
    ASSERT_TRUE(r) << method << " " << path << ": no answer";
    EXPECT_NE(r->status, 405) << method << " " << path << ": " << r->body;
    EXPECT_EQ(r->body.find("no such route"), std::string::npos) << method << " " << path << ": " << r->body;
  }
  std::ifstream in(std::string(APUS_FIXTURES) + "/../../docs/USAGE.md");
  ASSERT_TRUE(in) << "docs/USAGE.md beside the fixtures";
  std::set<std::string> documented;
  static const std::regex row(R"(^\| (GET|POST|DELETE) \| `([^`]+)` \|)");
  for (std::string line; std::getline(in, line);)
    if (std::smatch m; std::regex_search(line, m, row)) documented.insert(m[1].str() + " " + m[2].str());
  EXPECT_EQ(documented, table) << "docs/USAGE.md's routes and src/server/routes.cpp's table differ";
}

// What A1111 clients read at start: the sampler and schedule (the model's own), upscalers (the three without models),
// LoRAs, flags, memory; refresh routes answer; png-info reads back what txt2img wrote.
TEST_F(Serve, Automatic1111ListsAndTools) {
  auto get = [&](const char* route) {
    const auto r = client().Get(route);
    EXPECT_TRUE(r && r->status == 200) << route << ": " << (r ? r->body : "no answer");
    return Json::parse(r ? r->body : "null");
  };
  EXPECT_EQ(get("/sdapi/v1/samplers")[0]["name"], "Euler");
  EXPECT_EQ(get("/sdapi/v1/schedulers")[0]["label"], "Automatic");
  EXPECT_EQ(get("/sdapi/v1/upscalers")[0]["name"], "None");
  EXPECT_TRUE(get("/sdapi/v1/loras").is_array());
  EXPECT_EQ(get("/sdapi/v1/cmd-flags")["api"], true);
  const Json memory = get("/sdapi/v1/memory");
  EXPECT_GT(memory["ram"]["total"].get<double>(), 0);
  EXPECT_LE(memory["ram"]["free"].get<double>(), memory["ram"]["total"].get<double>());
  for (const char* route : {"/sdapi/v1/refresh-checkpoints", "/sdapi/v1/refresh-loras"}) {
    const auto r = client().Post(route, "", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << route;
  }
  const Json body = {
      {"prompt", "a lighthouse"}, {"negative_prompt", "fog"}, {"width", 48}, {"height", 32}, {"steps", 2}, {"seed", 5}};
  const auto made = client().Post("/sdapi/v1/txt2img", body.dump(), "application/json");
  ASSERT_TRUE(made && made->status == 200) << (made ? made->body : "no answer");
  const std::string image = Json::parse(made->body)["images"][0];
  const auto read = client().Post("/sdapi/v1/png-info", Json{{"image", image}}.dump(), "application/json");
  ASSERT_TRUE(read && read->status == 200) << (read ? read->body : "no answer");
  const Json info = Json::parse(read->body);
  EXPECT_NE(info["info"].get<std::string>().find("Steps: 2"), std::string::npos) << info.dump();
  EXPECT_EQ(info["parameters"]["Prompt"], "a lighthouse") << info.dump();
  EXPECT_EQ(info["parameters"]["Steps"], "2") << info.dump();
  EXPECT_EQ(info["parameters"]["Seed"], "5") << info.dump();
  expect_refusal(
      client().Post("/sdapi/v1/png-info", Json{{"image", base64_of("not a png")}}.dump(), "application/json"), 400, "",
      "image");
  expect_refusal(client().Post("/sdapi/v1/png-info", "{}", "application/json"), 400, "'image'", "image");
}

// txt2img's refusals name A1111's own fields, never the OpenAI fields apus has beside them.
// A1111's extras with the upscalers it has without model files, as its Upscale script runs them:
// Pillow's resize by the upscaler (resize_nearest and resize_lanczos are Pillow's byte for byte,
// tests/test_image.cpp), then Lanczos to sides floored to multiples of 8; "scale to" pasted
// centred on a black canvas; a second upscaler blended in; the infotext in the PNG and html_info.
TEST_F(Serve, Automatic1111ExtrasUpscaleAsItsScriptDoes) {
  const std::string source_file = read_file(test::fixture("resize/small_45x31.png"));
  const Rgb8Image src = read_image(test::fixture("resize/small_45x31.png"));
  auto run = [&](Json fields) {
    fields["image"] = base64_of(source_file);
    const auto r = client().Post("/sdapi/v1/extra-single-image", fields.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
    const Json j = Json::parse(r ? r->body : "{}");
    return std::pair{read_png(as_file(unbase64(j.value("image", "")), "serve_extras.png")),
                     j.value("html_info", std::string())};
  };
  auto text_of = [](const PngImage& png, const std::string& key) {
    for (const auto& [k, v] : png.text)
      if (k == key) return v;
    return std::string("(none)");
  };
  {
    const auto [png, html] = run({{"upscaler_1", "Lanczos"}, {"upscaling_resize", 2}});
    const Rgb8Image want = resize_lanczos(resize_lanczos(src, 90, 62), 88, 56);
    EXPECT_EQ(png.width, 88);
    EXPECT_EQ(png.height, 56);
    EXPECT_EQ(png.rgb, want.rgb);
    EXPECT_EQ(text_of(png, "postprocessing"), "Postprocess upscale by: 2.0, Postprocess upscaler: Lanczos");
    EXPECT_EQ(html, "<p>Postprocess upscale by: 2.0, Postprocess upscaler: Lanczos</p>");
  }
  {
    // Scale to 64x64: by max(64/45, 64/31), Nearest to 92x64, Lanczos to 88x64, pasted at (-12, 0).
    const auto [png, html] =
        run({{"upscaler_1", "Nearest"}, {"resize_mode", 1}, {"upscaling_resize_w", 64}, {"upscaling_resize_h", 64}});
    const Rgb8Image scaled = resize_lanczos(resize_nearest(src, 92, 64), 88, 64);
    ASSERT_EQ(png.width, 64);
    ASSERT_EQ(png.height, 64);
    for (int y = 0; y < 64; ++y)
      for (int x = 0; x < 64; ++x)
        for (int c = 0; c < 3; ++c)
          ASSERT_EQ(png.rgb[(size_t(y) * 64 + size_t(x)) * 3 + size_t(c)],
                    scaled.rgb[(size_t(y) * 88 + size_t(x + 12)) * 3 + size_t(c)])
              << x << "," << y;
    EXPECT_EQ(text_of(png, "postprocessing"),
              "Postprocess upscale to: 64x64, Postprocess crop to: 64x64, Postprocess upscaler: Nearest");
  }
  {
    // A second upscaler blended at 0.3 as Pillow's Image.blend: a + 0.3 (b - a) in floats, truncated.
    const auto [png, html] = run({{"upscaler_1", "Lanczos"},
                                  {"upscaler_2", "Nearest"},
                                  {"extras_upscaler_2_visibility", 0.3},
                                  {"upscaling_resize", 1.5}});
    const Rgb8Image a = resize_lanczos(resize_lanczos(src, 67, 46), 64, 40),
                    b = resize_lanczos(resize_nearest(src, 67, 46), 64, 40);
    ASSERT_EQ(png.rgb.size(), a.rgb.size());
    for (size_t i = 0; i < a.rgb.size(); ++i)
      ASSERT_EQ(png.rgb[i], uint8_t(float(a.rgb[i]) + 0.3f * float(int(b.rgb[i]) - int(a.rgb[i])))) << i;
    EXPECT_NE(text_of(png, "postprocessing").find("Postprocess upscaler 2: Nearest"), std::string::npos);
  }
  {
    // "None" leaves the image as it is (A1111's script returns before upscaling).
    const auto [png, html] = run({{"upscaler_1", "None"}, {"upscaling_resize", 4}});
    EXPECT_EQ(png.width, 45);
    EXPECT_EQ(png.rgb, src.rgb);
    EXPECT_EQ(html, "<p></p>");
  }
  const Json batch = {
      {"upscaler_1", "Nearest"},
      {"upscaling_resize", 2},
      {"imageList",
       {{{"data", base64_of(source_file)}, {"name", "a.png"}}, {{"data", base64_of(source_file)}, {"name", "b.png"}}}}};
  const auto r = client().Post("/sdapi/v1/extra-batch-images", batch.dump(), "application/json");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
  const Json images = Json::parse(r->body)["images"];
  ASSERT_EQ(images.size(), 2u);
  const Rgb8Image want = resize_lanczos(resize_nearest(src, 90, 62), 88, 56);
  for (const Json& image : images)
    EXPECT_EQ(read_png(as_file(unbase64(image.get<std::string>()), "serve_extras_batch.png")).rgb, want.rgb);

  const std::string image = base64_of(source_file);
  expect_refusal(client().Post("/sdapi/v1/extra-single-image",
                               Json{{"image", image}, {"gfpgan_visibility", 0.5}}.dump(), "application/json"),
                 400, "face restoration", "gfpgan_visibility");
  expect_refusal(client().Post("/sdapi/v1/extra-single-image",
                               Json{{"image", image}, {"upscaler_1", "R-ESRGAN 4x+"}}.dump(), "application/json"),
                 400, "None, Lanczos and Nearest", "upscaler_1");
  expect_refusal(client().Post("/sdapi/v1/extra-single-image",
                               Json{{"image", image}, {"upscaler_1", "Lanczos"}, {"upscaling_resize", 0.1}}.dump(),
                               "application/json"),
                 400, "would be 0x0", "upscaling_resize");
  expect_refusal(
      client().Post("/sdapi/v1/extra-single-image", Json{{"upscaler_1", "Lanczos"}}.dump(), "application/json"), 400,
      "'image'", "image");
  expect_refusal(
      client().Post("/sdapi/v1/extra-single-image",
                    Json{{"image", base64_of("not an image")}, {"upscaler_1", "Lanczos"}}.dump(), "application/json"),
      400, "", "image");
}

TEST_F(Serve, Automatic1111RefusalsNameItsFields) {
  struct Case {
    Json fields;
    std::string message, param;
  };
  const std::vector<Case> cases = {
      {{{"width", 8}}, "width 8 outside 16..4096", "width"},
      {{{"width", 100}}, "width 100 and height 512 must be multiples of 16", "width"},
      {{{"height", 4112}}, "height 4112 outside 16..4096", "height"},
      {{{"steps", 0}}, "steps 0 outside 1..200", "steps"},
      {{{"batch_size", 65}}, "batch 65 outside 1..64", "batch_size"},
      {{{"n_iter", 65}}, "'n_iter' is 65", "n_iter"},
      {{{"n_iter", 3}, {"batch_size", 32}}, "'batch_size' x 'n_iter' is 96", "n_iter"},
      {{{"seed", -2}}, "'seed' is -2", "seed"},
      // What apus does not do, refused naming the field (the values clients send by default pass).
      {{{"sampler_name", "Euler a"}},
       "'sampler_name' is 'Euler a': apus runs the model's own sampler, 'Euler'",
       "sampler_name"},
      {{{"sampler_index", "DPM++ 2M"}}, "'sampler_index' is 'DPM++ 2M'", "sampler_index"},
      {{{"scheduler", "Karras"}}, "'scheduler' is 'Karras'", "scheduler"},
      {{{"enable_hr", true}}, "'enable_hr' is true: apus has no hires fix", "enable_hr"},
      {{{"restore_faces", true}}, "'restore_faces' is true", "restore_faces"},
      {{{"tiling", true}}, "'tiling' is true", "tiling"},
      {{{"subseed_strength", 0.3}}, "no variation seeds", "subseed_strength"},
      {{{"styles", Json::array({"cinematic"})}}, "no saved styles", "styles"},
      {{{"alwayson_scripts", {{"controlnet", Json::object()}}}}, "runs no scripts", "alwayson_scripts"},
      {{{"override_settings", {{"sd_model_checkpoint", "sd_xl_base_1.0"}}}},
       "'sd_xl_base_1.0' is not loaded",
       "override_settings"},
      {{{"prompt", "a fox <lora:style:0.8>"}}, "offers no LoRAs", "loras"},
      {{{"prompt", "a fox <lora:style:strong>"}}, "has the weight 'strong', expected a number", "prompt"},
      {{{"width", "wide"}}, "'width' must be an integer", "width"},
  };
  for (const Case& c : cases) {
    // With what clients send by default beside (webuiapi's txt2img fields at their defaults).
    Json body = {{"prompt", "x"},
                 {"cfg_scale", 7},
                 {"enable_hr", false},
                 {"styles", Json::array()},
                 {"subseed_strength", 0.0},
                 {"restore_faces", false},
                 {"tiling", false},
                 {"s_churn", 0},
                 {"sampler_name", "Euler"},
                 {"alwayson_scripts", Json::object()},
                 {"override_settings", Json::object()},
                 {"seed_resize_from_h", -1},
                 {"script_name", nullptr}};
    body.update(c.fields);
    const auto r = client().Post("/sdapi/v1/txt2img", body.dump(), "application/json");
    expect_refusal(r, 400, c.message, c.param);
    for (const char* openai : {"\"size\"", "'size'", "\"n\"", "'n'"})
      EXPECT_EQ(r->body.find(openai), std::string::npos) << r->body;
  }
}

// Server-sent events follow a job to its end; /metrics counts what happened; the page is served.
TEST_F(Serve, EventsMetricsAndThePage) {
  const auto submitted = client().Post(
      "/v1/jobs", Json{{"kind", "image"}, {"prompt", "a fox"}, {"size", "64x48"}, {"steps", 2}, {"seed", 5}}.dump(),
      "application/json");
  ASSERT_TRUE(submitted);
  ASSERT_EQ(submitted->status, 202) << submitted->body;
  const std::string id = Json::parse(submitted->body)["id"];
  std::string stream;
  const auto events = client().Get(("/v1/jobs/" + id + "/events").c_str(), [&](const char* data, size_t n) {
    stream.append(data, n);
    return true;
  });
  ASSERT_TRUE(events);
  EXPECT_EQ(events->get_header_value("Content-Type"), "text/event-stream");
  EXPECT_NE(stream.find("event: progress"), std::string::npos) << stream;
  const size_t done = stream.find("event: done\ndata: ");
  ASSERT_NE(done, std::string::npos) << stream;
  const Json last = Json::parse(stream.substr(done + 18, stream.find("\n\n", done) - done - 18));
  EXPECT_EQ(last["state"], "done");
  EXPECT_EQ(last["step"], 2);
  EXPECT_EQ(stream.find("event: preview"), std::string::npos) << "previews are opt-in";

  // Opted in: preview events with the step and a PNG of 1/8 the image's sides (a slow reader gets
  // the latest, so at most one a step).
  const auto with_previews = client().Post(
      "/v1/jobs",
      Json{{"kind", "image"}, {"prompt", "a fox"}, {"size", "64x48"}, {"steps", 3}, {"seed", 5}, {"preview", true}}
          .dump(),
      "application/json");
  ASSERT_TRUE(with_previews);
  ASSERT_EQ(with_previews->status, 202) << with_previews->body;
  std::string previews;
  ASSERT_TRUE(client().Get(("/v1/jobs/" + std::string(Json::parse(with_previews->body)["id"]) + "/events").c_str(),
                           [&](const char* data, size_t n) {
                             previews.append(data, n);
                             return true;
                           }));
  int seen = 0, last_step = 0;
  for (size_t at = previews.find("event: preview\ndata: "); at != std::string::npos;
       at = previews.find("event: preview\ndata: ", at + 1)) {
    const Json p = Json::parse(previews.substr(at + 21, previews.find("\n\n", at) - at - 21));
    EXPECT_GT(p["step"].get<int>(), last_step);
    last_step = p["step"];
    EXPECT_EQ(p["steps"], 3);
    EXPECT_EQ(p["index"], 0);
    const PngImage png = read_png(as_file(unbase64(p["image"]), "preview.png"));
    EXPECT_EQ(png.width, 8);
    EXPECT_EQ(png.height, 6);
    ++seen;
  }
  EXPECT_GE(seen, 1) << previews;
  EXPECT_LE(seen, 3);
  EXPECT_EQ(last_step, 3) << "the last step's preview is always sent";

  const auto m = client().Get("/metrics");
  ASSERT_TRUE(m);
  ASSERT_EQ(m->status, 200);
  for (const char* fragment :
       {"apus_requests_total{route=\"POST /v1/jobs\"}",
        "apus_queue_depth{model=", "apus_stage_seconds_bucket{model=\"klein_tiny_a\",stage=\"dit_step\",le=\"+Inf\"}",
        "apus_request_seconds_count{model=\"klein_tiny_a\"}", "apus_resident_memory_bytes ",
        "apus_jobs_total{model=\"klein_tiny_a\",state=\"done\"}", "apus_build_info{version=\"0."})
    EXPECT_NE(m->body.find(fragment), std::string::npos) << fragment << "\n" << m->body;
  const auto page = client(false).Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->body.find("/v1/jobs"), std::string::npos);
  EXPECT_EQ(page->body.find("http://"), std::string::npos) << "the page makes no external requests";
  EXPECT_EQ(page->body.find("https://"), std::string::npos) << "the page makes no external requests";
}

TEST_F(Serve, TracedJobsServeTheirTimeline) {
  auto submit = [&](const Json& body) {
    const auto r = client().Post("/v1/jobs", body.dump(), "application/json");
    EXPECT_TRUE(r);
    EXPECT_EQ(r->status, 202) << r->body;
    return Json::parse(r->body);
  };
  const Json image = {{"kind", "image"}, {"prompt", "a fox"}, {"size", "32x32"}, {"steps", 1}, {"seed", 5}};
  Json traced_body = image;
  traced_body["trace"] = true;
  const Json traced = submit(traced_body);
  const std::string id = traced["id"];
  EXPECT_EQ(traced["trace"], "/v1/jobs/" + id + "/trace");
  EXPECT_EQ(finished_job(id)["state"], "done");
  const auto timeline = client().Get(("/v1/jobs/" + id + "/trace").c_str());
  ASSERT_TRUE(timeline);
  ASSERT_EQ(timeline->status, 200) << timeline->body;
  const Json doc = Json::parse(timeline->body);
  std::set<std::string> stages;
  size_t ops = 0;
  for (const Json& e : doc["traceEvents"]) {
    if (e.value("cat", "") == "stage") stages.insert(e["name"].get<std::string>());
    ops += e.value("cat", "") == "op";
  }
  EXPECT_EQ(stages, (std::set<std::string>{"text_encoder", "dit_prologue", "dit_step", "vae_decode"}));
  EXPECT_GT(ops, 100u);

  const Json plain = submit(image);
  EXPECT_FALSE(plain.contains("trace"));
  finished_job(plain["id"]);
  expect_refusal(client().Get(("/v1/jobs/" + plain["id"].get<std::string>() + "/trace").c_str()), 404, "was not traced",
                 "trace");
  Json bad = image;
  bad["trace"] = "yes";
  expect_refusal(client().Post("/v1/jobs", bad.dump(), "application/json"), 400, "'trace' must be true or false",
                 "trace");
}

// Load: twice 1,952 requests from 32 concurrent clients, a mix of valid images, malformed bodies, wrong
// fields, listings and jobs cancelled at once; every answer is well formed, the server stays up and
// the heap it holds live after the run is within 5 % of before it (after a warm-up round).
TEST(ServeLoad, MixedRequestsFrom32ClientsLeaveMemoryFlat) {
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}};
  o.port = 0;
  o.queue = 4;
  server::Server srv(o);
  const int port = srv.start();
  // What the heap holds live, over every arena (glibc's malloc_info totals: obtained from the system,
  // less what is free in it, plus what is mapped directly). Resident memory is no measure of a leak
  // here: how many per-thread arenas the first round creates, and so how much freed memory they keep,
  // depends on how the 32 clients' threads interleave (on a loaded CI machine the first round left
  // 14 MiB of arena pages for the second to fill); a leak stays live whatever the interleaving.
  // Under a sanitizer another allocator serves the heap and malloc_info has nothing to say.
  auto heap_in_use = []() -> double {
    if (test::kSanitized) return 0;
    char* text = nullptr;
    size_t length = 0;
    FILE* f = open_memstream(&text, &length);
    malloc_info(0, f);
    std::fclose(f);
    const std::string info(text, length);
    std::free(text);
    // The totals over all arenas follow the last </heap>.
    const std::string totals = info.substr(info.rfind("</heap>"));
    auto field = [&](const std::string& tag) {
      const size_t at = totals.find(tag);
      EXPECT_NE(at, std::string::npos) << tag << " not in malloc_info's totals";
      const size_t size = totals.find("size=\"", at) + 6;
      return std::stod(totals.substr(size, totals.find('"', size) - size));
    };
    return field("<system type=\"current\"") - field("<total type=\"fast\"") - field("<total type=\"rest\"") +
           field("<total type=\"mmap\"");
  };
  const std::string image = Json{{"prompt", "a fox"}, {"size", "64x48"}, {"steps", 1}, {"seed", 3}}.dump();
  const std::string image_job =
      Json{{"kind", "image"}, {"prompt", "a fox"}, {"size", "64x48"}, {"steps", 1}, {"seed", 3}}.dump();
  std::atomic<int> bad{0}, answered{0};
  std::mutex failures_mutex;
  std::vector<std::string> failures;
  auto round = [&](int clients, int per_client) {
    std::vector<std::thread> threads;
    for (int t = 0; t < clients; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < per_client; ++i) {
          httplib::Client c("127.0.0.1", port);  // a connection per request, as most clients open
          c.set_read_timeout(60, 0);
          httplib::Result r = [&]() -> httplib::Result {
            switch ((t * 7 + i) % 6) {
              case 0:
                return c.Post("/v1/images/generations", image, "application/json");
              case 1:
                return c.Post("/v1/images/generations", "{\"prompt\": ", "application/json");
              case 2:
                return c.Post("/v1/images/generations", R"({"prompt": "x", "size": "7x7"})", "application/json");
              case 3:
                return c.Get("/v1/models");
              case 4: {
                auto job = c.Post("/v1/jobs", image_job, "application/json");
                if (!job || job->status != 202) return job;
                const std::string id = Json::parse(job->body)["id"];
                return c.Delete(("/v1/jobs/" + id).c_str());
              }
              default:
                return c.Get("/v1/jobs/job-missing");
            }
          }();
          const bool ok = r && (r->status == 200 || r->status == 400 || r->status == 404 || r->status == 429) &&
                          Json::parse(r->body, nullptr, false).is_object();
          if (!ok) {
            ++bad;
            std::lock_guard<std::mutex> lock(failures_mutex);
            failures.push_back(r ? std::to_string(r->status) + " " + r->body.substr(0, 200)
                                 : "no answer: " + httplib::to_string(r.error()) + " in case " +
                                       std::to_string((t * 7 + i) % 6));
          }
          ++answered;
        }
      });
    for (auto& th : threads) th.join();
  };
  // The first run warms up what is kept on purpose (thread pools, the last 256 finished jobs with
  // their files); the second must leave memory where the first did.
  // Jobs deleted at once may still be finishing their step when the clients are done: the heap is
  // measured with the worker idle (a running job holds its activations, ~64 MiB here).
  auto idle = [&] {
    EXPECT_TRUE(metrics_show(
        port, {"apus_jobs_running{model=\"klein_tiny_a\"} 0", "apus_queue_depth{model=\"klein_tiny_a\"} 0"}))
        << "the worker never went idle";
  };
  round(32, 61);
  idle();
  const double before = heap_in_use();
  round(32, 61);
  idle();
  const double after = heap_in_use();
  EXPECT_EQ(answered.load(), 2 * 32 * 61);
  EXPECT_EQ(bad.load(), 0) << [&] {
    std::string all;
    for (const auto& f : failures) all += f + "\n";
    return all;
  }();
  std::printf("[ measure ] 1952 more requests from 32 clients: heap in use %.2f -> %.2f MiB\n", before / 1048576,
              after / 1048576);
  if (!test::kSanitized) EXPECT_LT(after, before * 1.05);
  httplib::Client c("127.0.0.1", port);
  const auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// The page in headless Chromium (Debian's chromium; skipped with the reason when it is absent): a
// link fills the form and runs it; the DOM after the run has the progress bar full, the status
// done and the result ready (the image drawn by the browser; the clip in an audio element of a
// type it plays), and the console has no error. A screenshot stays in the test's temporary folder.
TEST(ServePage, RunsInHeadlessChromium) {
  if (std::system("command -v chromium > /dev/null 2>&1") != 0) GTEST_SKIP() << "chromium is not installed";
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}, ModelParts{test::official_dir()}};
  o.port = 0;
  // The LoRA rows: the link adds two of the folder's adapters with their scales, in order, and
  // the card names both as the request carried them.
  o.lora_dir = test::scratch_dir.path() + "page_loras";
  std::filesystem::create_directories(o.lora_dir);
  for (const char* file : {"peft.safetensors", "kohya.safetensors"})
    std::filesystem::copy_file(test::fixture(std::string("klein_lora/") + file), o.lora_dir + "/" + file,
                               std::filesystem::copy_options::overwrite_existing);
  server::Server srv(o);
  const std::string base = "http://127.0.0.1:" + std::to_string(srv.start()) + "/";
  const std::string audio_id = AudioModel::open(test::official_dir(), Weights::none)->label();
  const std::string browser =
      "chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage "
      "--user-data-dir=" +
      ::testing::TempDir() + "apus_chromium_" + std::to_string(::getpid()) +
      " --virtual-time-budget=600000 --enable-logging=stderr --v=0 ";
  struct Case {
    std::string query, media, text, preview;
  };
  // Live previews are on by default: the last step's was drawn (the projected image, the
  // waveform on its canvas) and the result replaced it (hidden once done); Cancel shows while the
  // job runs only.
  for (const Case& k :
       {Case{"model=klein_tiny_a&prompt=a%20fox&size=64x48&steps=2&seed=5&lora=peft.safetensors&lora_scale=0.7"
             "&lora=kohya.safetensors&lora_scale=0.5&run=1",
             "<img", "LoRA peft.safetensors:0.7 LoRA kohya.safetensors:0.5",
             "class=\"hidden\" alt=\"preview\" src=\"data:image/png;base64,"},
        Case{"model=" + audio_id + "&prompt=rain&seconds=1.4&seed=3&run=1", "<audio", "(seed 3)",
             "id=\"wave\" class=\"hidden\" width=\"512\" height=\"64\" data-step=\"8\""}}) {
    const std::string dom = ::testing::TempDir() + "apus_page_" + k.media.substr(1) + ".html",
                      log = ::testing::TempDir() + "apus_page_" + k.media.substr(1) + ".log";
    const std::string url = test::shell_quote(base + "?" + k.query);
    ASSERT_EQ(std::system((browser + "--dump-dom " + url + " > " + dom + " 2> " + log).c_str()), 0);
    const std::string html = read_file(dom), console = read_file(log);
    EXPECT_NE(html.find("id=\"status\">done"), std::string::npos) << html;
    EXPECT_NE(html.find("width: 100%"), std::string::npos) << html;
    EXPECT_NE(html.find(k.media), std::string::npos) << html;
    EXPECT_NE(html.find(k.text), std::string::npos) << html;
    EXPECT_NE(html.find(k.preview), std::string::npos) << html;
    EXPECT_NE(html.find("id=\"cancel\" type=\"button\" class=\"hidden\""), std::string::npos) << html;
    EXPECT_NE(html.find("data-ready=\"yes\""), std::string::npos) << "the browser did not decode the result\n" << html;
    EXPECT_EQ(console.find(":ERROR:CONSOLE"), std::string::npos) << console;
    EXPECT_EQ(console.find("Uncaught"), std::string::npos) << console;
  }
  // A reload shows what was made: the gallery from GET /v1/jobs, newest first (the clip, then
  // the image), each card with what made it and its reuse and delete buttons.
  {
    const std::string dom = ::testing::TempDir() + "apus_page_history.html";
    ASSERT_EQ(std::system((browser + "--dump-dom " + test::shell_quote(base) + " > " + dom + " 2>/dev/null").c_str()),
              0);
    const std::string html = read_file(dom);
    const size_t clip = html.find("<audio"), image = html.find("LoRA peft.safetensors:0.7 LoRA kohya.safetensors:0.5");
    EXPECT_NE(clip, std::string::npos) << html;
    EXPECT_NE(image, std::string::npos) << html;
    EXPECT_LT(clip, image) << "newest first\n" << html;
    EXPECT_NE(html.find(">reuse</button>"), std::string::npos) << html;
    EXPECT_NE(html.find(">delete</button>"), std::string::npos) << html;
  }
  const std::string shot = ::testing::TempDir() + "apus_page.png";
  std::system((browser + "--window-size=1100,700 --screenshot=" + shot + " " +
               test::shell_quote(base + "?model=klein_tiny_a&prompt=a%20red%20fox&size=256x256&steps=4&seed=7&lora="
                                        "peft.safetensors&lora_scale=0.7&run=1") +
               " > /dev/null 2>&1")
                  .c_str());
  EXPECT_TRUE(std::filesystem::exists(shot));
  std::printf("[ artifact ] %s\n", shot.c_str());
}

// The page's inputs beyond the prompt, through links headless Chromium runs: a reference image
// with a mask painted on it (the rectangle the link names, as the brush paints: white on black in
// the image's pixels) gives the engine's inpainting of that image and mask; an init clip with its
// noise level, and a clip to inpaint with its regions, give what the audio route gives for the same
// fields, which is not the clip without them.
TEST(ServePage, SendsReferencesMasksAndInitAudio) {
  if (std::system("command -v chromium > /dev/null 2>&1") != 0) GTEST_SKIP() << "chromium is not installed";
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}, ModelParts{test::official_dir()}};
  o.port = 0;
  server::Server srv(o);
  const int port = srv.start();
  const std::string base = "http://127.0.0.1:" + std::to_string(port) + "/";
  const std::string browser =
      "chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir=" + ::testing::TempDir() +
      "apus_chromium_inputs_" + std::to_string(::getpid()) +
      " --virtual-time-budget=600000 --enable-logging=stderr --v=0 --dump-dom ";
  // The result's bytes in the page's DOM after the run.
  auto run = [&](const std::string& query, const std::string& mime) {
    const std::string dom = ::testing::TempDir() + "apus_page_inputs.html";
    // Chromium's --dump-dom once dumped the page before its script had started the run (an empty
    // status, under a whole CI's load, session 36): such a dump is taken again, twice at most, so
    // a page that never starts a run still fails.
    std::string html;
    for (int attempt = 0; attempt < 3; ++attempt) {
      EXPECT_EQ(std::system((browser + test::shell_quote(base + "#" + query) + " > " + dom + " 2>/dev/null").c_str()),
                0);
      html = read_file(dom);
      if (html.find("id=\"status\"></div>") == std::string::npos) break;
    }
    // Virtual time runs while the page waits between polls: the budget (600 s of it) must outlast
    // the job however busy the machine is.
    const size_t status = html.find("id=\"status\">");
    EXPECT_NE(html.find("id=\"status\">done"), std::string::npos)
        << (status == std::string::npos ? html.substr(0, 2000) : html.substr(status, 200));
    const std::string marker = "src=\"data:" + mime + ";base64,";
    const size_t at = html.find(marker, html.find("id=\"gallery\""));  // not the inputs' thumbnails
    if (at == std::string::npos) return std::vector<uint8_t>{};
    const size_t begin = at + marker.size();
    return unbase64(html.substr(begin, html.find('"', begin) - begin));
  };
  auto data_url = [](const std::string& mime, const std::string& file) {
    const std::string bytes = read_file(file);
    return "data:" + mime + ";base64," + server::base64(std::vector<uint8_t>(bytes.begin(), bytes.end()));
  };
  auto url_encoded = [](const std::string& s) {
    std::string out;
    for (const unsigned char c : s) {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", c);
      out += std::isalnum(c) ? std::string(1, char(c)) : std::string(hex);
    }
    return out;
  };

  const std::string image = test::fixture("klein_tiny_a_inpaint/image.png");
  const std::vector<uint8_t> painted =
      run("model=klein_tiny_a&prompt=a%20door&steps=2&seed=3&strength=0.7&mask_rect=10,20,40,30&ref=" +
              url_encoded(data_url("image/png", image)) + "&run=1",
          "image/png");
  ASSERT_FALSE(painted.empty());
  ImageRequest want = engine_request("a door", std::nullopt, std::nullopt, 2, 3);
  const Rgb8Image source = decode_image(read_file(image), "image");
  Rgb8Image mask{source.width, source.height, std::vector<uint8_t>(source.rgb.size(), 0)};
  for (int y = 20; y < 50; ++y)
    for (int x = 10; x < 50; ++x) std::memset(&mask.rgb[3 * size_t(y * source.width + x)], 255, 3);
  want.inpaint = Inpainting{source, mask, 0.7};
  const PngImage png = read_png(as_file(painted, "page_inpaint.png"));
  EXPECT_EQ(png.rgb, ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage)->generate(want).rgb);

  const std::string audio_id = AudioModel::open(test::official_dir(), Weights::none)->label();
  const std::string clip = test::fixture("sa3_tiny/inputs/init.wav");
  const std::vector<uint8_t> page =
      run("model=" + url_encoded(audio_id) + "&prompt=rain&seconds=1.4&seed=3" +
              "&init_noise_level=0.6&init_audio=" + url_encoded(data_url("audio/wav", clip)) + "&run=1",
          "audio/wav");
  ASSERT_FALSE(page.empty());
  httplib::Client c("127.0.0.1", port);
  Json body = {{"model", audio_id}, {"prompt", "rain"}, {"seconds", 1.4}, {"seed", 3}};
  const auto plain = c.Post("/v1/audio/generations", body.dump(), "application/json");
  const std::string bytes = read_file(clip);
  body["init_audio"] = server::base64(std::vector<uint8_t>(bytes.begin(), bytes.end()));
  body["init_noise_level"] = 0.6;
  const auto direct = c.Post("/v1/audio/generations", body.dump(), "application/json");
  ASSERT_TRUE(plain && direct);
  ASSERT_EQ(direct->status, 200) << direct->body;
  EXPECT_EQ(std::string(page.begin(), page.end()), direct->body);
  EXPECT_NE(plain->body, direct->body);
  // Inpainting a clip: its regions as the field's text lists them.
  const std::string long_clip = test::fixture("sa3_tiny/inputs/inpaint.wav");
  const std::vector<uint8_t> repainted =
      run("model=" + url_encoded(audio_id) +
              "&prompt=rain&seconds=1.4&seed=3&inpaint_regions=" + url_encoded("0.2-0.6, 0.9-1.1") +
              "&inpaint_audio=" + url_encoded(data_url("audio/wav", long_clip)) + "&run=1",
          "audio/wav");
  const std::string inpaint_bytes = read_file(long_clip);
  Json inpaint = {{"model", audio_id},
                  {"prompt", "rain"},
                  {"seconds", 1.4},
                  {"seed", 3},
                  {"inpaint_audio", server::base64(std::vector<uint8_t>(inpaint_bytes.begin(), inpaint_bytes.end()))},
                  {"inpaint_regions", Json::array({Json::array({0.2, 0.6}), Json::array({0.9, 1.1})})}};
  const auto inpainted = c.Post("/v1/audio/generations", inpaint.dump(), "application/json");
  ASSERT_TRUE(inpainted);
  ASSERT_EQ(inpainted->status, 200) << inpainted->body;
  EXPECT_EQ(std::string(repainted.begin(), repainted.end()), inpainted->body);
  EXPECT_NE(inpainted->body, plain->body);
}

// A single transformer file served with its parts: listed under its file name, and its images the
// folder's (the BFL file holds the folder's weights under BFL's names).
TEST(ServeSingleFile, TheTransformerFileServesTheFoldersImages) {
  server::ServeOptions o;
  ModelParts parts{test::fixture("klein_single/flux-2-klein-tiny.safetensors")};
  parts.config = test::fixture("klein_tiny_a");
  o.models = {parts};
  o.port = 0;
  server::Server srv(o);
  httplib::Client c("127.0.0.1", srv.start());
  const Json models = Json::parse(c.Get("/v1/models")->body);
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0]["id"], "flux-2-klein-tiny.safetensors");
  const Json body = {{"prompt", "a red fox"}, {"size", "64x48"}, {"steps", 2}, {"seed", 9}};
  const auto r = c.Post("/v1/images/generations", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  ImageRequest want = engine_request("a red fox", 64, 48, 2, 9);
  const PngImage png = read_png(as_file(unbase64(Json::parse(r->body)["data"][0]["b64_json"]), "single_file.png"));
  EXPECT_EQ(png.rgb, ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage)->generate(want).rgb);
}

// LoRAs by name from --lora-dir: applied per request on the resident model (the same image as the
// engine's with those files and scales), dropped for the next; paths and unlisted names refused.
TEST(ServeLoras, RequestsApplyTheFoldersLorasByName) {
  const std::string dir = test::scratch_dir.path() + "loras";
  std::filesystem::create_directories(dir);
  for (const char* name : {"peft.safetensors", "kohya.safetensors"})
    std::filesystem::copy_file(test::fixture(std::string("klein_lora/") + name), dir + "/" + name,
                               std::filesystem::copy_options::overwrite_existing);
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}};
  o.port = 0;
  o.lora_dir = dir;
  server::Server srv(o);
  httplib::Client c("127.0.0.1", srv.start());
  const Json listed = Json::parse(c.Get("/v1/loras")->body);
  ASSERT_EQ(listed["data"].size(), 2u);
  EXPECT_EQ(listed["data"][0]["id"], "kohya.safetensors");
  EXPECT_EQ(listed["data"][1]["id"], "peft.safetensors");
  ImageRequest want = engine_request("a red fox", 64, 48, 2, 9);
  const auto engine = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  const std::vector<uint8_t> plain = engine->generate(want).rgb;
  want.loras = {{dir + "/peft.safetensors", 0.7f}, {dir + "/kohya.safetensors", 0.5f}};
  const std::vector<uint8_t> adapted = engine->generate(want).rgb;
  ASSERT_NE(adapted, plain);
  Json body = {{"prompt", "a red fox"}, {"size", "64x48"}, {"steps", 2}, {"seed", 9}};
  auto served = [&](const Json& b) {
    const auto r = c.Post("/v1/images/generations", b.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
    const std::vector<uint8_t> png = unbase64(Json::parse(r->body)["data"][0]["b64_json"]);
    return read_png(as_file(png, "lora_served.png"));
  };
  Json with = body;
  with["loras"] =
      Json::array({{{"name", "peft.safetensors"}, {"scale", 0.7}}, {{"name", "kohya.safetensors"}, {"scale", 0.5}}});
  const PngImage first = served(with);
  EXPECT_EQ(first.rgb, adapted);
  std::string params;
  for (const auto& [k, v] : first.text)
    if (k == "parameters") params = v;
  EXPECT_NE(params.find("Lora: peft.safetensors:0.7, Lora: kohya.safetensors:0.5"), std::string::npos) << params;
  EXPECT_EQ(served(body).rgb, plain);
  EXPECT_EQ(served(with).rgb, adapted);
  // A1111's routes: the same adapters from the prompt's <lora:NAME:WEIGHT> tags, listed by
  // /sdapi/v1/loras under those names.
  const Json a1111_listed = Json::parse(c.Get("/sdapi/v1/loras")->body);
  ASSERT_EQ(a1111_listed.size(), 2u);
  EXPECT_EQ(a1111_listed[1]["name"], "peft");
  // The tags taken out as A1111 takes them, the text around them left as it is.
  const Json tagged = {
      {"prompt", "<lora:peft:0.7>a red fox<lora:kohya:0.5>"}, {"width", 64}, {"height", 48}, {"steps", 2}, {"seed", 9}};
  const auto r1111 = c.Post("/sdapi/v1/txt2img", tagged.dump(), "application/json");
  ASSERT_TRUE(r1111 && r1111->status == 200) << (r1111 ? r1111->body : "no answer");
  EXPECT_EQ(read_png(as_file(unbase64(Json::parse(r1111->body)["images"][0]), "lora_a1111.png")).rgb, adapted);
  // An adapter for another model (an audio DoRA here) is refused naming the file, never the
  // server's folder.
  std::filesystem::copy_file(test::fixture("sa3_lora/dora.safetensors"), dir + "/dora.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  Json foreign = body;
  foreign["loras"] = Json::array({{{"name", "dora.safetensors"}}});
  const auto wrong = c.Post("/v1/images/generations", foreign.dump(), "application/json");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 400) << wrong->body;
  EXPECT_NE(wrong->body.find("dora.safetensors"), std::string::npos) << wrong->body;
  EXPECT_EQ(wrong->body.find(dir), std::string::npos) << wrong->body;
  std::filesystem::remove(dir + "/dora.safetensors");
  const Json missing = {{"prompt", "a red fox <lora:absent:1>"}, {"width", 64}, {"height", 48}, {"steps", 2}};
  const auto refused = c.Post("/sdapi/v1/txt2img", missing.dump(), "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400) << refused->body;
  EXPECT_NE(refused->body.find("absent.safetensors"), std::string::npos) << refused->body;
  for (const std::string& name :
       {std::string("../peft.safetensors"), dir + "/peft.safetensors", std::string("other.safetensors")}) {
    Json bad = body;
    bad["loras"] = Json::array({{{"name", name}}});
    const auto r = c.Post("/v1/images/generations", bad.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    EXPECT_NE(r->body.find("not one of the server's LoRAs"), std::string::npos) << r->body;
    EXPECT_EQ(Json::parse(r->body)["error"]["param"], "loras") << r->body;
  }
}

// What a server makes is kept: every finished job's files written to --output-dir as they end (the
// bytes the client got), and GET /v1/jobs lists the jobs it holds with their files' urls.
TEST(ServeKept, FilesAreWrittenAndJobsListed) {
  const std::string dir = test::scratch_dir.path() + "serve_outputs/made_by_serve";
  std::filesystem::remove_all(dir);
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}};
  o.port = 0;
  o.output_dir = dir;
  server::Server srv(o);
  httplib::Client c("127.0.0.1", srv.start());
  const Json body = {{"prompt", "a red fox"},   {"size", "64x48"}, {"steps", 2}, {"seed", 9}, {"n", 2},
                     {"response_format", "url"}};
  const auto r = c.Post("/v1/images/generations", body.dump(), "application/json");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
  const std::string url = Json::parse(r->body)["data"][1]["url"];
  const std::string id = url.substr(url.find("/v1/jobs/") + 9, url.find("/files/") - url.find("/v1/jobs/") - 9);
  const auto served = c.Get(url.substr(url.find("/v1/jobs/")).c_str());
  ASSERT_TRUE(served && served->status == 200);
  EXPECT_EQ(read_file(dir + "/" + id + "-1.png"), served->body);
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + id + "-0.png"));
  const Json listed = Json::parse(c.Get("/v1/jobs")->body);
  ASSERT_EQ(listed["data"].size(), 1u) << listed.dump();
  EXPECT_EQ(listed["data"][0]["id"], id);
  EXPECT_EQ(listed["data"][0]["state"], "done");
  EXPECT_EQ(listed["data"][0]["files"][1], "/v1/jobs/" + id + "/files/1");
  EXPECT_FALSE(listed["data"][0].contains("results"));  // files by url, not inline
  // An alias naming no loaded model is refused at start.
  server::ServeOptions unaliased = o;
  unaliased.aliases = {{"gpt-image-1", "klein_elsewhere"}};
  test::expect_error([&] { server::Server refused(unaliased); }, {"--alias gpt-image-1=klein_elsewhere", "no model"});
  // An output folder that cannot be one is refused at start.
  server::ServeOptions bad = o;
  bad.output_dir = dir + "/" + id + "-0.png/x";
  test::expect_error([&] { server::Server refused(bad); }, {"--output-dir", "not a folder"});
}

// The history --output-dir keeps: each done job's record beside its files (the settings it ran
// with), read back by a server started later on the same folder: listed (paged by when each was
// made), its JSON and files served, deleted with its files; a record apus did not write skipped,
// the list's paging arguments checked.
TEST(ServeKept, HistoryOutlivesTheServerIsPagedAndDeletable) {
  const std::string dir = test::scratch_dir.path() + "serve_outputs/history";
  std::filesystem::remove_all(dir);
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}};
  o.port = 0;
  o.output_dir = dir;
  std::vector<std::string> ids;
  std::map<std::string, std::string> bytes;
  {
    server::Server srv(o);
    httplib::Client c("127.0.0.1", srv.start());
    for (int seed : {3, 4}) {
      const Json body = {{"prompt", "a fox " + std::to_string(seed)},
                         {"size", "32x32"},
                         {"steps", 1},
                         {"seed", seed},
                         {"response_format", "url"}};
      const auto r = c.Post("/v1/images/generations", body.dump(), "application/json");
      ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
      const std::string url = Json::parse(r->body)["data"][0]["url"];
      ids.push_back(url.substr(url.find("/v1/jobs/") + 9, url.find("/files/") - url.find("/v1/jobs/") - 9));
      bytes[ids.back()] = c.Get(url.substr(url.find("/v1/jobs/")).c_str())->body;
    }
    // A synchronous A1111 call is kept too, though the server forgets it once answered.
    const auto a =
        c.Post("/sdapi/v1/txt2img",
               Json{{"prompt", "a lighthouse"}, {"width", 32}, {"height", 32}, {"steps", 1}, {"seed", 5}}.dump(),
               "application/json");
    ASSERT_TRUE(a && a->status == 200) << (a ? a->body : "no answer");
  }
  std::ofstream(dir + "/job-spoiled.json") << "{\"id\": \"job-spoiled\"";
  server::Server later(o);
  httplib::Client c("127.0.0.1", later.start());
  const Json all = Json::parse(c.Get("/v1/jobs")->body);
  ASSERT_EQ(all["data"].size(), 3u) << all.dump();
  EXPECT_FALSE(all["has_more"]);
  const std::string a1111 = all["data"][2]["id"];
  for (const Json& j : all["data"]) {
    EXPECT_EQ(j["state"], "done");
    EXPECT_FALSE(j.contains("stored")) << "the folder's bookkeeping stays the server's";
  }
  EXPECT_EQ(all["data"][0]["id"], ids[0]);
  EXPECT_EQ(all["data"][0]["params"], (Json{{"prompt", "a fox 3"}, {"size", "32x32"}, {"steps", 1}, {"seed", 3}}));
  EXPECT_EQ(all["data"][2]["params"]["prompt"], "a lighthouse");
  // Paged, newest first.
  const Json page = Json::parse(c.Get("/v1/jobs?order=desc&limit=2")->body);
  ASSERT_EQ(page["data"].size(), 2u);
  EXPECT_EQ(page["data"][0]["id"], a1111);
  EXPECT_EQ(page["data"][1]["id"], ids[1]);
  EXPECT_TRUE(page["has_more"]);
  EXPECT_EQ(page["last_id"], ids[1]);
  const Json rest = Json::parse(c.Get(("/v1/jobs?order=desc&limit=2&after=" + ids[1]).c_str())->body);
  ASSERT_EQ(rest["data"].size(), 1u);
  EXPECT_EQ(rest["data"][0]["id"], ids[0]);
  EXPECT_FALSE(rest["has_more"]);
  for (const char* bad : {"/v1/jobs?order=sideways", "/v1/jobs?limit=0", "/v1/jobs?limit=x", "/v1/jobs?limit=%zz"})
    EXPECT_EQ(c.Get(bad)->status, 400) << bad;
  EXPECT_EQ(c.Get("/v1/jobs?after=job-nowhere")->status, 404);
  // Each kept job and file as the first server served them.
  EXPECT_EQ(Json::parse(c.Get(("/v1/jobs/" + ids[1]).c_str())->body)["params"]["seed"], 4);
  for (const std::string& id : ids) {
    const auto f = c.Get(("/v1/jobs/" + id + "/files/0").c_str());
    ASSERT_TRUE(f && f->status == 200);
    EXPECT_EQ(f->body, bytes[id]);
    EXPECT_EQ(f->get_header_value("Content-Type"), "image/png");
  }
  EXPECT_EQ(c.Get(("/v1/jobs/" + ids[0] + "/files/1").c_str())->status, 404);
  // Deleted: its record and file leave the folder, and the server forgets it.
  const auto d = c.Delete(("/v1/jobs/" + ids[0]).c_str());
  ASSERT_TRUE(d && d->status == 200);
  EXPECT_EQ(Json::parse(d->body), (Json{{"id", ids[0]}, {"object", "job"}, {"deleted", true}}));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + ids[0] + ".json"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + ids[0] + "-0.png"));
  EXPECT_EQ(c.Get(("/v1/jobs/" + ids[0]).c_str())->status, 404);
  EXPECT_EQ(c.Delete(("/v1/jobs/" + ids[0]).c_str())->status, 404);
  EXPECT_EQ(Json::parse(c.Get("/v1/jobs")->body)["data"].size(), 2u);
}

// GET /v1/loras says which loaded models each file adapts (what the page's pickers offer per
// model): a klein LoRA the klein model, a Stable Audio 3 DoRA the audio model, a file that is no
// LoRA neither; a file changed in place is looked at again.
TEST(ServeLoras, EachFileListsTheModelsItAdapts) {
  const std::string dir = test::scratch_dir.path() + "lora_models";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(test::fixture("klein_lora/peft.safetensors"), dir + "/peft.safetensors");
  std::filesystem::copy_file(test::fixture("sa3_lora/dora.safetensors"), dir + "/dora.safetensors");
  std::filesystem::copy_file(test::fixture("klein_tiny_a/vae/diffusion_pytorch_model.safetensors"),
                             dir + "/vae.safetensors");
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}, ModelParts{test::official_dir()}};
  o.port = 0;
  o.lora_dir = dir;
  server::Server srv(o);
  httplib::Client c("127.0.0.1", srv.start());
  const std::string audio = AudioModel::open(test::official_dir(), Weights::none)->label();
  auto models_of = [&] {
    std::map<std::string, Json> out;
    const Json listed = Json::parse(c.Get("/v1/loras")->body);
    for (const Json& l : listed["data"]) out[l["id"].get<std::string>()] = l["models"];
    return out;
  };
  std::map<std::string, Json> got = models_of();
  EXPECT_EQ(got["peft.safetensors"], Json::array({"klein_tiny_a"}));
  EXPECT_EQ(got["dora.safetensors"], Json::array({audio}));
  EXPECT_EQ(got["vae.safetensors"], Json::array());
  std::filesystem::copy_file(test::fixture("klein_lora/peft.safetensors"), dir + "/dora.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_EQ(models_of()["dora.safetensors"], Json::array({"klein_tiny_a"}));
}

// The audio route takes "loras" as the image routes do: the engine's clip with that file and
// strength (a DoRA here), dropped for the next request; names outside the folder refused.
TEST(ServeLoras, AudioRequestsApplyTheFoldersLorasByName) {
  const std::string dir = test::scratch_dir.path() + "audio_loras";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(test::fixture("sa3_lora/dora.safetensors"), dir + "/dora.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  server::ServeOptions o;
  o.models = {ModelParts{test::official_dir()}};
  o.port = 0;
  o.lora_dir = dir;
  server::Server srv(o);
  httplib::Client c("127.0.0.1", srv.start());
  AudioRequest want;
  want.prompt = "warm lo-fi hip hop";
  want.seconds = 1.4;
  want.seed = 42;
  const auto engine = AudioModel::open(test::official_dir(), Weights::per_stage);
  const std::vector<float> plain = engine->generate(want).samples;
  want.loras = {{dir + "/dora.safetensors", 0.5f}};
  const std::vector<float> adapted = engine->generate(want).samples;
  ASSERT_NE(adapted, plain);
  const Json body = {{"prompt", want.prompt}, {"seconds", 1.4}, {"seed", 42}, {"format", "wav-float"}};
  auto served = [&](const Json& b) {
    const auto r = c.Post("/v1/audio/generations", b.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
    if (!r || r->status != 200) return std::vector<float>{};
    return read_audio(as_file(std::vector<uint8_t>(r->body.begin(), r->body.end()), "lora_clip.wav"),
                      test::kTestClipSeconds)
        .samples;
  };
  Json with = body;
  with["loras"] = Json::array({{{"name", "dora.safetensors"}, {"scale", 0.5}}});
  EXPECT_EQ(served(with), adapted);
  EXPECT_EQ(served(body), plain);
  Json bad = body;
  bad["loras"] = Json::array({{{"name", "../dora.safetensors"}}});
  const auto r = c.Post("/v1/audio/generations", bad.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_EQ(Json::parse(r->body)["error"]["param"], "loras") << r->body;
}

// Cancellation mid-job: DELETE on a running job, and a client that hangs up on a synchronous route
// (its job is cancelled at its next op, freeing the queue).
TEST(ServeCancel, RunningJobsStopWhenDeletedOrAbandoned) {
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}};
  o.port = 0;
  server::Server srv(o);
  const int port = srv.start();
  httplib::Client c("127.0.0.1", port);
  auto eventually = [&](const std::string& line) { return metrics_show(port, {line}); };
  // Long enough (100 steps of ~0.15 s, ~0.5 s under a loaded 2-core CI) that it cannot finish
  // between being seen running and the cancellation's next step: the test holds under load.
  const Json big = {{"prompt", "a fox"}, {"size", "1024x1024"}, {"steps", 100}, {"seed", 1}};
  Json job_body = big;
  job_body["kind"] = "image";
  const auto submitted = c.Post("/v1/jobs", job_body.dump(), "application/json");
  ASSERT_TRUE(submitted);
  const std::string id = Json::parse(submitted->body)["id"];
  ASSERT_TRUE(eventually("apus_jobs_running{model=\"klein_tiny_a\"} 1"));
  ASSERT_TRUE(c.Delete(("/v1/jobs/" + id).c_str()));
  ASSERT_TRUE(eventually("apus_jobs_total{model=\"klein_tiny_a\",state=\"cancelled\"} 1"));
  const Json state = Json::parse(c.Get(("/v1/jobs/" + id).c_str())->body);
  EXPECT_EQ(state["state"], "cancelled");
  EXPECT_LT(state["step"].get<int>(), 100);

  // A raw client that sends the request and hangs up while the job runs.
  const int fd = raw_connection(port);
  const std::string payload = big.dump();
  const std::string request =
      "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(payload.size()) + "\r\n\r\n" + payload;
  ASSERT_EQ(::send(fd, request.data(), request.size(), 0), ssize_t(request.size()));
  ASSERT_TRUE(eventually("apus_jobs_running{model=\"klein_tiny_a\"} 1"));
  ::close(fd);
  EXPECT_TRUE(eventually("apus_jobs_total{model=\"klein_tiny_a\",state=\"cancelled\"} 2"));
  EXPECT_TRUE(eventually("apus_jobs_running{model=\"klein_tiny_a\"} 0"));
}

// Event streams hold no handler thread while they wait: thirty of them open on a queued job while
// another runs (more than the 16 handler threads) once left /health unanswered; now it answers
// at once, and the streams still end with the job.
TEST(ServeLoad, WaitingEventStreamsLeaveTheOtherRoutesAnswering) {
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}};
  o.port = 0;
  server::Server srv(o);
  const int port = srv.start();
  httplib::Client c("127.0.0.1", port);
  const Json big = {{"kind", "image"}, {"prompt", "a fox"}, {"size", "1024x1024"}, {"steps", 100}, {"seed", 1}};
  const auto running = c.Post("/v1/jobs", big.dump(), "application/json");
  ASSERT_TRUE(running);
  const std::string running_id = Json::parse(running->body)["id"];
  Json small = big;
  small["size"] = "64x64";
  small["steps"] = 1;
  const auto queued = c.Post("/v1/jobs", small.dump(), "application/json");
  ASSERT_TRUE(queued);
  const std::string queued_id = Json::parse(queued->body)["id"];
  ASSERT_TRUE(metrics_show(port, {"apus_jobs_running{model=\"klein_tiny_a\"} 1"}));
  std::vector<int> streams;
  for (int i = 0; i < 30; ++i) {
    const int fd = raw_connection(port);
    const std::string request = "GET /v1/jobs/" + queued_id + "/events HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_EQ(::send(fd, request.data(), request.size(), 0), ssize_t(request.size()));
    streams.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // every stream is waiting now
  httplib::Client health("127.0.0.1", port);
  health.set_read_timeout(3, 0);
  const auto t0 = std::chrono::steady_clock::now();
  const auto answer = health.Get("/health");
  ASSERT_TRUE(answer) << "/health did not answer within 3 s with 30 event streams waiting";
  EXPECT_EQ(answer->status, 200);
  std::printf("[ measure ] /health with 30 waiting event streams: %.1f ms\n",
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  ASSERT_TRUE(c.Delete(("/v1/jobs/" + running_id).c_str()));
  // The queued job runs and ends; each stream receives its "done" event and the stream's end.
  for (const int fd : streams) {
    timeval wait{30, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
    std::string got;
    char buf[4096];
    while (got.find("\r\n0\r\n\r\n") == std::string::npos) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      got.append(buf, size_t(n));
    }
    EXPECT_NE(got.find("event: done"), std::string::npos) << got.substr(0, 400);
    ::close(fd);
  }
}

// A request whose floor at this machine's calibrated rate passes --max-request-seconds is refused
// before it is queued (413, naming the estimate), on the OpenAI and jobs routes alike; a small one
// is not, and needs no calibration (it fits the bound even at 1 GFLOP/s).
TEST(ServeLoad, RequestsBeyondTheTimeBoundAreRefusedWithTheirEstimate) {
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}};
  o.port = 0;
  o.max_request_seconds = 0.05;
  server::Server srv(o);
  const int port = srv.start();
  httplib::Client c("127.0.0.1", port);
  const Json big = {{"prompt", "a fox"}, {"size", "1024x1024"}, {"steps", 50}, {"seed", 1}};
  const auto sync = c.Post("/v1/images/generations", big.dump(), "application/json");
  ASSERT_TRUE(sync);
  EXPECT_EQ(sync->status, 413) << sync->body;
  EXPECT_NE(sync->body.find("this request would take at least"), std::string::npos) << sync->body;
  EXPECT_NE(sync->body.find("--max-request-seconds 0"), std::string::npos) << sync->body;
  Json job = big;
  job["kind"] = "image";
  const auto queued = c.Post("/v1/jobs", job.dump(), "application/json");
  ASSERT_TRUE(queued);
  EXPECT_EQ(queued->status, 413) << queued->body;
  const Json small = {{"prompt", "a fox"}, {"size", "64x64"}, {"steps", 1}, {"seed", 1}};
  const auto fine = c.Post("/v1/images/generations", small.dump(), "application/json");
  ASSERT_TRUE(fine);
  EXPECT_EQ(fine->status, 200) << fine->body;
}

// A server destroyed while a job runs: the job is cancelled at its next step and reports its end
// to what outlives it (under ASan, a use of the freed metrics or jobs fails this).
TEST(ServeCancel, AServerDestroyedMidJobStopsIt) {
  auto srv = std::make_unique<server::Server>([] {
    server::ServeOptions o;
    o.models = {ModelParts{test::fixture("klein_tiny_a")}};
    o.port = 0;
    return o;
  }());
  const int port = srv->start();
  httplib::Client c("127.0.0.1", port);
  const Json job = {{"kind", "image"}, {"prompt", "a fox"}, {"size", "1024x1024"}, {"steps", 100}, {"seed", 1}};
  ASSERT_EQ(c.Post("/v1/jobs", job.dump(), "application/json")->status, 202);
  ASSERT_TRUE(metrics_show(port, {"apus_jobs_running{model=\"klein_tiny_a\"} 1"}));
  const auto t0 = std::chrono::steady_clock::now();
  srv.reset();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0) << "the running job was not cancelled: it ran on to its end";
}

// CORS: off unless asked; with --cors ORIGIN, that origin on every answer and the preflight
// answered without a key.
TEST(ServeCors, OnlyTheGivenOrigin) {
  auto r = httplib::Client("127.0.0.1", 1).Get("/");  // nothing listens on port 1
  EXPECT_FALSE(r);
  server::ServeOptions o;
  o.models = {ModelParts{test::fixture("klein_tiny_a")}};
  o.port = 0;
  o.api_key = "k";
  o.cors = "http://localhost:3000";
  server::Server with(o);
  const int port = with.start();
  httplib::Client c("127.0.0.1", port);
  const auto pre = c.Options("/v1/images/generations");
  ASSERT_TRUE(pre);
  EXPECT_EQ(pre->status, 204);
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Origin"), "http://localhost:3000");
  EXPECT_NE(pre->get_header_value("Access-Control-Allow-Headers").find("Authorization"), std::string::npos);
  c.set_bearer_token_auth("k");
  const auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->get_header_value("Access-Control-Allow-Origin"), "http://localhost:3000");
  o.cors.clear();
  server::Server without(o);
  httplib::Client plain("127.0.0.1", without.start());
  plain.set_bearer_token_auth("k");
  const auto no_cors = plain.Get("/v1/models");
  ASSERT_TRUE(no_cors);
  EXPECT_FALSE(no_cors->has_header("Access-Control-Allow-Origin"));
  const auto no_preflight = plain.Options("/v1/models");
  ASSERT_TRUE(no_preflight);
  EXPECT_NE(no_preflight->status, 204);
}

// `apus serve` as a process: SIGTERM lets the running request finish (drain), refuses new ones,
// exits 0; with no drain time the running job is cancelled and the process still exits 0.
struct ServeProcess {
  pid_t pid = 0;
  int port = 0;
  std::string log;
  explicit ServeProcess(const std::string& drain) {
    log = ::testing::TempDir() + "apus_serve_" + std::to_string(::getpid()) + "_" + drain + ".log";
    std::remove(log.c_str());
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const std::string model = test::fixture("klein_tiny_a");
    std::vector<std::string> args = {APUS_CLI, "serve", "--model", model, "--port", "0", "--drain-seconds", drain};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawn(&pid, APUS_CLI, &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    for (int i = 0; i < 600 && port == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::ifstream f(log);
      std::string line;
      while (std::getline(f, line))
        if (line.rfind("serving", 0) == 0) port = std::stoi(line.substr(line.rfind(':') + 1));
    }
  }
  int stop_and_wait() {
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

TEST(ServeProcessTest, SigtermDrainsThenExits) {
  for (const std::string drain : {"60", "0"}) {
    ServeProcess p(drain);
    ASSERT_GT(p.port, 0) << "no port in " << p.log;
    const std::string body = Json{{"prompt", "a fox"}, {"size", "512x512"}, {"steps", 8}, {"seed", 1}}.dump();
    int status = 0;
    std::string answer;
    std::thread request([&] {
      httplib::Client c("127.0.0.1", p.port);
      c.set_read_timeout(120, 0);
      if (const auto r = c.Post("/v1/images/generations", body, "application/json")) {
        status = r->status;
        answer = r->body;
      }
    });
    // Wait until the job runs, then ask the server to stop.
    httplib::Client watch("127.0.0.1", p.port);
    ASSERT_TRUE(metrics_show(p.port, {"apus_jobs_running{model=\"klein_tiny_a\"} 1"}));
    kill(p.pid, SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto late = watch.Post("/v1/images/generations", body, "application/json");
    if (late) EXPECT_EQ(late->status, 503) << late->body;  // or the listener is already closed
    request.join();
    if (drain == "60") {
      EXPECT_EQ(status, 200) << answer;
    } else {
      EXPECT_EQ(status, 499) << answer;
      EXPECT_NE(answer.find("cancelled"), std::string::npos) << answer;
    }
    EXPECT_EQ(p.stop_and_wait(), 0);
    std::ifstream f(p.log);
    const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(log.find("SIGTERM: draining"), std::string::npos) << log;
    EXPECT_NE(log.find("stopped"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace apus
