// A pointer through torch::autograd::Function: its apply() and AutogradContext::saved_data take
// only IValues, so the address travels as an int64. One place for the casts, both ways.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace dsrun {

// The pointee must outlive the backward that reads it (a communicator, a unit's function).
template <class T>
int64_t pointer_argument(T* pointer) {
  return reinterpret_cast<int64_t>(pointer);
}

template <class T>
T* pointer_from_argument(int64_t address) {
  return reinterpret_cast<T*>(address);
}

// Kept for backward under `key`, and read back.
template <class T>
void save_pointer(torch::autograd::AutogradContext* ctx, const char* key, T* pointer) {
  ctx->saved_data[key] = pointer_argument(pointer);
}

template <class T>
T* saved_pointer(torch::autograd::AutogradContext* ctx, const char* key) {
  return pointer_from_argument<T>(ctx->saved_data[key].toInt());
}

}  // namespace dsrun
