#include "engine/parallel/host_buffers.hpp"

#include "engine/common/error.hpp"
#include "engine/parallel/copy_stream.hpp"

namespace dsrun {

torch::Tensor HostBuffers::copy(const std::string& purpose, const torch::Tensor& t) {
  Block& b = blocks_[purpose];
  if (!b.block.defined()) {
    try {
      b.block = device_.is_cuda() ? pinned_host_tensor(block_numel_, t.scalar_type()) : torch::empty({block_numel_}, t.options().device(torch::kCPU));
    } catch (const std::exception& e) {
      ErrorContext c;
      c.key = "parallel.offload";
      c.hint = "the plan's host table counts what offload holds; check hardware.host_memory_gib against this machine, or offload less";
      throw Error("cannot allocate " + std::to_string(block_numel_ * t.element_size()) + " bytes of " + (device_.is_cuda() ? "pinned " : "") +
                      "host memory for the offloaded " + purpose + ": " + std::string(e.what()).substr(0, 200),
                  c);
    }
  }
  torch::Tensor slot = b.block.narrow(0, b.used, t.numel());
  b.used += t.numel();
  return slot.copy_(t.flatten());
}

double HostBuffers::buffer_bytes() const {
  double bytes = 0;
  for (const auto& [purpose, b] : blocks_)
    if (purpose != "master weights" && purpose != "parameter shards") bytes += static_cast<double>(b.block.numel() * b.block.element_size());
  return bytes;
}

}  // namespace dsrun
