// What this build's kernels can do, known to the torch-free core from CMake (the planner decides
// the execution modes with it); the engine checks at start-up that it was compiled alike.
#pragma once

namespace dsrun {

struct BuildKernels {
  bool cuda = false;              // libtorch with CUDA: NCCL, the fused elementwise kernels
  bool device_adam = false;       // dsrun's Adam kernel for masters on the GPU (CUDA builds: engine/train/adam_kernel.cu)
  bool fused_adam = false;        // torch's fused AdamW (PyTorch >= 2.4)
  bool varlen_attention = false;  // FlashAttention-2's variable-length kernel (CUDA PyTorch >= 2.2)
  bool fp8_products = false;      // torch's scaled FP8 matrix products with row scales (CUDA PyTorch >= 2.5): precision.fp8
  bool fp8_grouped_products = false;  // and its grouped ones (CUDA PyTorch >= 2.9): execution.fp8_routed_experts
  bool operator==(const BuildKernels& o) const {
    return cuda == o.cuda && device_adam == o.device_adam && fused_adam == o.fused_adam && varlen_attention == o.varlen_attention &&
           fp8_products == o.fp8_products && fp8_grouped_products == o.fp8_grouped_products;
  }
};

// This binary's, from the definitions CMake gives engine/common/build_kernels.cpp.
BuildKernels this_build_kernels();

}  // namespace dsrun
