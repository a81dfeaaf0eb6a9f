// Output images (JPEG and WebP with their parameters in EXIF) round trip below. Input images against what diffusers'
// load_image makes of the same files with PIL (tools/oracle/make_image_fixtures.py): every PNG colour type, baseline /
// progressive / 4:4:4 / greyscale JPEGs and EXIF orientations, lossy / lossless / alpha WebP, byte for byte; Pillow's
// Lanczos resize; and bad files refused naming the file.
#include <libexif/exif-data.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "io/files.h"
#include "io/media/image.h"
#include "io/media/resize.h"
#include "io/weights/safetensors.h"
#include "test_util.h"

namespace apus {
namespace {

TEST(InputImage, DecodesEveryFileAsPilDoes) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("images_ref.safetensors"));
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(test::fixture("images"))) {
    const std::string name = entry.path().filename();
    SCOPED_TRACE(name);
    const Tensor& want = ref.get(name);
    const Rgb8Image got = read_image(entry.path());
    ASSERT_EQ(got.height, want.shape[0]);
    ASSERT_EQ(got.width, want.shape[1]);
    ASSERT_EQ(got.rgb.size(), size_t(want.numel()));
    int64_t differing = 0;
    for (size_t i = 0; i < got.rgb.size(); ++i) differing += got.rgb[i] != want.ptr<uint8_t>()[i];
    EXPECT_EQ(differing, 0) << "bytes differ from PIL's";
    ++files;
  }
  EXPECT_EQ(files, 17);
}

// References over 1024x1024 pixels as Flux2ImageProcessor._resize_to_target_area resizes them:
// the area scaled to 1 Mi pixels (truncated sides), PIL's Lanczos filter, byte for byte.
TEST(InputImage, LanczosResizeIsPillows) {
  for (const char* name : {"photo_1100x1000", "photo_2400x1600"}) {
    SCOPED_TRACE(name);
    const Rgb8Image src = read_image(test::fixture(std::string("resize/") + name + ".png"));
    const Rgb8Image want = read_image(test::fixture(std::string("resize/") + name + "_pil_lanczos.png"));
    const double scale = std::sqrt(1048576.0 / (double(src.width) * double(src.height)));
    const Rgb8Image got = resize_lanczos(src, int(src.width * scale), int(src.height * scale));
    ASSERT_EQ(got.width, want.width);
    ASSERT_EQ(got.height, want.height);
    int64_t differing = 0;
    for (size_t i = 0; i < got.rgb.size(); ++i) differing += got.rgb[i] != want.rgb[i];
    EXPECT_EQ(differing, 0) << "of " << got.rgb.size() << " bytes differ from Pillow's";
  }
}

// A1111's Nearest upscaler: Pillow's NEAREST resize, byte for byte, up, down and to sides that
// are no multiple of the source's (tools/oracle/make_image_fixtures.py).
TEST(InputImage, NearestResizeIsPillows) {
  const Rgb8Image src = read_image(test::fixture("resize/small_45x31.png"));
  for (const auto& [w, h] : {std::pair{90, 62}, {101, 67}, {20, 13}, {45, 80}}) {
    SCOPED_TRACE(std::to_string(w) + "x" + std::to_string(h));
    const Rgb8Image want =
        read_image(test::fixture("resize/small_45x31_nearest_" + std::to_string(w) + "x" + std::to_string(h) + ".png"));
    const Rgb8Image got = resize_nearest(src, w, h);
    ASSERT_EQ(got.width, want.width);
    ASSERT_EQ(got.height, want.height);
    int64_t differing = 0;
    for (size_t i = 0; i < got.rgb.size(); ++i) differing += got.rgb[i] != want.rgb[i];
    EXPECT_EQ(differing, 0) << "of " << got.rgb.size() << " bytes differ from Pillow's";
  }
}

