// The safetensors format (Hugging Face): an 8-byte little-endian header length, a JSON header of
// {name: {dtype, shape, data_offsets}} plus "__metadata__", then the tensors' bytes back to back.
// Reading validates the header against the specification; writing is atomic and checksummed. No torch.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace dsrun {

// One tensor of a safetensors file. Offsets are relative to the start of the data section.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // "F32", "BF16", "F16", "F64", "I64", "I32", "U8", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // data_offsets
  int64_t numel() const;
};

// Bytes per element of a safetensors dtype name; 0 for a name the format does not define.
int safetensors_dtype_size(const std::string& dtype);

// Bytes and checksum of a file as written ("xxh3:" and 16 hex digits).
struct WrittenFile {
  uint64_t bytes = 0;
  std::string checksum;
};

// Collects tensors (pointers to the caller's memory, not copies) and writes them in one pass.
class SafetensorsWriter {
 public:
  void add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape, const void* data);
  // A tensor produced at write time into a buffer of its size: one tensor in memory at a time.
  using Fill = std::function<void(char* out)>;
  void add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape, Fill fill);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // Writes PATH.tmp, fsyncs, renames to PATH and fsyncs the directory: PATH is whole or absent.
  WrittenFile write_atomic(const std::string& path) const;

 private:
  struct Pending {
    SafetensorsEntry entry;
    const void* data;
    Fill fill;
  };
  std::vector<Pending> tensors_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_bytes_ = 0;
};

// An open safetensors file: the parsed, validated header. Reads go to the file on demand.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws dsrun::Error naming the file and the fault
  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(const std::string& name) const;  // nullptr when absent
  const SafetensorsEntry& at(const std::string& name) const;    // throws naming the file when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Copies `bytes` bytes starting `offset` bytes into the entry's data.
  void read(const SafetensorsEntry& e, uint64_t offset, uint64_t bytes, void* out) const;
  // The entry as fp32 values (F32, BF16, F16 and F64 are converted), elements [first, first + count).
  std::vector<float> read_f32(const SafetensorsEntry& e, int64_t first, int64_t count) const;
  uint64_t data_start() const { return data_start_; }

 private:
  std::string path_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_start_ = 0;
};

// An FP8 weight [rows, cols] in DeepSeek-V3's release format dequantised to fp32: each 128 x 128
// block (the last ones partial: ceil-divided) times its entry of `scale` ([ceil(rows/128),
// ceil(cols/128)] F32, the weight's "_scale_inv"). Throws naming the tensor when the shapes disagree.
std::vector<float> read_fp8_blockwise(const SafetensorsFile& weight_file, const SafetensorsEntry& weight, const SafetensorsFile& scale_file, const SafetensorsEntry& scale);

// FP8 E4M3 (the "fn" variant: no infinities, 448 the largest) <-> fp32; encoding rounds to nearest
// even and saturates at ±448.
float e4m3_to_float(uint8_t v);
uint8_t float_to_e4m3(float f);

// fp32 <-> bf16 by bits: round to nearest even, NaN kept NaN (what torch's .to(bfloat16) does).
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t h);
float f16_to_float(uint16_t h);

// "xxh3:" + 16 hex digits of the file's XXH3-64 hash; reads the whole file.
std::string checksum_file(const std::string& path);
std::string checksum_bytes(const void* data, size_t bytes);

}  // namespace dsrun
