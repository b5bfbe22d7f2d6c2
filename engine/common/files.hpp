// File helpers: whole-file reads, atomic writes (temp file, fsync, rename), and where dsrun's
// shipped templates live. Everything that writes a file the user keeps goes through write_file_atomic.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dsrun {

// Reads a whole regular file (never a device, FIFO or socket: those are errors); throws
// dsrun::Error naming the path when it cannot.
std::string read_file(const std::string& path);
// The files a data directory contributes, in name order: regular files only (no symbolic links,
// subdirectories, or the *.dat indexes the fortunes package keeps beside its text), ending in
// `only_suffix` when it is given. The data loader and the plan read the same list.
std::vector<std::string> data_directory_files(const std::string& directory, const std::string& only_suffix);
// The regular file that `path` names: itself, or the target of one symbolic link, which must be a
// regular file. Anything else is an error naming the path and the recipe `key` it came from.
std::string regular_file_target(const std::string& path, const std::string& key);
bool file_exists(const std::string& path);
bool is_directory(const std::string& path);
// Writes `content` to `path` so that a reader sees either the old file or the new one, never half;
// `mode` 0600 for a file that holds a secret (it never exists with wider permissions).
void write_file_atomic(const std::string& path, const std::string& content, mode_t mode = 0644);
// Why `path` cannot be a directory this user writes into ("" when it can): it exists and is not
// a directory (a regular file, a link to nothing), or it or the nearest part of it that exists is
// not writable. What does not exist yet is fine where it could be created.
std::string directory_problem(const std::string& path);
// Creates a directory and its parents (mkdir -p).
void make_directories(const std::string& path);
// fsync a directory, so that renames and new entries in it survive a power cut.
void sync_directory(const std::string& path);
// Deletes a directory and everything in it (rm -rf); a missing path is not an error.
void remove_tree(const std::string& path);
// Size of a file in bytes; -1 when it does not exist.
int64_t file_size(const std::string& path);
std::string parent_directory(const std::string& path);
std::string file_stem(const std::string& path);   // "recipes/a.toml" -> "a"
std::string path_join(const std::string& a, const std::string& b);
std::vector<std::string> list_directory(const std::string& path);  // sorted names, no dot entries

// The templates/ folder: $DSRUN_HOME/templates, else next to the binary's source tree.
std::string templates_directory();

}  // namespace dsrun
