#include "engine/data/dataset.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"

#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>
#include <numeric>
#include <random>

namespace dsrun {

namespace {

// The order of samples in epoch e: a permutation of 0..n-1 seeded by (seed, e).
class EpochOrder {
 public:
  EpochOrder(int64_t n, uint64_t seed, bool shuffle) : n_(n), seed_(seed), shuffle_(shuffle) { DSRUN_ASSERT(n > 0, "an epoch of no samples"); }
  int64_t at(int64_t g) {
    const int64_t epoch = g / n_, i = g % n_;
    if (!shuffle_) return i;
    if (epoch != epoch_) {
      order_.resize(static_cast<size_t>(n_));
      std::iota(order_.begin(), order_.end(), 0);
      std::mt19937_64 rng(seed_ * 1000003ULL + static_cast<uint64_t>(epoch));
      for (int64_t k = n_ - 1; k > 0; --k) std::swap(order_[k], order_[rng() % static_cast<uint64_t>(k + 1)]);  // Fisher-Yates
      epoch_ = epoch;
    }
    return order_[static_cast<size_t>(i)];
  }

 private:
  int64_t n_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;
};

// Decoder data: a token stream cut into non-overlapping windows of seq_len + 1 tokens.
class TokenWindows final : public Dataset {
 public:
  TokenWindows(std::vector<int64_t> tokens, double val_fraction, int64_t seq_len, uint64_t seed, bool shuffle, std::string what)
      : seq_(seq_len), what_(std::move(what)) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t val_tokens = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
    train_ = torch::from_blob(tokens.data(), {n - val_tokens}, torch::kInt64).clone();
    val_ = torch::from_blob(tokens.data() + (n - val_tokens), {val_tokens}, torch::kInt64).clone();
    train_windows_ = (train_.numel() - 1) / seq_;
    val_windows_ = val_.numel() > seq_ ? (val_.numel() - 1) / seq_ : 0;
    if (train_windows_ < 1) {
      ErrorContext c;
      c.key = "data.path";
      c.hint = "use more data or a shorter batch.seq_len";
      throw Error(what_ + " has " + std::to_string(n) + " tokens: not one training sequence of " + std::to_string(seq_ + 1), c);
    }
    order_ = std::make_unique<EpochOrder>(train_windows_, seed, shuffle);
  }
  Batch train_batch(int64_t first, int64_t count) override {
    std::vector<int64_t> windows;
    for (int64_t i = 0; i < count; ++i) windows.push_back(order_->at(first + i));
    return cut(train_, windows);
  }
  Batch val_batch(int64_t first, int64_t count) override {
    if (val_windows_ == 0) {
      ErrorContext c;
      c.key = "data.val_fraction";
      c.hint = "raise data.val_fraction or use more data, or set eval.every = 0";
      throw Error("the validation split has " + std::to_string(val_.numel()) + " tokens: not one sequence of " + std::to_string(seq_ + 1), c);
    }
    std::vector<int64_t> windows;
    for (int64_t i = 0; i < count; ++i) windows.push_back((first + i) % val_windows_);
    return cut(val_, windows);
  }
  std::string describe() const override {
    return what_ + ": " + std::to_string(train_.numel()) + " training tokens (" + std::to_string(train_windows_) + " sequences), " +
           std::to_string(val_.numel()) + " validation tokens";
  }

 private:
  Batch cut(const torch::Tensor& stream, const std::vector<int64_t>& windows) const {
    std::vector<torch::Tensor> rows;
    for (int64_t w : windows) rows.push_back(stream.narrow(0, w * seq_, seq_ + 1));
    torch::Tensor both = torch::stack(rows);
    Batch b;
    b.inputs = both.narrow(1, 0, seq_).contiguous();
    b.targets = both.narrow(1, 1, seq_).contiguous();
    b.items = static_cast<int64_t>(windows.size()) * seq_;
    return b;
  }
  torch::Tensor train_, val_;
  int64_t seq_, train_windows_ = 0, val_windows_ = 0;
  std::string what_;
  std::unique_ptr<EpochOrder> order_;
};

// A permutation of 0..n-1 for epoch e computed per index, in O(1) memory: a 4-round Feistel
// network over the next even power of two, walked until it lands below n (under 4 steps on
// average). Prepared corpora use it, so a rank's memory does not grow with the corpus.
class FeistelOrder {
 public:
  FeistelOrder(int64_t n, uint64_t seed, bool shuffle) : n_(n), seed_(seed), shuffle_(shuffle) {
    DSRUN_ASSERT(n > 0, "an epoch of no samples");
    while ((int64_t(1) << (2 * half_bits_)) < n) ++half_bits_;
  }
  int64_t at(int64_t g) const {
    const int64_t epoch = g / n_, i = g % n_;
    if (!shuffle_) return i;
    uint64_t x = static_cast<uint64_t>(i);
    do x = encrypt(x, static_cast<uint64_t>(epoch));
    while (x >= static_cast<uint64_t>(n_));
    return static_cast<int64_t>(x);
  }