TEST(InputImage, BadFilesAreRefusedNamingThem) {
  const std::string dir = ::testing::TempDir();
  auto file = [&](const std::string& name, const std::string& bytes) {
    const std::string path = dir + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  };
  const std::string jpeg = read_file(test::fixture("images/baseline.jpg")),
                    png = read_file(test::fixture("images/rgb.png")),
                    webp = read_file(test::fixture("images/lossy.webp"));
  const struct {
    std::string path, expect;
  } cases[] = {
      {file("text.png", "hello, not an image"), "not a PNG, JPEG or WebP image"},
      {file("empty.jpg", ""), "not a PNG, JPEG or WebP image"},
      {file("cut.jpg", jpeg.substr(0, jpeg.size() / 2)), "corrupt or truncated JPEG data"},
      {file("cut.png", png.substr(0, png.size() / 2)), "truncated"},
      {file("header.jpg", jpeg.substr(0, 40)), "JPEG datastream contains no image"},
      {file("cut.webp", webp.substr(0, webp.size() / 2)), "corrupt or truncated WebP data"},
      {file("riff.webp", std::string("RIFF\x10\0\0\0WEBPVP8 junk", 20)), "not a readable WebP image"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.path);
    test::expect_error([&] { read_image(c.path); }, {c.path, c.expect});
  }
}

// zlib's CRC-32, for a PNG chunk patched by a test.
uint32_t crc32_of(const std::string& bytes) {
  uint32_t crc = 0xffffffffu;
  for (const char ch : bytes) {
    crc ^= uint8_t(ch);
    for (int k = 0; k < 8; ++k) crc = crc & 1 ? (crc >> 1) ^ 0xedb88320u : crc >> 1;
  }
  return ~crc;
}

void put_be32(std::string& bytes, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) bytes[at + size_t(i)] = char(uint8_t(v >> (24 - 8 * i)));
}

// The header alone gives what decoding gives: the size, upright (EXIF orientations 6 and 8 swap
// the sides), and the same refusals where the header shows them.
TEST(InputImage, AProbeReadsTheHeaderAsTheDecoderDoes) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(test::fixture("images"))) {
    const std::string name = entry.path().filename();
    SCOPED_TRACE(name);
    const std::string bytes = read_file(entry.path());
    const ImageSize header = probe_image(bytes, name);
    const Rgb8Image image = decode_image(bytes, name);
    EXPECT_EQ(header.width, image.width);
    EXPECT_EQ(header.height, image.height);
    ++files;
  }
  EXPECT_EQ(files, 17);
  const Rgb8Image turned = read_image(test::fixture("images/orientation6.jpg"));
  ASSERT_NE(turned.width, turned.height) << "the swap would not show";

  // A PNG whose IHDR (CRC fixed) claims 100000 x 100000 pixels, and a JPEG whose SOF0 claims
  // 60000 x 60000: refused by both before any pixel.
  std::string png = read_file(test::fixture("images/rgb.png"));
  put_be32(png, 16, 100000);
  put_be32(png, 20, 100000);
  put_be32(png, 29, crc32_of(png.substr(12, 17)));
  std::string jpeg = read_file(test::fixture("images/baseline.jpg"));
  const size_t sof = jpeg.find("\xff\xc0");
  ASSERT_NE(sof, std::string::npos);
  for (const size_t at : {sof + 5, sof + 7}) jpeg.replace(at, 2, "\xea\x60");
  for (const auto& file : {std::pair{png, "huge.png"}, std::pair{jpeg, "huge.jpg"}}) {
    test::expect_error([&] { probe_image(file.first, file.second); }, {file.second, "pixels, over the 67108864"});
    test::expect_error([&] { decode_image(file.first, file.second); }, {file.second, "pixels, over the 67108864"});
  }
  test::expect_error([] { probe_image("hello, not an image", "text"); }, {"text", "not a PNG, JPEG or WebP image"});
  test::expect_error([] { probe_image(std::string("RIFF\x10\0\0\0WEBPVP8 junk", 20), "riff"); },
                     {"riff", "not a readable WebP image"});
  // Header only: a PNG cut where its pixel data begins probes, and decoding it finds them missing.
  const std::string whole = read_file(test::fixture("images/rgb.png"));
  const size_t idat = whole.find("IDAT");
  ASSERT_NE(idat, std::string::npos);
  const std::string cut = whole.substr(0, idat + 4);
  const Rgb8Image rgb = read_image(test::fixture("images/rgb.png"));
  EXPECT_EQ(probe_image(cut, "cut.png").width, rgb.width);
  test::expect_error([&] { decode_image(cut, "cut.png"); }, {"cut.png", "truncated"});
}

}  // namespace
}  // namespace apus

