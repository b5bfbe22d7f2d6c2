#include "engine/checkpoint/safetensors.hpp"

#include "engine/common/error.hpp"
#include "engine/common/file_descriptor.hpp"
#include "engine/common/files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

namespace dsrun {

namespace {

[[noreturn]] void bad_file(const std::string& path, const std::string& what, const std::string& hint = "", int system_errno = 0) {
  ErrorContext c;
  c.file = path;
  c.hint = hint.empty() ? "the file is damaged or not safetensors; use another checkpoint (dsrun resume --fallback) or re-export it" : hint;
  c.system_errno = system_errno;
  throw Error(what, c);
}

// A failed write or fsync: errno travels with the error, so that a full disk can be told apart.
[[noreturn]] void write_failed(const std::string& path, const std::string& what) {
  const int e = errno;
  bad_file(path, what + ": " + std::strerror(e), "check free space and permissions", e);
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path, XXH3_state_t* hash) {
  const char* p = static_cast<const char*>(data);
  if (hash) XXH3_64bits_update(hash, p, bytes);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, std::min<size_t>(bytes, size_t{1} << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = ENOSPC;  // no progress on a regular file: no room
    if (n <= 0) write_failed(path, "cannot write");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void read_at(int fd, uint64_t offset, void* out, uint64_t bytes, const std::string& path) {
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    ssize_t n = ::pread(fd, p, std::min<uint64_t>(bytes, uint64_t{1} << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) bad_file(path, "file ends early (truncated?)");
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<uint64_t>(n);
  }
}

std::string hex64(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return std::string("xxh3:") + buf;
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int safetensors_dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

void SafetensorsWriter::add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape, const void* data) {
  DSRUN_ASSERT(safetensors_dtype_size(dtype) > 0, "known dtype " + dtype);
  DSRUN_ASSERT(name != "__metadata__", "tensor name");
  Pending p{{name, dtype, shape, data_bytes_, 0}, data, nullptr};
  p.entry.end = p.entry.begin + static_cast<uint64_t>(p.entry.numel()) * static_cast<uint64_t>(safetensors_dtype_size(dtype));
  data_bytes_ = p.entry.end;
  tensors_.push_back(std::move(p));
}

void SafetensorsWriter::add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape, Fill fill) {
  add(name, dtype, shape, static_cast<const void*>(nullptr));
  tensors_.back().fill = std::move(fill);
}

WrittenFile SafetensorsWriter::write_atomic(const std::string& path) const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  for (const auto& t : tensors_) header[t.entry.name] = {{"dtype", t.entry.dtype}, {"shape", t.entry.shape}, {"data_offsets", {t.entry.begin, t.entry.end}}};
  std::string text = header.dump();
  // Spaces pad the header so the data starts 8-byte aligned (the format allows trailing whitespace).
  while ((8 + text.size()) % 8 != 0) text += ' ';
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);