 private:
  uint64_t encrypt(uint64_t x, uint64_t epoch) const {
    const uint64_t mask = (uint64_t(1) << half_bits_) - 1;
    uint64_t left = x >> half_bits_, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t key[4] = {seed_, epoch, round, right};
      const uint64_t f = XXH3_64bits(key, sizeof key) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    return (left << half_bits_) | right;
  }
  int64_t n_;
  uint64_t seed_;
  bool shuffle_;
  int half_bits_ = 1;
};

// A read-only memory map of a whole file, unmapped on destruction.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error("cannot open " + path + ": " + std::strerror(errno));
    const off_t size = ::lseek(fd, 0, SEEK_END);
    size_ = size > 0 ? static_cast<size_t>(size) : 0;
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        throw Error("cannot map " + path + ": " + std::strerror(errno));
      }
      data_ = static_cast<const unsigned char*>(p);
      ::madvise(p, size_, MADV_RANDOM);  // windows are read in shuffled order
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

Error data_error(const std::string& path, const std::string& what, const std::string& hint);

// A corpus from `dsrun prepare`: shards mapped, never copied; tokens widen to int64 per batch only.
// Windows of seq_len + 1 tokens over the shards in order; validation is the last val_fraction.
class MappedTokenWindows final : public Dataset {
 public:
  MappedTokenWindows(const std::string& dir, int64_t vocab, double val_fraction, int64_t seq_len, uint64_t seed, bool shuffle)
      : dir_(dir), vocab_(vocab), seq_(seq_len) {
    const std::string manifest_path = path_join(dir, "manifest.json");
    nlohmann::json m;
    try {
      m = nlohmann::json::parse(read_file(manifest_path));
    } catch (const nlohmann::json::exception& e) {
      throw data_error(manifest_path, std::string("unreadable manifest: ") + e.what(), "run dsrun prepare again");
    }
    if (m.value("format", "") != "dsrun-tokens" || m.value("version", 0) != 1) throw data_error(manifest_path, "not a dsrun prepare manifest", "run dsrun prepare");
    width_ = m.value("token_bytes", 0);
    const int64_t tokenizer_vocab = m["tokenizer"].value("vocab_size", int64_t(0));
    if (tokenizer_vocab > vocab) {
      ErrorContext c;
      c.file = manifest_path;
      c.key = "model.vocab";
      c.hint = "set model.vocab to at least " + std::to_string(tokenizer_vocab);
      throw Error("the corpus was tokenized with " + std::to_string(tokenizer_vocab) + " ids, more than model.vocab = " + std::to_string(vocab), c);
    }
    for (const auto& shard : m["shards"]) {
      const std::string file = path_join(dir, shard.value("tokens_file", ""));
      auto mapped = std::make_unique<MappedFile>(file);
      const int64_t count = shard.value("tokens", int64_t(-1));
      uint32_t version = 0, w = 0;
      uint64_t header_count = 0;
      if (mapped->size() >= 32) {
        std::memcpy(&version, mapped->data() + 8, 4);
        std::memcpy(&w, mapped->data() + 12, 4);
        std::memcpy(&header_count, mapped->data() + 16, 8);
      }
      if (mapped->size() < 32 || std::memcmp(mapped->data(), "DSRUNTOK", 8) != 0 || version != 1 || int(w) != width_ ||
          int64_t(header_count) != count || mapped->size() != 32 + size_t(count) * w) {
        throw data_error(file, "shard does not match the manifest (truncated, or from another prepare)", "run dsrun prepare again; it keeps the shards that are whole");
      }
      starts_.push_back(total_);
      total_ += count;
      shards_.push_back(std::move(mapped));
    }
    const int64_t val_tokens = static_cast<int64_t>(static_cast<double>(total_) * val_fraction);
    train_tokens_ = total_ - val_tokens;
    train_windows_ = (train_tokens_ - 1) / seq_;
    val_windows_ = val_tokens > seq_ ? (val_tokens - 1) / seq_ : 0;
    if (train_windows_ < 1) throw data_error(dir, "the corpus has " + std::to_string(total_) + " tokens: not one training sequence", "use more data or a shorter batch.seq_len");
    order_ = std::make_unique<FeistelOrder>(train_windows_, seed, shuffle);
  }
  Batch train_batch(int64_t first, int64_t count) override {
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < count; ++i) starts.push_back(order_->at(first + i) * seq_);
    return cut(starts);
  }
  Batch val_batch(int64_t first, int64_t count) override {
    if (val_windows_ == 0) {
      ErrorContext c;
      c.key = "data.val_fraction";
      c.hint = "raise data.val_fraction or use more data, or set eval.every = 0";
      throw Error("the validation split is shorter than one sequence", c);
    }
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < count; ++i) starts.push_back(train_tokens_ + ((first + i) % val_windows_) * seq_);
    return cut(starts);
  }
  std::string describe() const override {
    return "prepared corpus at " + dir_ + ": " + std::to_string(shards_.size()) + " shards mapped, " + std::to_string(train_tokens_) +
           " training tokens (" + std::to_string(train_windows_) + " sequences), " + std::to_string(total_ - train_tokens_) + " validation tokens";
  }

 private:
  // Token g of the whole stream (shards in order).
  int64_t token(int64_t g) const {
    const size_t s = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), g) - starts_.begin() - 1);
    const unsigned char* p = shards_[s]->data() + 32 + static_cast<size_t>(g - starts_[s]) * static_cast<size_t>(width_);
    uint32_t t = 0;
    std::memcpy(&t, p, static_cast<size_t>(width_));
    if (t >= vocab_) {
      throw data_error(shards_[s]->path(), "token " + std::to_string(t) + " at position " + std::to_string(g - starts_[s]) + " is outside the vocabulary",
                       "set model.vocab above the largest token id");
    }
    return t;
  }
  Batch cut(const std::vector<int64_t>& starts) const {
    const int64_t rows = static_cast<int64_t>(starts.size());
    torch::Tensor both = torch::empty({rows, seq_ + 1}, torch::kInt64);
    int64_t* out = both.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k <= seq_; ++k) out[r * (seq_ + 1) + k] = token(starts[static_cast<size_t>(r)] + k);
    }
    Batch b;
    b.inputs = both.narrow(1, 0, seq_).contiguous();
    b.targets = both.narrow(1, 1, seq_).contiguous();
    b.items = rows * seq_;
    return b;
  }
  std::string dir_;
  int64_t vocab_, seq_;
  int width_ = 4;
  std::vector<std::unique_ptr<MappedFile>> shards_;
  std::vector<int64_t> starts_;
  int64_t total_ = 0, train_tokens_ = 0, train_windows_ = 0, val_windows_ = 0;
  std::unique_ptr<FeistelOrder> order_;
};

