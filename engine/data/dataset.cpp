#include "engine/data/dataset.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/data/augment.hpp"
#include "engine/data/token_source.hpp"

#include <algorithm>
#include <cstring>
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
  TokenWindows(std::vector<int64_t> tokens, double val_fraction, int64_t seq_len, uint64_t seed, bool shuffle, std::string what,
               std::vector<std::string> files = {})
      : seq_(seq_len), what_(std::move(what)), files_(std::move(files)) {
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
  std::vector<std::string> files() const override { return files_; }

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
  std::vector<std::string> files_;
  std::unique_ptr<EpochOrder> order_;
};

// A corpus read in place (dsrun prepare's shards, Megatron-LM, llm.c, nanoGPT; see
// token_source.hpp): tokens widen to int64 per batch only. With data.separate_documents the batch
// also says where documents start, so positions restart and attention stays inside each one.
class CorpusWindows final : public Dataset {
 public:
  CorpusWindows(const TokenCorpusOptions& o, bool separate_documents) : corpus_(o), seq_(o.seq_len), separate_(separate_documents) {}
  Batch train_batch(int64_t first, int64_t count) override {
    return cut(count, [&](int64_t i, Window& w) { corpus_.train_window(first + i, w); });
  }
  Batch val_batch(int64_t first, int64_t count) override {
    return cut(count, [&](int64_t i, Window& w) { corpus_.val_window(first + i, w); });
  }
  std::string describe() const override { return corpus_.describe(); }
  std::vector<std::string> files() const override { return corpus_.files(); }
  std::vector<std::string> warnings() const override { return corpus_.warnings(); }

 private:
  template <class Read>
  Batch cut(int64_t rows, Read read) {
    torch::Tensor both = torch::empty({rows, seq_ + 1}, torch::kInt64);
    torch::Tensor positions, documents;
    if (separate_) {
      positions = torch::empty({rows, seq_}, torch::kInt64);
      documents = torch::empty({rows, seq_}, torch::kInt32);
    }
    for (int64_t r = 0; r < rows; ++r) {
      read(r, window_);
      std::memcpy(both.data_ptr<int64_t>() + r * (seq_ + 1), window_.tokens.data(), sizeof(int64_t) * static_cast<size_t>(seq_ + 1));
      if (!separate_) continue;
      int64_t* pos = positions.data_ptr<int64_t>() + r * seq_;
      int32_t* doc = documents.data_ptr<int32_t>() + r * seq_;
      size_t next = 0;
      int64_t start = 0;
      int32_t d = 0;
      for (int64_t k = 0; k < seq_; ++k) {
        if (next < window_.document_starts.size() && window_.document_starts[next] == k) start = k, ++d, ++next;
        pos[k] = k - start;
        doc[k] = d;
      }
    }
    Batch b;
    b.inputs = both.narrow(1, 0, seq_).contiguous();
    b.targets = both.narrow(1, 1, seq_).contiguous();
    b.positions = positions;
    b.documents = documents;
    b.items = rows * seq_;
    return b;
  }
  TokenCorpus corpus_;
  int64_t seq_;
  bool separate_;
  Window window_;
};

// Images with labels (CIFAR-10 or synthetic), normalised per channel.
class ImageSet final : public Dataset {
 public:
  ImageSet(torch::Tensor train_x, torch::Tensor train_y, torch::Tensor val_x, torch::Tensor val_y, uint64_t seed, bool shuffle, std::string what)
      : tx_(std::move(train_x)), ty_(std::move(train_y)), vx_(std::move(val_x)), vy_(std::move(val_y)), what_(std::move(what)),
        order_(tx_.size(0), seed, shuffle), seed_(seed) {}
  // Crop and flip each training image, keyed by its place in the training stream; padding is
  // black, which normalisation turned into `black`.
  void enable_augmentation(torch::Tensor black) { black_ = std::move(black); }
  Batch train_batch(int64_t first, int64_t count) override {
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < count; ++i) idx.push_back(order_.at(first + i));
    Batch b = take(tx_, ty_, idx);
    b.sample_ids = torch::arange(first, first + count, torch::kInt64);
    return b;
  }
  void augment(Batch& b) const override {
    if (black_.defined()) b.inputs = crop_flip(b.inputs, black_, b.sample_ids, seed_);
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
  uint64_t seed_;
  torch::Tensor black_;
};

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

std::unique_ptr<Dataset> cifar10(const std::string& path, uint64_t seed, bool shuffle, bool augment) {
  const torch::Tensor mean = torch::tensor({0.4914, 0.4822, 0.4465}).view({1, 3, 1, 1}), std = torch::tensor({0.2470, 0.2435, 0.2616}).view({1, 3, 1, 1});
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
    return std::make_pair((torch::cat(xs) - mean) / std, torch::cat(ys));
  };
  auto train = load({"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin"});
  auto val = load({"test_batch.bin"});
  auto set = std::make_unique<ImageSet>(train.first, train.second, val.first, val.second, seed, shuffle,
                                        "CIFAR-10 at " + path + (augment ? ", random crop (4-pixel padding) and flip" : ""));
  if (augment) set->enable_augmentation((-mean / std).reshape({3}));
  return set;
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

std::unique_ptr<Dataset> open_dataset(const DataOptions& data, const ModelSpec& model, int64_t seq_len, uint64_t seed) {
  if (model.arch == ModelArch::ResNet) {
    if (data.kind == DataKind::Cifar10) return cifar10(data.path, seed, data.shuffle, data.augment);
    return synthetic_images(model.resnet, seed, data.shuffle);
  }
  switch (data.kind) {
    case DataKind::Text:
      return std::make_unique<TokenWindows>(read_text_bytes(data.path), data.val_fraction, seq_len, seed, data.shuffle, "text at " + data.path,
                                            data_files(data.path, ""));
    case DataKind::Tokens: {
      const TokenCorpusOptions o = token_corpus_options(data, model.vocab, seq_len, seed);
      return std::make_unique<CorpusWindows>(o, data.separate_documents);
    }
    default:
      return std::make_unique<TokenWindows>(synthetic_tokens(model.vocab, std::max<int64_t>(1 << 20, 64 * (seq_len + 1)), seed),
                                            data.val_fraction, seq_len, seed, data.shuffle, "synthetic tokens");
  }
}

}  // namespace dsrun
