#include "engine/common/files.hpp"

#include "engine/common/error.hpp"
#include "engine/common/text.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <optional>
#include <cstring>
#include <fstream>
#include <sstream>

namespace dsrun {

static Error file_error(const std::string& what, const std::string& path) {
  ErrorContext c;
  c.file = path;
  c.system_errno = errno;  // ENOSPC and EDQUOT are told apart by callers
  return Error(what + ": " + std::strerror(errno), c);
}

namespace {

// Closes a file descriptor when it goes out of scope.
struct FdOwner {
  int fd;
  ~FdOwner() {
    if (fd >= 0) ::close(fd);
  }
};

std::string file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

}  // namespace

// Regular files only, opened without blocking (a FIFO would wait for a writer) and read up to the
// size stat reports, so /dev/zero or a pipe cannot make dsrun read forever. Files that report size
// 0 (those under /proc) and sysfs attributes are read to their end, up to 64 MiB.
std::string read_file(const std::string& path) {
  FdOwner f{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
  if (f.fd < 0) throw file_error("cannot open file", path);
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw file_error("cannot stat file", path);
  if (!S_ISREG(st.st_mode)) {
    ErrorContext c;
    c.file = path;
    c.hint = "give a regular file";
    throw Error("is " + file_kind(st.st_mode) + ", not a regular file", c);
  }
  // sysfs reports every attribute as one page (4096 bytes) whatever it holds: read it to its end.
  struct statfs fs {};
  if (::fstatfs(f.fd, &fs) != 0) throw file_error("cannot stat the file system of", path);
  if (fs.f_type == SYSFS_MAGIC) st.st_size = 0;
  const size_t limit = st.st_size > 0 ? static_cast<size_t>(st.st_size) : size_t{64} << 20;
  std::string out(st.st_size > 0 ? limit : 0, '\0');
  size_t have = 0;
  char chunk[65536];
  while (have < limit) {
    const size_t want = std::min(limit - have, sizeof chunk);
    const ssize_t n = ::read(f.fd, st.st_size > 0 ? out.data() + have : chunk, want);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw file_error("cannot read file", path);
    if (n == 0) break;
    if (st.st_size == 0) out.append(chunk, static_cast<size_t>(n));
    have += static_cast<size_t>(n);
  }
  if (st.st_size > 0 && have != limit) {
    ErrorContext c;
    c.file = path;
    c.hint = "do not change the file while dsrun reads it";
    throw Error("shrank while being read (" + std::to_string(have) + " of " + std::to_string(limit) + " bytes)", c);
  }
  return out;
}

std::vector<std::string> data_directory_files(const std::string& directory, const std::string& only_suffix) {
  std::vector<std::string> files;
  for (const auto& name : list_directory(directory)) {
    const std::string full = path_join(directory, name);
    struct stat st {};
    if (::lstat(full.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || ends_with(name, ".dat")) continue;
    if (!only_suffix.empty() && !ends_with(name, only_suffix)) continue;
    files.push_back(full);
  }
  return files;
}

std::string regular_file_target(const std::string& path, const std::string& key) {
  auto refuse = [&](const std::string& what) {
    ErrorContext c;
    c.file = path;
    c.key = key;
    c.hint = "point " + key + " at regular files (or a directory of them)";
    throw Error(what, c);
  };
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) refuse(std::string("cannot read: ") + std::strerror(errno));
  if (S_ISREG(st.st_mode)) return path;
  if (!S_ISLNK(st.st_mode)) refuse("is " + file_kind(st.st_mode) + ", not a regular file");
  char buffer[4096];
  const ssize_t n = ::readlink(path.c_str(), buffer, sizeof buffer - 1);
  if (n <= 0) refuse(std::string("cannot read the symbolic link: ") + std::strerror(errno));
  std::string target(buffer, static_cast<size_t>(n));
  if (target[0] != '/') target = path_join(parent_directory(path), target);
  struct stat end {};
  if (::lstat(target.c_str(), &end) != 0) refuse("is a symbolic link to " + target + ", which cannot be read: " + std::strerror(errno));
  if (!S_ISREG(end.st_mode)) refuse("is a symbolic link to " + target + ", which is " + file_kind(end.st_mode) + ", not a regular file");
  return target;
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void write_file_atomic(const std::string& path, const std::string& content, mode_t mode) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  ::unlink(tmp.c_str());  // (a leftover of a killed writer would keep its mode)
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) throw file_error("cannot create file", tmp);
  size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n == 0) errno = ENOSPC;  // no progress on a regular file: no room
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      Error e = file_error("cannot write file", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      throw e;
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  std::optional<Error> failed;
  if (!synced) failed = file_error("cannot flush file", tmp);
  if (::close(fd) != 0 && !failed) failed = file_error("cannot flush file", tmp);
  if (failed) {
    ::unlink(tmp.c_str());
    throw *failed;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw file_error("cannot rename into place", path);
  }
  sync_directory(parent_directory(path));  // make the rename itself durable
}

void sync_directory(const std::string& path) {
  int dir = ::open(path.empty() ? "." : path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

namespace {

// Every entry of a directory, hidden ones too; an empty list for a directory already gone.
std::vector<std::string> entries_to_remove(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = opendir(path.c_str());
  if (!d) {
    if (errno == ENOENT) return names;
    throw file_error("cannot list directory", path);
  }
  while (dirent* e = readdir(d))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
  closedir(d);
  return names;
}

}  // namespace

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (!S_ISDIR(st.st_mode)) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw file_error("cannot remove file", path);
    return;
  }
  // Another process may still be creating files here (a peer rank's checkpoint write racing this
  // rank's cleanup of the same step): a directory not yet empty is listed and emptied again.
  for (int attempt = 1;; ++attempt) {
    for (const auto& name : entries_to_remove(path)) remove_tree(path_join(path, name));
    if (::rmdir(path.c_str()) == 0 || errno == ENOENT) return;
    if ((errno != ENOTEMPTY && errno != EEXIST) || attempt == 50) throw file_error("cannot remove directory", path);
    ::usleep(10 * 1000);
  }
}

int64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

void make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  make_directories(parent_directory(path));
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) throw file_error("cannot create directory", path);
}