  const std::string tmp = path + ".tmp";
  FileDescriptor fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) bad_file(tmp, std::string("cannot create: ") + std::strerror(errno), "check that the directory exists and is writable", errno);
  XXH3_state_t* state = XXH3_createState();
  DSRUN_ASSERT(state != nullptr, "xxhash state");
  XXH3_64bits_reset(state);
  // Whatever fails from here leaves no PATH.tmp behind (a full disk stays as full as it was).
  try {
    write_all(fd.get(), length, 8, tmp, state);
    write_all(fd.get(), text.data(), text.size(), tmp, state);
    std::vector<char> buffer;
    for (const auto& t : tensors_) {
      const void* data = t.data;
      if (t.fill) {
        buffer.assign(t.entry.end - t.entry.begin, 0);
        t.fill(buffer.data());
        data = buffer.data();
      }
      write_all(fd.get(), data, t.entry.end - t.entry.begin, tmp, state);
    }
  } catch (...) {
    XXH3_freeState(state);
    ::unlink(tmp.c_str());
    throw;
  }
  WrittenFile written{8 + text.size() + data_bytes_, hex64(XXH3_64bits_digest(state))};
  XXH3_freeState(state);
  if (::fsync(fd.get()) != 0) {  // NFS and delayed allocation report a full disk here
    const int e = errno;
    ::unlink(tmp.c_str());
    errno = e;
    write_failed(tmp, "fsync failed");
  }
  fd.close();
  if (::rename(tmp.c_str(), path.c_str()) != 0) bad_file(path, std::string("cannot rename into place: ") + std::strerror(errno), "check permissions", errno);
  sync_directory(parent_directory(path));
  return written;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) bad_file(path, std::string("cannot open: ") + std::strerror(errno), "check the path; a checkpoint lists its files in manifest.json");
  struct stat st {};
  ::fstat(fd.get(), &st);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) bad_file(path, "shorter than the 8-byte header length (" + std::to_string(size) + " bytes)");
  unsigned char length[8];
  read_at(fd.get(), 0, length, 8, path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  if (n > size - 8 || n > (uint64_t{100} << 20))
    bad_file(path, "header length " + std::to_string(n) + " does not fit in the file's " + std::to_string(size) + " bytes");
  std::string text(n, '\0');
  read_at(fd.get(), 8, text.data(), n, path);
  if (text.empty() || text[0] != '{') bad_file(path, "header does not start with '{'");
  nlohmann::json header = nlohmann::json::parse(text, nullptr, false);
  if (header.is_discarded() || !header.is_object()) bad_file(path, "header is not a JSON object");
  data_start_ = 8 + n;
  const uint64_t data_bytes = size - data_start_;
  for (auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) bad_file(path, "__metadata__ is not an object");
      for (auto& [k, v] : value.items()) {
        if (!v.is_string()) bad_file(path, "__metadata__." + k + " is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const auto& dtype = value.contains("dtype") ? value["dtype"] : nlohmann::json();
    const auto& shape = value.contains("shape") ? value["shape"] : nlohmann::json();
    const auto& offsets = value.contains("data_offsets") ? value["data_offsets"] : nlohmann::json();
    if (!dtype.is_string() || safetensors_dtype_size(dtype.get<std::string>()) == 0) bad_file(path, "tensor \"" + name + "\": unknown or missing dtype");
    if (!shape.is_array()) bad_file(path, "tensor \"" + name + "\": shape is not an array");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
      bad_file(path, "tensor \"" + name + "\": data_offsets is not [begin, end]");
    SafetensorsEntry e;
    e.name = name;
    e.dtype = dtype.get<std::string>();
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) bad_file(path, "tensor \"" + name + "\": shape has a negative or non-integer size");
      e.shape.push_back(d.get<int64_t>());
    }
    e.begin = offsets[0].get<uint64_t>();
    e.end = offsets[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_bytes) bad_file(path, "tensor \"" + name + "\": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "] outside the " + std::to_string(data_bytes) + " data bytes");
    if (e.end - e.begin != static_cast<uint64_t>(e.numel()) * static_cast<uint64_t>(safetensors_dtype_size(e.dtype)))
      bad_file(path, "tensor \"" + name + "\": " + std::to_string(e.end - e.begin) + " bytes for shape of " + std::to_string(e.numel()) + " " + e.dtype + " elements");
    entries_.push_back(std::move(e));
  }
  // The specification: the data section is covered exactly, without holes or overlaps.
  std::vector<const SafetensorsEntry*> order;
  for (const auto& e : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->begin != b->begin ? a->begin < b->begin : a->end < b->end; });
  uint64_t at = 0;
  for (const auto* e : order) {
    if (e->begin != at) bad_file(path, "tensor \"" + e->name + "\" starts at " + std::to_string(e->begin) + ", expected " + std::to_string(at) + " (hole or overlap)");
    at = e->end;
  }
  if (at != data_bytes) bad_file(path, "tensors cover " + std::to_string(at) + " of " + std::to_string(data_bytes) + " data bytes (truncated or padded file?)");
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

const SafetensorsEntry& SafetensorsFile::at(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (!e) bad_file(path_, "no tensor named \"" + name + "\"");
  return *e;
}

void SafetensorsFile::read(const SafetensorsEntry& e, uint64_t offset, uint64_t bytes, void* out) const {
  DSRUN_ASSERT(offset + bytes <= e.end - e.begin, "read inside the tensor");
  if (bytes == 0) return;
  FileDescriptor fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) bad_file(path_, std::string("cannot open: ") + std::strerror(errno));
  read_at(fd.get(), data_start_ + e.begin + offset, out, bytes, path_);
}

