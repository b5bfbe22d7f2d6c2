// ResNet-18/34 (basic blocks) and 50/101/152 (bottlenecks) for small images: the CIFAR variant
// with a 3x3 stem and no max-pool for images up to 64 px, the ImageNet stem above that.
#include "engine/model/model.hpp"

namespace dsrun {

namespace {

using torch::Tensor;
namespace nn = torch::nn;

nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2).bias(false));
}

// cuDNN's batch norm takes fp16 or bf16 activations only with fp32 weights and statistics; given
// half-precision weights PyTorch falls back to its own, slower kernels. So the statistics stay fp32
// (the trainer keeps running_mean/var so on a GPU) and the weights are widened here, as autocast runs it.
Tensor batch_norm(nn::BatchNorm2d& bn, const Tensor& x) {
  if (x.scalar_type() == bn->running_mean.scalar_type()) return bn(x);
  const bool training = bn->is_training();
  if (training) bn->num_batches_tracked.add_(1);  // (what the module's forward counts)
  return torch::batch_norm(x, bn->weight.to(torch::kFloat), bn->bias.to(torch::kFloat), bn->running_mean, bn->running_var,
                           training, bn->options.momentum().value_or(0.1), bn->options.eps(), /*cudnn_enabled=*/true);
}

struct ResidualBlockImpl : nn::Module {
  ResidualBlockImpl(int64_t in, int64_t width, int64_t stride, bool bottleneck) {
    const int64_t out = bottleneck ? width * 4 : width;
    if (bottleneck) {
      convs = {conv(in, width, 1, 1), conv(width, width, 3, stride), conv(width, out, 1, 1)};
      norms = {nn::BatchNorm2d(width), nn::BatchNorm2d(width), nn::BatchNorm2d(out)};
    } else {
      convs = {conv(in, width, 3, stride), conv(width, out, 3, 1)};
      norms = {nn::BatchNorm2d(width), nn::BatchNorm2d(out)};
    }
    for (size_t i = 0; i < convs.size(); ++i) {
      register_module("conv" + std::to_string(i), convs[i]);
      register_module("bn" + std::to_string(i), norms[i]);
    }
    if (stride != 1 || in != out) {
      shortcut_conv = register_module("shortcut_conv", conv(in, out, 1, stride));
      shortcut_bn = register_module("shortcut_bn", nn::BatchNorm2d(out));
    }
  }
  Tensor forward(const Tensor& x) {
    Tensor h = x;
    for (size_t i = 0; i < convs.size(); ++i) {
      h = batch_norm(norms[i], convs[i](h));
      if (i + 1 < convs.size()) h = torch::relu(h);
    }
    Tensor skip = shortcut_conv ? batch_norm(shortcut_bn, shortcut_conv(x)) : x;
    return torch::relu(h + skip);
  }
  std::vector<nn::Conv2d> convs;
  std::vector<nn::BatchNorm2d> norms;
  nn::Conv2d shortcut_conv{nullptr};
  nn::BatchNorm2d shortcut_bn{nullptr};
};
TORCH_MODULE(ResidualBlock);

struct ResNetModule : nn::Module {
  explicit ResNetModule(const ResNetSpec& r) : small(r.image_size <= 64) {
    stem_conv = register_module("stem_conv", conv(r.channels, r.width, small ? 3 : 7, small ? 1 : 2));
    stem_bn = register_module("stem_bn", nn::BatchNorm2d(r.width));
    const bool bottleneck = r.depth >= 50;
    std::vector<int> counts{2, 2, 2, 2};
    if (r.depth == 34 || r.depth == 50) counts = {3, 4, 6, 3};
    if (r.depth == 101) counts = {3, 4, 23, 3};
    if (r.depth == 152) counts = {3, 8, 36, 3};
    int64_t in = r.width;
    for (int stage = 0; stage < 4; ++stage)
      for (int b = 0; b < counts[stage]; ++b) {
        int64_t width = static_cast<int64_t>(r.width) << stage;
        blocks.push_back(register_module("block" + std::to_string(blocks.size()),
                                         ResidualBlock(in, width, stage > 0 && b == 0 ? 2 : 1, bottleneck)));
        in = bottleneck ? width * 4 : width;
      }
    fc = register_module("fc", nn::Linear(in, r.classes));
  }
  bool small;
  nn::Conv2d stem_conv{nullptr};
  nn::BatchNorm2d stem_bn{nullptr};
  std::vector<ResidualBlock> blocks;
  nn::Linear fc{nullptr};
};

class ResNetModel final : public Model {
 public:
  explicit ResNetModel(const ResNetSpec& spec) : net_(std::make_shared<ResNetModule>(spec)) {
    torch::NoGradGuard no_grad;
    for (auto& m : net_->modules(false))
      if (auto* c = m->as<nn::Conv2d>()) nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
  }

  std::vector<ParameterUnit> parameter_units() override {
    std::vector<ParameterUnit> units;
    std::vector<Tensor> stem = net_->stem_conv->parameters();
    for (auto& p : net_->stem_bn->parameters()) stem.push_back(p);
    units.push_back({"stem", stem, false, true, {}, {}});
    for (size_t i = 0; i < net_->blocks.size(); ++i) units.push_back({"block " + std::to_string(i), net_->blocks[i]->parameters(), true, true, {}, {}});
    units.push_back({"head", net_->fc->parameters(), false, true, {}, {}});
    return units;
  }

  ModelOutput forward(const Batch& batch, UnitRunner& runner) override {
    // On a GPU the images go channels-last (NHWC): cuDNN's tensor-core convolutions and batch norms
    // run in that layout, and every later activation keeps it.
    const Tensor images = batch.inputs.is_cuda() ? batch.inputs.contiguous(at::MemoryFormat::ChannelsLast) : batch.inputs;
    Tensors x = runner.run(0, [this](const Tensors& in) {
      Tensor h = torch::relu(batch_norm(net_->stem_bn, net_->stem_conv(in[0])));
      if (!net_->small) h = torch::max_pool2d(h, 3, 2, 1);
      return Tensors{h};
    }, {images});
    for (size_t i = 0; i < net_->blocks.size(); ++i) {
      ResidualBlock block = net_->blocks[i];
      x = runner.run(1 + static_cast<int>(i), [block](const Tensors& in) mutable { return Tensors{block(in[0])}; }, x);
    }
    const int head = 1 + static_cast<int>(net_->blocks.size());
    Tensor logits = runner.run(head, [this](const Tensors& in) { return Tensors{net_->fc(in[0].mean({2, 3}))}; }, x)[0];
    ModelOutput out;
    out.logits = logits;
    return out;
  }

  nn::Module& module() override { return *net_; }

 private:
  std::shared_ptr<ResNetModule> net_;
};

}  // namespace

std::unique_ptr<Model> build_resnet(const ResNetSpec& spec) { return std::make_unique<ResNetModel>(spec); }

}  // namespace dsrun