// Images with labels (CIFAR-10 or synthetic), normalised per channel.
class ImageSet final : public Dataset {
 public:
  ImageSet(torch::Tensor train_x, torch::Tensor train_y, torch::Tensor val_x, torch::Tensor val_y, uint64_t seed, bool shuffle, std::string what)
      : tx_(std::move(train_x)), ty_(std::move(train_y)), vx_(std::move(val_x)), vy_(std::move(val_y)), what_(std::move(what)),
        order_(tx_.size(0), seed, shuffle) {}
  Batch train_batch(int64_t first, int64_t count) override {
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < count; ++i) idx.push_back(order_.at(first + i));
    return take(tx_, ty_, idx);
  }
  Batch val_batch(int64_t first, int64_t count) override {
    if (vx_.size(0) == 0) {
      ErrorContext c;
      c.key = "data.path";
      c.hint = "the validation images are missing (CIFAR-10: test_batch.bin); set eval.every = 0 to train without them";
      throw Error("no validation images", c);
    }
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < count; ++i) idx.push_back((first + i) % vx_.size(0));
    return take(vx_, vy_, idx);
  }
  std::string describe() const override {
    return what_ + ": " + std::to_string(tx_.size(0)) + " training images, " + std::to_string(vx_.size(0)) + " validation images";
  }

 private:
  static Batch take(const torch::Tensor& x, const torch::Tensor& y, const std::vector<int64_t>& idx) {
    torch::Tensor i = torch::tensor(idx, torch::kInt64);
    Batch b;
    b.inputs = x.index_select(0, i);
    b.targets = y.index_select(0, i);
    b.items = static_cast<int64_t>(idx.size());
    return b;
  }
  torch::Tensor tx_, ty_, vx_, vy_;
  std::string what_;
  EpochOrder order_;
};