std::vector<float> SafetensorsFile::read_f32(const SafetensorsEntry& e, int64_t first, int64_t count) const {
  DSRUN_ASSERT(first >= 0 && count >= 0 && first + count <= e.numel(), "element range inside the tensor");
  std::vector<float> out(static_cast<size_t>(count));
  const int size = safetensors_dtype_size(e.dtype);
  if (e.dtype == "F32") {
    read(e, static_cast<uint64_t>(first) * 4, static_cast<uint64_t>(count) * 4, out.data());
    return out;
  }
  // E4M3's 256 codes decoded once (DeepSeek-V3's release is 6.7e11 of them), not per element.
  static const std::array<float, 256> e4m3_values = [] {
    std::array<float, 256> values{};
    for (int code = 0; code < 256; ++code) values[static_cast<size_t>(code)] = e4m3_to_float(static_cast<uint8_t>(code));
    return values;
  }();
  std::vector<unsigned char> raw(static_cast<size_t>(count) * static_cast<size_t>(size));
  read(e, static_cast<uint64_t>(first) * static_cast<uint64_t>(size), raw.size(), raw.data());
  for (int64_t i = 0; i < count; ++i) {
    const unsigned char* p = raw.data() + i * size;
    if (e.dtype == "BF16" || e.dtype == "F16") {
      uint16_t h;
      std::memcpy(&h, p, 2);
      out[static_cast<size_t>(i)] = e.dtype == "BF16" ? bf16_to_float(h) : f16_to_float(h);
    } else if (e.dtype == "F64") {
      double d;
      std::memcpy(&d, p, 8);
      out[static_cast<size_t>(i)] = static_cast<float>(d);
    } else if (e.dtype == "F8_E4M3") {  // unscaled: read_fp8_blockwise applies the scales
      out[static_cast<size_t>(i)] = e4m3_values[*p];
    } else {
      bad_file(path_, "tensor \"" + e.name + "\" has dtype " + e.dtype + "; weights must be F32, BF16, F16, F64 or F8_E4M3 with block scales",
               "convert the weights to a floating-point dtype");
    }
  }
  return out;
}

float e4m3_to_float(uint8_t v) {
  const int sign = v >> 7, exponent = (v >> 3) & 0xf, mantissa = v & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) magnitude = std::numeric_limits<float>::quiet_NaN();
  else if (exponent == 0) magnitude = std::ldexp(static_cast<float>(mantissa) / 8.0f, -6);  // subnormal
  else magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return sign ? -magnitude : magnitude;
}

uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::min(std::fabs(f), 448.0f);
  // The nearest of the 127 finite magnitudes (codes 0..0x7e ascend), ties to the even code.
  uint8_t best = 0;
  for (uint8_t code = 1; code <= 0x7e; ++code) {
    const float d = std::fabs(e4m3_to_float(code) - a), best_d = std::fabs(e4m3_to_float(best) - a);
    if (d < best_d || (d == best_d && (code & 1) == 0)) best = code;
  }
  return sign | best;
}

namespace {
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out;
}
}  // namespace

std::vector<float> read_fp8_blockwise(const SafetensorsFile& weight_file, const SafetensorsEntry& weight, const SafetensorsFile& scale_file, const SafetensorsEntry& scale) {
  constexpr int64_t block = 128;
  const auto blocks = [](int64_t n) { return (n + block - 1) / block; };
  if (weight.shape.size() != 2 || scale.shape.size() != 2 || scale.shape[0] != blocks(weight.shape[0]) || scale.shape[1] != blocks(weight.shape[1]) ||
      (scale.dtype != "F32" && scale.dtype != "BF16"))
    bad_file(weight_file.path(),
             "FP8 tensor \"" + weight.name + "\" [" + shape_text(weight.shape) + "] has scales " + scale.name + " " + scale.dtype + " [" + shape_text(scale.shape) +
                 "], not F32 [" + std::to_string(weight.shape.size() == 2 ? blocks(weight.shape[0]) : 0) + ", " +
                 std::to_string(weight.shape.size() == 2 ? blocks(weight.shape[1]) : 0) + "] (one per 128 x 128 block)",
             "use DeepSeek-V3's release format, or convert the weights to bf16 first");
  std::vector<float> values = weight_file.read_f32(weight, 0, weight.numel());
  const std::vector<float> scales = scale_file.read_f32(scale, 0, scale.numel());
  const int64_t rows = weight.shape[0], cols = weight.shape[1], scale_cols = scale.shape[1];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) values[static_cast<size_t>(r * cols + c)] *= scales[static_cast<size_t>((r / block) * scale_cols + c / block)];
  return values;
}

uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  else if (exponent != 0) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  else if (mantissa == 0) bits = sign;  // zero
  else {                                // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string checksum_bytes(const void* data, size_t bytes) { return hex64(XXH3_64bits(data, bytes)); }

std::string checksum_file(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) bad_file(path, std::string("cannot open: ") + std::strerror(errno), "the checkpoint is missing a file; use an earlier one (dsrun resume --fallback)");
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  std::vector<char> buf(size_t{4} << 20);
  while (true) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      XXH3_freeState(state);
      bad_file(path, std::string("cannot read: ") + std::strerror(errno));
    }
    if (n == 0) break;
    XXH3_64bits_update(state, buf.data(), static_cast<size_t>(n));
  }
  std::string out = hex64(XXH3_64bits_digest(state));
  XXH3_freeState(state);
  return out;
}

}  // namespace dsrun