namespace apus {
namespace {

// The UserComment text of an image's EXIF (JPEG APP1 or WebP EXIF chunk, found by its "Exif\0\0"
// or TIFF header), decoded from "UNICODE" UTF-16BE as piexif's helper decodes it; "" when absent.
std::string user_comment(const std::vector<uint8_t>& file) {
  static const uint8_t tiff[] = {'I', 'I', 0x2a, 0};
  const auto at = std::search(file.begin(), file.end(), std::begin(tiff), std::end(tiff));
  if (at == file.end()) return "";
  std::vector<uint8_t> exif = {'E', 'x', 'i', 'f', 0, 0};
  exif.insert(exif.end(), at, file.end());
  ExifData* data = exif_data_new_from_data(exif.data(), unsigned(exif.size()));
  if (!data) return "";
  std::string text;
  if (ExifEntry* e = exif_content_get_entry(data->ifd[EXIF_IFD_EXIF], EXIF_TAG_USER_COMMENT)) {
    if (e->size >= 8 && std::memcmp(e->data, "UNICODE\0", 8) == 0)
      for (unsigned i = 8; i + 1 < e->size; i += 2) {
        const uint32_t u = uint32_t(e->data[i]) << 8 | e->data[i + 1];
        if (u < 0x80) text += char(u);
        else text += '?';  // the test's text is ASCII past the first check
      }
  }
  exif_data_unref(data);
  return text;
}

// JPEG and WebP outputs: the pixels back through the decoders within the codec's loss (WebP at 100
// exactly), the parameters in EXIF's UserComment as A1111 writes them; the format by extension.
TEST(OutputImage, JpegAndWebpCarryTheParametersWhereA1111ReadsThem) {
  const uint32_t seed = test::test_seed();
  std::mt19937 rng(seed);
  Rgb8Image image{40, 24, std::vector<uint8_t>(40 * 24 * 3)};
  // Smooth in every channel, each its own gradient (a swapped channel or a row offset is far off),
  // so the lossy codecs stay within a few levels.
  const double phase = double(rng() % 1000) / 100.0;
  for (int y = 0; y < image.height; ++y)
    for (int x = 0; x < image.width; ++x)
      for (int c = 0; c < 3; ++c)
        image.rgb[size_t((y * image.width + x) * 3 + c)] =
            uint8_t(128 + 100 * std::sin(phase + 0.09 * x * (c + 1) + 0.07 * y * (3 - c)));
  const std::vector<std::pair<std::string, std::string>> meta = {{"parameters", "a fox\nSteps: 4, Seed: 3"}};
  struct Case {
    ImageFormat format;
    int quality;
    double max_mean_diff;
  };
  for (const Case& c :
       {Case{ImageFormat::jpeg, 95, 3.0}, Case{ImageFormat::webp, 90, 4.0}, Case{ImageFormat::webp, 100, 0.0}}) {
    const std::vector<uint8_t> bytes = encode_image(c.format, image, c.quality, meta, "out");
    const Rgb8Image back = decode_image(std::string(bytes.begin(), bytes.end()), "out");
    ASSERT_EQ(back.width, image.width);
    ASSERT_EQ(back.height, image.height);
    double diff = 0;
    for (size_t i = 0; i < image.rgb.size(); ++i) diff += std::abs(int(back.rgb[i]) - int(image.rgb[i]));
    diff /= double(image.rgb.size());
    EXPECT_LE(diff, c.max_mean_diff) << image_mime_type(c.format) << " quality " << c.quality;
    EXPECT_EQ(user_comment(bytes), "a fox\nSteps: 4, Seed: 3") << image_mime_type(c.format);
  }
  EXPECT_EQ(user_comment(encode_image(ImageFormat::jpeg, image, 80, {}, "out")), "");
  EXPECT_EQ(image_format_of_file("a/b.JPG", "-o"), ImageFormat::jpeg);
  EXPECT_EQ(image_format_of_file("b.webp", "-o"), ImageFormat::webp);
  EXPECT_EQ(image_format_of_file("b.png", "-o"), ImageFormat::png);
  test::expect_error([] { image_format_of_file("a.b/out", "-o"); }, {"-o a.b/out: apus writes images as .png"});
  test::expect_error([] { image_format_of_file("out.gif", "-o"); }, {"out.gif"});
  test::expect_error([] { image_format_named("bmp", "output_format"); }, {"output_format", "'bmp'"});
  test::expect_error([&] { encode_jpeg(image, 0, "", "out"); }, {"quality 0 outside 1..100"});
}

}  // namespace
}  // namespace apus