Error data_error(const std::string& path, const std::string& what, const std::string& hint) {
  ErrorContext c;
  c.file = path;
  c.key = "data.path";
  c.hint = hint;
  return Error(what, c);
}

// data_directory_files, with the errors of a data path that holds nothing to read.
std::vector<std::string> data_files(const std::string& path, const std::string& only_suffix) {
  if (!file_exists(path)) throw data_error(path, "data path not found", "check data.path (relative to the recipe)");
  if (!is_directory(path)) return {regular_file_target(path, "data.path")};
  std::vector<std::string> files = data_directory_files(path, only_suffix);
  if (files.empty()) throw data_error(path, "no data files in the directory", "point data.path at the files");
  return files;
}

std::vector<int64_t> read_text_bytes(const std::string& path) {
  std::vector<int64_t> tokens;
  for (const auto& f : data_files(path, "")) {
    std::string text = read_file(f);
    for (unsigned char c : text) tokens.push_back(c);
  }
  return tokens;
}

std::vector<int64_t> read_token_shards(const std::string& path, int64_t vocab) {
  std::vector<int64_t> tokens;
  for (const auto& f : data_files(path, is_directory(path) ? ".tokens" : "")) {
    std::string bytes = read_file(f);
    if (bytes.size() < 32 || bytes.compare(0, 8, "DSRUNTOK") != 0)
      throw data_error(f, "not a dsrun token shard (no DSRUNTOK header)", "write shards as docs/data.md describes");
    uint32_t version = 0, width = 0;
    uint64_t count = 0;
    std::memcpy(&version, bytes.data() + 8, 4);
    std::memcpy(&width, bytes.data() + 12, 4);
    std::memcpy(&count, bytes.data() + 16, 8);
    if (version != 1 || (width != 2 && width != 4) || count > (bytes.size() - 32) / width || bytes.size() != 32 + count * width)
      throw data_error(f, "token shard header does not match its size (version " + std::to_string(version) + ", " +
                              std::to_string(width) + " bytes per token, " + std::to_string(count) + " tokens)",
                       "rewrite the shard; it may be truncated");
    for (uint64_t i = 0; i < count; ++i) {
      uint32_t t = 0;
      std::memcpy(&t, bytes.data() + 32 + i * width, width);
      if (t >= vocab) throw data_error(f, "token " + std::to_string(t) + " at position " + std::to_string(i) + " is outside the vocabulary", "set model.vocab above the largest token id");
      tokens.push_back(t);
    }
  }
  return tokens;
}

// A learnable synthetic stream: each token mostly follows a fixed random successor of the previous one.
std::vector<int64_t> synthetic_tokens(int64_t vocab, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x5eedULL);
  std::vector<int64_t> next(static_cast<size_t>(vocab));
  for (auto& t : next) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  std::vector<int64_t> out(static_cast<size_t>(n));
  int64_t t = 0;
  for (auto& o : out) {
    t = rng() % 10 < 8 ? next[static_cast<size_t>(t)] : static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
    o = t;
  }
  return out;
}

