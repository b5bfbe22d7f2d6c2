#include "engine/common/build_kernels.hpp"

namespace dsrun {

BuildKernels this_build_kernels() {
  BuildKernels k;
#ifdef DSRUN_BUILD_CUDA
  k.cuda = true;
#endif
#ifdef DSRUN_BUILD_DEVICE_ADAM
  k.device_adam = true;
#endif
#ifdef DSRUN_BUILD_FUSED_ADAM
  k.fused_adam = true;
#endif
#ifdef DSRUN_BUILD_VARLEN_ATTENTION
  k.varlen_attention = true;
#endif
#ifdef DSRUN_BUILD_FP8_PRODUCTS
  k.fp8_products = true;
#endif
#ifdef DSRUN_BUILD_FP8_GROUPED_PRODUCTS
  k.fp8_grouped_products = true;
#endif
  return k;
}

}  // namespace dsrun
