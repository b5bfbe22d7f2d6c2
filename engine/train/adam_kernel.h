// The CUDA kernel of the optimizer's step over masters on the GPU: Adam or AdamW over a contiguous
// range of fp32 master weights and states, reading the gradient in the working dtype and writing the
// working parameters, in one pass over memory. A flat C interface, so nvcc compiles no torch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

extern "C" {

// The states', the gradient's and the working parameters' element types: DsrunFusedDType
// (fused_kernels.h). States in bf16 (DeepSeek-V3's choice) are read, updated in fp32 and rounded
// to nearest as they are written.
//
// For each of the n elements, in fp32:
//   g  = grad · grad_factor / (*grad_divisor, where grad_divisor is not null)
//   decoupled (AdamW): w -= lr · weight_decay · w;  otherwise (Adam, L2): g += weight_decay · w
//   m  = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²
//   w -= (lr / bias_correction1) · m / (sqrt(v) / bias_correction2_sqrt + eps)
// and, where param_out is not null, param_out = w rounded to param_dtype. This is PyTorch's fused
// Adam's update (ATen's fused_adam_utils.cuh) with the gradient's conversion to fp32, its averaging
// and clipping (grad_divisor: a factor decided on the device, with no host read of the norm), and
// the weights' publication to the working dtype folded into the same pass.
void dsrun_adam_step(float* master, void* exp_avg, void* exp_avg_sq, int state_dtype, const void* grad, int grad_dtype, void* param_out,
                     int param_dtype, int64_t n, float grad_factor, const float* grad_divisor, float lr, float beta1, float beta2,
                     float eps, float weight_decay, int decoupled, float bias_correction1, float bias_correction2_sqrt,
                     cudaStream_t stream);

// The last launch error as text, or nullptr.
const char* dsrun_adam_last_error(void);
}
