#include "engine/parallel/copy_stream.hpp"

#include "engine/common/error.hpp"

#include <algorithm>
#include <cstdlib>

#ifdef DSRUN_WITH_CUDA
#include <cuda_runtime_api.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <optional>

namespace dsrun {

#ifdef DSRUN_WITH_CUDA
struct CopyEvent::Impl {
  at::cuda::CUDAEvent event;
  c10::DeviceIndex device = 0;
};
struct CopyStream::Impl {
  std::optional<c10::cuda::CUDAStream> stream;  // empty: not a CUDA device
  c10::DeviceIndex device = 0;
};
#else
struct CopyEvent::Impl {};
struct CopyStream::Impl {};
#endif

std::string cuda_pci_bus_id(torch::Device device) {
#ifdef DSRUN_WITH_CUDA
  if (!device.is_cuda()) return "";
  char id[32] = {0};
  if (::cudaDeviceGetPCIBusId(id, sizeof id, device.index() < 0 ? 0 : device.index()) != cudaSuccess) {
    (void)::cudaGetLastError();  // unknown placement is not an error: the host step then runs on any core
    return "";
  }
  return id;
#else
  (void)device;
  return "";
#endif
}

torch::Tensor pinned_host_tensor(int64_t numel, torch::ScalarType dtype) {
#ifdef DSRUN_WITH_CUDA
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(numel) * c10::elementSize(dtype));
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, bytes) != 0) throw Error("cannot allocate " + std::to_string(bytes) + " bytes of host memory");
  const cudaError_t status = ::cudaHostRegister(p, bytes, cudaHostRegisterDefault);
  if (status != cudaSuccess) {
    ::free(p);
    (void)::cudaGetLastError();  // clear it: the error is reported here, not by the next CUDA call
    throw Error("cannot pin " + std::to_string(bytes) + " bytes of host memory (cudaHostRegister: " + ::cudaGetErrorString(status) + ")");
  }
  return torch::from_blob(p, {numel}, [](void* q) {
    (void)::cudaHostUnregister(q);  // at exit the driver may be gone already; the memory goes either way
    ::free(q);
  }, torch::TensorOptions().dtype(dtype));
#else
  return torch::empty({numel}, torch::TensorOptions().dtype(dtype));
#endif
}

CopyEvent::CopyEvent() = default;
CopyEvent::~CopyEvent() = default;
CopyEvent::CopyEvent(const CopyEvent&) = default;
CopyEvent& CopyEvent::operator=(const CopyEvent&) = default;

void CopyEvent::block_current() const {
#ifdef DSRUN_WITH_CUDA
  if (impl_) impl_->event.block(c10::cuda::getCurrentCUDAStream(impl_->device));
#endif
}

void CopyEvent::synchronize() const {
#ifdef DSRUN_WITH_CUDA
  if (impl_) impl_->event.synchronize();
#endif
}

CopyEvent CopyEvent::on_current_stream(torch::Device device) {
  CopyEvent e;
#ifdef DSRUN_WITH_CUDA
  if (!device.is_cuda()) return e;
  e.impl_ = std::make_shared<CopyEvent::Impl>();
  e.impl_->device = device.index() < 0 ? c10::cuda::current_device() : device.index();
  e.impl_->event.record(c10::cuda::getCurrentCUDAStream(e.impl_->device));
#else
  (void)device;
#endif
  return e;
}

HostReadback read_back(const torch::Tensor& t) {
  HostReadback r;
  if (!t.is_cuda()) {
    r.host = t.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
    return r;
  }
  r.host = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
  r.host.copy_(t, /*non_blocking=*/true);
  r.arrived = CopyEvent::on_current_stream(t.device());
  return r;
}

CopyStream::CopyStream(torch::Device device) : impl_(std::make_unique<Impl>()) {
#ifdef DSRUN_WITH_CUDA
  if (device.is_cuda()) {
    impl_->device = device.index() < 0 ? c10::cuda::current_device() : device.index();
    impl_->stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, impl_->device);
  }
#else
  (void)device;
#endif
}

CopyStream::~CopyStream() = default;

void CopyStream::follow_current() {
#ifdef DSRUN_WITH_CUDA
  if (!impl_->stream) return;
  at::cuda::CUDAEvent queued;
  queued.record(c10::cuda::getCurrentCUDAStream(impl_->device));
  queued.block(*impl_->stream);
#endif
}

void CopyStream::run(const std::function<void()>& fn) {
#ifdef DSRUN_WITH_CUDA
  if (impl_->stream) {
    c10::cuda::CUDAStreamGuard on_this_stream(*impl_->stream);
    fn();
    return;
  }
#endif
  fn();
}

void CopyStream::keep_alive(const torch::Tensor& t) {
#ifdef DSRUN_WITH_CUDA
  if (impl_->stream && t.defined() && t.is_cuda()) t.record_stream(*impl_->stream);
#else
  (void)t;
#endif
}

CopyEvent CopyStream::record() {
  CopyEvent e;
#ifdef DSRUN_WITH_CUDA
  if (!impl_->stream) return e;
  e.impl_ = std::make_shared<CopyEvent::Impl>();
  e.impl_->device = impl_->device;
  e.impl_->event.record(*impl_->stream);
#endif
  return e;
}

}  // namespace dsrun