std::string parent_directory(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string file_stem(const std::string& path) {
  size_t slash = path.find_last_of('/');
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  size_t dot = name.find_last_of('.');
  return dot == std::string::npos || dot == 0 ? name : name.substr(0, dot);
}

std::string path_join(const std::string& a, const std::string& b) {
  if (a.empty() || (!b.empty() && b[0] == '/')) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

std::vector<std::string> list_directory(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = opendir(path.c_str());
  if (!d) throw file_error("cannot list directory", path);
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') names.emplace_back(e->d_name);
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::string templates_directory() {
  if (const char* home = std::getenv("DSRUN_HOME")) return path_join(home, "templates");
  return path_join(DSRUN_SOURCE_DIR, "templates");
}

std::string directory_problem(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode) && ::stat(path.c_str(), &st) != 0) return "is a symbolic link to something that does not exist";
    if (!S_ISDIR(st.st_mode)) return S_ISREG(st.st_mode) ? "is a regular file, not a directory" : "is not a directory";
    if (::access(path.c_str(), W_OK | X_OK) != 0) return "is a directory this user cannot write into (" + std::string(std::strerror(errno)) + ")";
    return "";
  }
  // Not there yet: the nearest existing part of the path decides whether it can be made.
  std::string up = path;
  while (true) {
    const size_t slash = up.find_last_of('/');
    up = slash == std::string::npos ? "." : slash == 0 ? "/" : up.substr(0, slash);
    if (::stat(up.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode)) return "cannot be created: " + up + " is not a directory";
      if (::access(up.c_str(), W_OK | X_OK) != 0) return "cannot be created: " + up + " is not writable (" + std::string(std::strerror(errno)) + ")";
      return "";
    }
    if (up == "/" || up == ".") return "cannot be created";
  }
}

}  // namespace dsrun
