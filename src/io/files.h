#pragma once
// Files the engine reads and writes, with the guarantees a long-lived process needs: inputs must
// be regular files (a FIFO or device in place of a weight file must not block or be mapped) and
// outputs appear whole or not at all.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace apus {

// Opens a regular file read-only without blocking on FIFOs; refuses directories, FIFOs, sockets
// and devices naming the path. Returns the descriptor and sets `size`.
int open_regular(const std::string& path, size_t& size);
// File bytes: an mmap of a weight file, or a caller's buffer (mapped = false) for the fuzzer.
struct MappedFile {
  std::string path;
  const uint8_t* data = nullptr;
  size_t size = 0;
  bool mapped = true;
  ~MappedFile();
};
// A regular file mapped read-only (open_regular's checks first).
std::shared_ptr<MappedFile> map_file(const std::string& path);

// A whole regular file's bytes.
std::string read_file(const std::string& path);

// Where a path's extension starts (its last '.' past the last '/'), or npos when it has none.
size_t extension_at(const std::string& path);
// The extension, dot included, lower-cased ("" when none): what the writers read a format from.
std::string extension_of(const std::string& path);

// Refuses, before any work, an output path that cannot be written: empty, a missing or read-only
// folder, or anything but a regular file in the file's place (a directory, device, FIFO or
// socket, which the atomic rename would replace), naming the path and what it is.
void check_writable(const std::string& path);

// Writes `path` through a temporary file in the same folder that is flushed, fsync'd and renamed
// over `path` by commit(): a reader never sees a partial file, two writers never interleave, and
// a failed or interrupted write leaves no file behind (the destructor removes the temporary). The
// target is checked as check_writable checks it, at construction and again before the rename.
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  FILE* stream() { return stream_; }
  void write(const void* data, size_t bytes);
  // Sets the file's size (a sparse tail reads as zeros).
  void resize(uint64_t bytes);
  void commit();

 private:
  std::string path_, tmp_;
  FILE* stream_ = nullptr;
};

// `bytes` bytes at `data` as the whole of `path`, through an AtomicFile.
void write_whole_file(const std::string& path, const void* data, size_t bytes);

}  // namespace apus
