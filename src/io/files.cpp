#include "io/files.h"

#include <cctype>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "core/error.h"

namespace apus {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// What the rename into `path` may replace: nothing, or a regular file (through a symlink too,
// which the rename replaces while stat follows it to what the user meant). A device, FIFO, socket
// or directory there is refused: rename would put a file in place of the node itself.
void check_output_target(const std::string& path) {
  APUS_CHECK(!path.empty(), "an empty output path: expected a file name");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    fail(path, ": is ", kind_of(st.st_mode), ", not a regular file");
}

}  // namespace

int open_regular(const std::string& path, size_t& size) {
  APUS_CHECK(!path.empty(), "an empty file name: expected the path of a file to read");
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  APUS_CHECK(fd >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, ": cannot stat: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": is ", kind_of(st.st_mode), ", expected a regular file");
  }
  size = size_t(st.st_size);
  return fd;
}

MappedFile::~MappedFile() {
  if (mapped && data && size) munmap(const_cast<uint8_t*>(data), size);
}

std::shared_ptr<MappedFile> map_file(const std::string& path) {
  size_t size = 0;
  const int fd = open_regular(path, size);
  auto file = std::make_shared<MappedFile>();
  file->path = path;
  file->size = size;
  if (file->size > 0) {
    void* p = mmap(nullptr, file->size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    APUS_CHECK(p != MAP_FAILED, path, ": mmap failed: ", std::strerror(err));
    file->data = static_cast<const uint8_t*>(p);
  } else {
    ::close(fd);
  }
  return file;
}

size_t extension_at(const std::string& path) {
  const size_t dot = path.rfind('.'), slash = path.rfind('/');
  return dot == std::string::npos || (slash != std::string::npos && dot < slash) ? std::string::npos : dot;
}

std::string extension_of(const std::string& path) {
  const size_t dot = extension_at(path);
  std::string ext = dot == std::string::npos ? "" : path.substr(dot);
  for (char& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
  return ext;
}

std::string read_file(const std::string& path) {
  size_t size = 0;
  const int fd = open_regular(path, size);
  std::string out;
  try {
    out.resize(size);
  } catch (const std::bad_alloc&) {
    ::close(fd);
    fail(path, ": its ", size, " bytes do not fit in this process's memory");
  }
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, out.data() + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      fail(path, ": read failed after ", done, " of ", size,
           " bytes: ", n == 0 ? "unexpected end of file" : std::strerror(err));
    }
    done += size_t(n);
  }
  ::close(fd);
  return out;
}

void check_writable(const std::string& path) {
  AtomicFile probe(path);  // checks the target, is created in the folder and removed uncommitted
}

AtomicFile::AtomicFile(const std::string& path) : path_(path) {
  check_output_target(path);
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  tmp_ = (slash == std::string::npos ? "" : dir) + "." + name + ".XXXXXX";
  const int fd = ::mkstemp(tmp_.data());
  APUS_CHECK(fd >= 0, path, ": cannot create a file in ", dir, ": ", std::strerror(errno));
  ::fchmod(fd, 0644);
  stream_ = ::fdopen(fd, "wb");
  if (!stream_) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp_.c_str());
    fail(path, ": cannot open for writing: ", std::strerror(err));
  }
}

AtomicFile::~AtomicFile() {
  if (stream_) {
    std::fclose(stream_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t bytes) {
  APUS_CHECK(std::fwrite(data, 1, bytes, stream_) == bytes, path_, ": write failed: ", std::strerror(errno));
}

void AtomicFile::resize(uint64_t bytes) {
  APUS_CHECK(std::fflush(stream_) == 0 && ::ftruncate(::fileno(stream_), off_t(bytes)) == 0, path_, ": cannot size to ",
             bytes, " bytes: ", std::strerror(errno));
}

void AtomicFile::commit() {
  FILE* s = stream_;
  stream_ = nullptr;
  const bool ok = std::fflush(s) == 0 && ::fsync(::fileno(s)) == 0;
  const int err = errno;
  const bool closed = std::fclose(s) == 0;
  // Again at the rename: something may have taken the path since the constructor looked.
  try {
    check_output_target(path_);
  } catch (const Error&) {
    ::unlink(tmp_.c_str());
    throw;
  }
  if (!ok || !closed || ::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int e = ok && closed ? errno : err;
    ::unlink(tmp_.c_str());
    fail(path_, ": write failed: ", std::strerror(e));
  }
}

void write_whole_file(const std::string& path, const void* data, size_t bytes) {
  AtomicFile file(path);
  file.write(data, bytes);
  file.commit();
}

}  // namespace apus
