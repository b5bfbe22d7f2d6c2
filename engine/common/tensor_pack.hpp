// Named pieces of one float64 vector: several values cross to the host, or through one
// all-reduce or broadcast, together, and each is read back by the handle its add() returned.
#pragma once

#include <torch/torch.h>

#include <vector>

namespace dsrun {

// Usage: auto loss = pack.add(x); ... torch::Tensor v = pack.joined(); all_reduce(v); pack.value(v, loss).
// The handles replace hand-counted offsets, so a piece added or removed moves no other.
class TensorPack {
 public:
  struct Piece {
    int64_t offset = 0, size = 0;
  };

  explicit TensorPack(torch::Device device = torch::kCPU) : device_(device) {}

  Piece add(const torch::Tensor& t) {
    torch::Tensor flat = t.reshape({-1}).to(device_, torch::kFloat64);
    const Piece p{size_, flat.numel()};
    size_ += p.size;
    parts_.push_back(std::move(flat));
    return p;
  }
  Piece add(double v) { return add(torch::tensor({v}, torch::kFloat64)); }
  Piece add_flag(bool flag) { return add(flag ? 1.0 : 0.0); }

  // The pieces in the order added, as one contiguous vector.
  torch::Tensor joined() const {
    return parts_.empty() ? torch::zeros({0}, torch::TensorOptions().dtype(torch::kFloat64).device(device_)) : torch::cat(parts_);
  }

  // A piece of `whole` (joined(), or what a collective made of it); on the host for value() and sum().
  static torch::Tensor piece(const torch::Tensor& whole, Piece p) { return whole.narrow(0, p.offset, p.size); }
  static double value(const torch::Tensor& host, Piece p) { return host.data_ptr<double>()[p.offset]; }
  static bool flag(const torch::Tensor& host, Piece p) { return value(host, p) > 0; }
  // Summed in order, in double, as each value read on its own and added would be.
  static double sum(const torch::Tensor& host, Piece p) {
    const double* v = host.data_ptr<double>() + p.offset;
    double s = 0;
    for (int64_t i = 0; i < p.size; ++i) s += v[i];
    return s;
  }

 private:
  torch::Device device_;
  std::vector<torch::Tensor> parts_;
  int64_t size_ = 0;
};

}  // namespace dsrun
