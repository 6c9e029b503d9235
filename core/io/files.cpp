#include "core/io/files.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "core/error.h"

namespace fs = std::filesystem;

namespace dflash::io {

namespace {

std::atomic<bool> g_full_disk{false};

std::string reason(int e) { return e ? std::strerror(e) : "unknown error"; }

std::string hint_for(int e, const std::string& dir) {
  if (e == ENOSPC || e == EDQUOT) return "the file system holding " + dir + " is full: free space there or choose another directory";
  if (e == EROFS) return dir + " is on a read-only file system: choose a writable directory";
  if (e == EACCES || e == EPERM) return "this user may not write to " + dir + ": fix its permissions or choose another directory";
  return "check that " + dir + " is a writable directory with free space";
}

// Writes all of [p, p + n) to fd; returns 0 or the errno of the failure.
int write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return EIO;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return 0;
}

// write_all, then fsync (EINVAL: a file system without fsync, e.g. a pipe); 0 or the errno.
int write_and_sync(int fd, std::string_view text) {
  int e = write_all(fd, text.data(), text.size());
  if (!e && ::fsync(fd) != 0 && errno != EINVAL) e = errno;
  return e;
}

// Whether `dir` is `root` or below it, comparing whole path components of the canonical paths
// (the test hooks' DIR; "/a/small" does not contain "/a/smaller").
bool is_under(const std::string& dir, const std::string& root) {
  std::error_code ec;
  const fs::path d = fs::weakly_canonical(fs::absolute(dir, ec), ec), r = fs::weakly_canonical(fs::absolute(root, ec), ec);
  auto di = d.begin();
  for (auto ri = r.begin(); ri != r.end(); ++ri, ++di) {
    if (ri->empty()) continue;  // a trailing separator
    if (di == d.end() || *di != *ri) return false;
  }
  return true;
}

std::string parent_of(const std::string& path) {
  const fs::path p = fs::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

}  // namespace

void simulate_full_disk(bool on) { g_full_disk.store(on, std::memory_order_relaxed); }
bool full_disk_simulated() { return g_full_disk.load(std::memory_order_relaxed); }

AppendFile::AppendFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int e = errno;
    DFLASH_REJECT_HINT("opening '" << path_ << "' for writing failed: " << reason(e), hint_for(e, parent_of(path_)));
  }
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

AppendFile::AppendFile(AppendFile&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}

AppendFile& AppendFile::operator=(AppendFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
  }
  return *this;
}

void AppendFile::append(std::string_view text) {
  DFLASH_CHECK(fd_ >= 0, "writing '" << path_ << "': the file is not open");
  int e = 0;
  if (full_disk_simulated()) {
    write_all(fd_, text.data(), text.size() / 2);  // what a disk that fills mid-write keeps
    e = ENOSPC;
  } else {
    e = write_all(fd_, text.data(), text.size());
  }
  if (e) DFLASH_REJECT_HINT("writing '" << path_ << "' failed: " << reason(e), hint_for(e, parent_of(path_)));
}

void AppendFile::sync() {
  if (fd_ < 0) return;
  if (::fsync(fd_) != 0 && errno != EINVAL && errno != EROFS) {
    const int e = errno;
    DFLASH_REJECT_HINT("syncing '" << path_ << "' to disk failed: " << reason(e), hint_for(e, parent_of(path_)));
  }
}

void write_file_atomic(const std::string& path, std::string_view text) {
  const std::string tmp = path + ".tmp";
  {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      const int e = errno;
      DFLASH_REJECT_HINT("creating '" << tmp << "' failed: " << reason(e), hint_for(e, parent_of(path)));
    }
    const int e = write_and_sync(fd, text);
    ::close(fd);
    if (e) {
      std::remove(tmp.c_str());
      DFLASH_REJECT_HINT("writing '" << tmp << "' failed: " << reason(e), hint_for(e, parent_of(path)));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    DFLASH_REJECT_HINT("renaming '" << tmp << "' to '" << path << "' failed: " << reason(e), hint_for(e, parent_of(path)));
  }
  const int dfd = ::open(parent_of(path).c_str(), O_RDONLY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

uint64_t free_bytes(const std::string& dir) {
  if (const char* f = std::getenv("DFLASH_FAULT_FREE_BYTES")) {  // "N" or "N@DIR": only under DIR
    const std::string spec = f;
    const size_t at = spec.find('@');
    if (at == std::string::npos || is_under(dir, spec.substr(at + 1))) return std::strtoull(spec.c_str(), nullptr, 10);
  }
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return UINT64_MAX;  // unknown: the probe write decides
  return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
}

uint64_t check_writable_dir(const std::string& dir, const std::string& what) {
  std::error_code ec;
  // The nearest ancestor that exists tells why a directory cannot be made.
  fs::path existing = fs::absolute(fs::path(dir), ec);
  while (!existing.empty() && !fs::exists(existing, ec) && existing.has_parent_path() && existing != existing.parent_path())
    existing = existing.parent_path();
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    DFLASH_REJECT_HINT(what << " '" << dir << "' is a file, not a directory",
                     "point " << what << " at a directory (it is created when missing), or move the file away");
  if (!fs::is_directory(existing, ec))
    DFLASH_REJECT_HINT(what << " '" << dir << "' cannot be created: '" << existing.string() << "' is a file, not a directory",
                     "point " << what << " at a path under a directory");
  fs::create_directories(dir, ec);
  if (ec) {
    const int e = ec.value();
    DFLASH_REJECT_HINT(what << " '" << dir << "' cannot be created: " << ec.message(), hint_for(e, existing.string()));
  }
  // A probe file: permissions, read-only mounts and full disks all show here.
  // (pid and time: ranks of several nodes may probe one shared directory at once)
  const std::string probe = (fs::path(dir) / (".dflash-write-test-" + std::to_string(::getpid()) + "-" +
                                              std::to_string(std::chrono::steady_clock::now().time_since_epoch().count())))
                                .string();
  int e = 0;
  const char* ro = std::getenv("DFLASH_FAULT_READONLY");  // test hook: a read-only file system under this path
  if (ro && *ro && is_under(dir, ro)) {
    e = EROFS;
  } else if (const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644); fd < 0) {
    e = errno;
  } else {
    e = write_and_sync(fd, "dflash\n");
    ::close(fd);
    std::remove(probe.c_str());
  }
  if (e) DFLASH_REJECT_HINT(what << " '" << dir << "' is not writable: " << reason(e), hint_for(e, dir));
  return free_bytes(dir);
}

std::string format_bytes(uint64_t bytes) {
  char buf[48];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  return buf;
}

}  // namespace dflash::io
