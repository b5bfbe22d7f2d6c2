// What a prepare leaves in its output directory: shard file names and the lock it holds while it
// writes. Torch- and tokenizer-free: the token reader (in every rank) checks directories with it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsrun {

// The lock file a prepare holds (flock) in its output directory while it writes there.
constexpr const char* kPrepareLockName = ".dsrun-prepare.lock";
// The pid of a prepare writing to `dir` now (holding its lock); 0 when none is, -1 when one is but
// has not written its pid yet.
int64_t prepare_running_in(const std::string& dir);
// Whether `dir` holds what a prepare writes (its lock file, or shard records): such a directory is
// read only through its manifest.
bool is_prepare_directory(const std::string& dir);
// "shard-<digits>.<tokens|docs|json>": the shard number, else -1; `temporary`: a write_file_atomic
// leftover (".tmp.<pid>" after the name).
int64_t shard_number(const std::string& name, bool* temporary);
// Whether directory `dir`, whose entries are `names` (list_directory's), holds what a prepare writes.
bool holds_prepare_output(const std::string& dir, const std::vector<std::string>& names);

}  // namespace dsrun