std::unique_ptr<Dataset> cifar10(const std::string& path, uint64_t seed, bool shuffle) {
  auto load = [&](const std::vector<std::string>& names) {
    std::vector<torch::Tensor> xs, ys;
    for (const auto& n : names) {
      std::string f = path_join(path, n);
      std::string bytes = read_file(regular_file_target(f, "data.path"));
      if (bytes.empty()) throw data_error(f, "is empty: a CIFAR-10 batch holds 10,000 images of 3073 bytes", "use the binary version of CIFAR-10 (cifar-10-batches-bin)");
      if (bytes.size() % 3073 != 0) throw data_error(f, "not a CIFAR-10 binary batch (size is not a multiple of 3073)", "use the binary version of CIFAR-10");
      const int64_t records = static_cast<int64_t>(bytes.size() / 3073);
      torch::Tensor raw = torch::from_blob(bytes.data(), {records, 3073}, torch::kUInt8).clone();
      ys.push_back(raw.select(1, 0).to(torch::kInt64));
      xs.push_back(raw.narrow(1, 1, 3072).reshape({records, 3, 32, 32}).to(torch::kFloat32).div_(255));
    }
    torch::Tensor mean = torch::tensor({0.4914, 0.4822, 0.4465}).view({1, 3, 1, 1}), std = torch::tensor({0.2470, 0.2435, 0.2616}).view({1, 3, 1, 1});
    return std::make_pair((torch::cat(xs) - mean) / std, torch::cat(ys));
  };
  auto train = load({"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin"});
  auto val = load({"test_batch.bin"});
  return std::make_unique<ImageSet>(train.first, train.second, val.first, val.second, seed, shuffle, "CIFAR-10 at " + path);
}

std::unique_ptr<Dataset> synthetic_images(const ResNetSpec& r, uint64_t seed, bool shuffle) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  auto make = [&](int64_t n) {
    torch::Tensor y = torch::randint(r.classes, {n}, gen, torch::kInt64);
    torch::Tensor x = torch::randn({n, r.channels, r.image_size, r.image_size}, gen);
    x += (y.to(torch::kFloat32) / r.classes - 0.5).view({n, 1, 1, 1});  // a class-dependent shift to learn
    return std::make_pair(x, y);
  };
  auto train = make(2048);
  auto val = make(256);
  return std::make_unique<ImageSet>(train.first, train.second, val.first, val.second, seed, shuffle, "synthetic images");
}

}  // namespace

void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens, int bytes_per_token) {
  DSRUN_ASSERT(bytes_per_token == 2 || bytes_per_token == 4, "2 or 4 bytes per token");
  std::string out("DSRUNTOK", 8);
  uint32_t version = 1, width = static_cast<uint32_t>(bytes_per_token);
  uint64_t count = tokens.size(), zero = 0;
  out.append(reinterpret_cast<const char*>(&version), 4).append(reinterpret_cast<const char*>(&width), 4);
  out.append(reinterpret_cast<const char*>(&count), 8).append(reinterpret_cast<const char*>(&zero), 8);
  for (uint32_t t : tokens) out.append(reinterpret_cast<const char*>(&t), width);
  write_file_atomic(path, out);
}

std::unique_ptr<Dataset> open_dataset(const DataOptions& data, const ModelSpec& model, int64_t seq_len, uint64_t seed) {
  if (model.arch == ModelArch::ResNet) {
    if (data.kind == DataKind::Cifar10) return cifar10(data.path, seed, data.shuffle);
    return synthetic_images(model.resnet, seed, data.shuffle);
  }
  switch (data.kind) {
    case DataKind::Text:
      return std::make_unique<TokenWindows>(read_text_bytes(data.path), data.val_fraction, seq_len, seed, data.shuffle, "text at " + data.path);
    case DataKind::Tokens:
      if (is_directory(data.path) && file_exists(path_join(data.path, "manifest.json"))) {
        return std::make_unique<MappedTokenWindows>(data.path, model.vocab, data.val_fraction, seq_len, seed, data.shuffle);
      }
      return std::make_unique<TokenWindows>(read_token_shards(data.path, model.vocab), data.val_fraction, seq_len, seed, data.shuffle,
                                            "token shards at " + data.path);
    default:
      return std::make_unique<TokenWindows>(synthetic_tokens(model.vocab, std::max<int64_t>(1 << 20, 64 * (seq_len + 1)), seed),
                                            data.val_fraction, seq_len, seed, data.shuffle, "synthetic tokens");
  }
}

}  // namespace dsrun
