#include "engine/common/files.hpp"

#include "engine/common/error.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace dsrun {

static Error file_error(const std::string& what, const std::string& path) {
  ErrorContext c;
  c.file = path;
  return Error(what + ": " + std::strerror(errno), c);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw file_error("cannot open file", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void write_file_atomic(const std::string& path, const std::string& content) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw file_error("cannot create file", tmp);
  size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      Error e = file_error("cannot write file", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      throw e;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw file_error("cannot flush file", tmp);
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

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& name : list_directory(path)) remove_tree(path_join(path, name));
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) throw file_error("cannot remove directory", path);
  } else if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    throw file_error("cannot remove file", path);
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

}  // namespace dsrun
