// TensorBoard event files of a run's scalar metrics: TFRecord framing (length, masked CRC-32C of
// the length, data, masked CRC-32C of the data) around hand-encoded Event/Summary protobufs.
// No TensorFlow or protobuf library: the few fields TensorBoard reads are written directly.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace dsrun {

uint32_t crc32c(const void* data, size_t bytes);
uint32_t masked_crc32c(const void* data, size_t bytes);  // ((crc >> 15) | (crc << 17)) + 0xa282ead8

// One TFRecord: the framing around `data`.
std::string tfrecord(const std::string& data);
// An Event protobuf: wall_time (1, double), step (2, int64) and either file_version (3) or a
// Summary (5) of simple_value scalars.
std::string event_file_version(double wall_time);
std::string event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, double>>& scalars);

// Appends events to DIR/events.out.tfevents.<time>.<host>; each write is flushed, so TensorBoard
// (and a crash) sees whole records.
class TensorBoardWriter {
 public:
  TensorBoardWriter(const std::string& dir, const std::string& host);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  const std::string& path() const { return path_; }

 private:
  void write(const std::string& record);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace dsrun
