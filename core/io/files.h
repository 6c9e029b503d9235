#pragma once
// Files that must not fail silently: append-only logs whose every write is checked, atomic
// replacement of small files, and start-up checks that a directory can take a run's files.
//
// Why: a full disk or a read-only mount must stop a run with a message naming the file, at the
// first write that fails (or at start-up when it can be seen then), never leave a half-written
// line behind a run that goes on, and never be found hours in at the first checkpoint.
//
// Test hooks (never for production runs; tests/train_test.sh uses them where a real full disk cannot
// be made in every sandbox):
//   simulate_full_disk(true)      every later AppendFile::append writes the first half of its text
//                                 and then fails with ENOSPC, as a write that fills a disk does
//                                 (dflash_train arms it at DFLASH_FAULT_FULL_DISK_AT_STEP=N)
//   DFLASH_FAULT_FREE_BYTES=N     free_bytes() reports N bytes free on every file system
//   DFLASH_FAULT_FREE_BYTES=N@DIR ... for directories under DIR only
//   DFLASH_FAULT_READONLY=DIR     check_writable_dir() finds directories under DIR read-only (EROFS)
#include <cstdint>
#include <string>
#include <string_view>

namespace dflash::io {

class AppendFile {
 public:
  AppendFile() = default;
  // Opens (creates) `path` for appending; throws naming the path and the system's reason.
  explicit AppendFile(std::string path);
  ~AppendFile();
  AppendFile(AppendFile&& o) noexcept;
  AppendFile& operator=(AppendFile&& o) noexcept;
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  // Writes all of `text` (retrying short writes and EINTR) or throws naming the file and the
  // reason (e.g. "No space left on device"); the text may then be cut anywhere.
  void append(std::string_view text);
  // fsync; throws on failure (a full NFS volume reports here).
  void sync();
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  std::string path_;
};

void simulate_full_disk(bool on);
bool full_disk_simulated();

// Replaces `path` by `text`: writes path.tmp, fsyncs it, renames it over `path` and fsyncs the
// directory, so a crash leaves the old or the new content, never a mix. Throws naming the file.
void write_file_atomic(const std::string& path, std::string_view text);

// Bytes available to an unprivileged writer on the file system holding `dir` (statvfs), or the
// DFLASH_FAULT_FREE_BYTES override.
uint64_t free_bytes(const std::string& dir);

// Makes sure `dir` exists (creating it and its parents), is a directory and takes a file (a probe
// file is written, synced and removed); returns its free bytes. Throws one message naming `what`
// (e.g. "logging.run_dir"), the path and the reason — a file in the way, no permission, a read-only
// file system, a full disk — with a hint.
uint64_t check_writable_dir(const std::string& dir, const std::string& what);

// "1.50 GiB", "12.0 MiB", "512 B".
std::string format_bytes(uint64_t bytes);

}  // namespace dflash::io
