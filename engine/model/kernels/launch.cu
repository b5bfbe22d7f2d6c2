// The launch-error record every entry point writes after its launches (note_launch, declared in
// common.cuh) and dsrun_fused_last_error, which reads it.
#include "engine/model/fused_kernels.h"
#include "engine/model/kernels/common.cuh"

#include <cuda_runtime_api.h>

namespace {

thread_local const char* last_error = nullptr;

}  // namespace

namespace dsrun_kernels {

void note_launch() {
  cudaError_t e = cudaGetLastError();
  last_error = e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace dsrun_kernels

extern "C" {

const char* dsrun_fused_last_error(void) { return last_error; }
}
