#include "storage/tensorboard.hpp"

#include "engine/common/error.hpp"

#include <sys/stat.h>

#include <array>
#include <chrono>
#include <cstring>

namespace dsrun {

namespace {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one table lookup per byte.
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

// Protobuf wire format: varints, and keys (field number << 3 | wire type).
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void put_key(std::string& out, int field, int wire_type) { put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type)); }

void put_double(std::string& out, int field, double v) {
  put_key(out, field, 1);  // 64-bit
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  put_le(out, bits, 8);
}

void put_float(std::string& out, int field, float v) {
  put_key(out, field, 5);  // 32-bit
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  put_le(out, bits, 4);
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);  // length-delimited
  put_varint(out, bytes.size());
  out += bytes;
}

}  // namespace

uint32_t crc32c(const void* data, size_t bytes) {
  const auto& t = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < bytes; ++i) c = t[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(const void* data, size_t bytes) {
  const uint32_t c = crc32c(data, bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& data) {
  std::string out, length;
  put_le(length, data.size(), 8);
  out += length;
  put_le(out, masked_crc32c(length.data(), length.size()), 4);
  out += data;
  put_le(out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

std::string event_file_version(double wall_time) {
  std::string e;
  put_double(e, 1, wall_time);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);                         // Summary.Value.tag
    put_float(v, 2, static_cast<float>(value));   // Summary.Value.simple_value
    put_bytes(summary, 1, v);                     // Summary.value (repeated)
  }
  std::string e;
  put_double(e, 1, wall_time);
  put_key(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));
  put_bytes(e, 5, summary);
  return e;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, const std::string& host) {
  ::mkdir(dir.c_str(), 0755);
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + (host.empty() ? "dsrun" : host);
  file_ = std::fopen(path_.c_str(), "ab");
  if (!file_) throw Error("cannot create the TensorBoard event file", ErrorContext{path_, 0, 0, "logging.tensorboard", -1, "check permissions, or set logging.tensorboard = false"});
  write(tfrecord(event_file_version(now)));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  if (scalars.empty()) return;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  write(tfrecord(event_scalars(now, step, scalars)));
}

void TensorBoardWriter::write(const std::string& record) {
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() || std::fflush(file_) != 0)
    throw Error("cannot write the TensorBoard event file", ErrorContext{path_, 0, 0, "logging.tensorboard", -1, "check free space"});
}

}  // namespace dsrun
