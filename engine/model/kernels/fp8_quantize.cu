// FP8 operands for scaled matrix products (engine/model/fp8_linear): the maxima of a bf16 matrix
// (per row, per column, whole), then the matrix and its transpose quantised in one pass.
#include "engine/model/fused_kernels.h"
#include "engine/model/kernels/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace {

using namespace dsrun_kernels;

// A tile of 64 rows x 64 columns a block of 256 threads: 8 threads a row, each 8 adjacent
// elements (one 16-byte load; a row's 64 elements are 128 contiguous bytes), 32 rows at a time. The
// first versions (two elements a thread) ran far below memory bandwidth: 32 ms of the ~1B's 150 ms
// FP8 step on an H200, most of the quantisation's cost.
constexpr int kTile = 64, kThreads = 256, kVec = 8, kRowsAtOnce = kThreads / (kTile / kVec);

// Maxima of |x| of non-negative floats: their bit patterns order as unsigned integers do.
__device__ inline void atomic_max_nonnegative(float* at, float v) { atomicMax(reinterpret_cast<unsigned int*>(at), __float_as_uint(v)); }

// Eight bf16 of one 16-byte word as floats.
__device__ inline void unpack8(const uint4& raw, float* v) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(pairs[j]);
    v[2 * j] = f.x;
    v[2 * j + 1] = f.y;
  }
}

// Eight bf16 from x (16-byte aligned: cols a multiple of 8, checked by the caller) as floats.
__device__ inline void load8(const __nv_bfloat16* x, float* v) { unpack8(*reinterpret_cast<const uint4*>(x), v); }

// The tile's elements, each thread's eight of its rows r0 + i·32 + t/8, columns c0 + (t%8)·8 (zeros outside).
struct TileLoad {
  float v[kTile / kRowsAtOnce][kVec];
};

__device__ inline void load_tile(const __nv_bfloat16* x, int64_t rows, int64_t cols, int64_t r0, int64_t c0, TileLoad& t) {
  const int row_in = threadIdx.x / (kTile / kVec), col_in = (threadIdx.x % (kTile / kVec)) * kVec;
#pragma unroll
  for (int i = 0; i < kTile / kRowsAtOnce; ++i) {
    const int64_t r = r0 + i * kRowsAtOnce + row_in, c = c0 + col_in;
    if (r < rows && c < cols) {
      load8(x + r * cols + c, t.v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) t.v[i][j] = 0;
    }
  }
}

// blockIdx.z: which of the matrices lying one after another (each its own row and column maxima).
__global__ void __launch_bounds__(kThreads) amax_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax,
                                                        float* tensor_amax) {
  __shared__ float columns[kRowsAtOnce][kTile + 1];
  __shared__ float warps[kThreads / 32];
  x += blockIdx.z * rows * cols;
  if (row_amax) row_amax += blockIdx.z * rows;
  if (col_amax) col_amax += blockIdx.z * cols;
  const int64_t r0 = blockIdx.y * int64_t{kTile}, c0 = blockIdx.x * int64_t{kTile};
  TileLoad t;
  load_tile(x, rows, cols, r0, c0, t);
  const int row_in = threadIdx.x / (kTile / kVec), col_in = (threadIdx.x % (kTile / kVec)) * kVec;
  float col[kVec], all = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) col[j] = 0;
#pragma unroll
  for (int i = 0; i < kTile / kRowsAtOnce; ++i) {
    float m = 0;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float a = fabsf(t.v[i][j]);
      m = fmaxf(m, a);
      col[j] = fmaxf(col[j], a);
    }
    all = fmaxf(all, m);
    if (row_amax) {  // the row's 8 threads are adjacent lanes of one warp
#pragma unroll
      for (int o = 1; o < kTile / kVec; o *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const int64_t r = r0 + i * kRowsAtOnce + row_in;
      if (threadIdx.x % (kTile / kVec) == 0 && r < rows) atomic_max_nonnegative(row_amax + r, m);
    }
  }
  if (col_amax) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) columns[row_in][col_in + j] = col[j];
    __syncthreads();
    if (threadIdx.x < kTile && c0 + threadIdx.x < cols) {
      float m = 0;
      for (int w = 0; w < kRowsAtOnce; ++w) m = fmaxf(m, columns[w][threadIdx.x]);
      atomic_max_nonnegative(col_amax + c0 + threadIdx.x, m);
    }
  }
  if (tensor_amax) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) all = fmaxf(all, __shfl_xor_sync(0xffffffffu, all, o));
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = all;
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = 0;
      for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, warps[w]);
      atomic_max_nonnegative(tensor_amax, m);
    }
  }
}

// The largest finite value of each FP8 kind (E4M3 "fn": 448; E5M2: 57344), and the smallest maximum
// a scale is taken from (an all-zero row scales by 448 / 1e-12 and stays zero).
__device__ inline float fp8_max(int kind) { return kind == 0 ? 448.0f : 57344.0f; }
constexpr float kAmaxFloor = 1e-12f;

__device__ inline uint16_t to_fp8x2(float a, float b, int kind) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind == 0 ? __NV_E4M3 : __NV_E5M2);
}

// Eight values scaled, as eight FP8 bytes in one 8-byte word.
__device__ inline uint2 to_fp8x8(const float* v, float s, int kind) {
  uint2 out;
  out.x = to_fp8x2(v[0] * s, v[1] * s, kind) | (static_cast<uint32_t>(to_fp8x2(v[2] * s, v[3] * s, kind)) << 16);
  out.y = to_fp8x2(v[4] * s, v[5] * s, kind) | (static_cast<uint32_t>(to_fp8x2(v[6] * s, v[7] * s, kind)) << 16);
  return out;
}

// q = x · (max / amax) as FP8 in x's layout and qt the same of xᵀ; rowwise: q's scale per row of x
// (amax_q[r]) and qt's per column (amax_t[c]); tensorwise: both amax_q[0]. Inverse scales (what the
// product multiplies back by) go to inv_q and inv_t (tensorwise: inv_q[0] alone). qt's rows are
// written 8 bytes a thread (8 rows of one column of x), 64 contiguous bytes by 8 adjacent threads.
// blockIdx.z (rowwise): which of the matrices lying one after another, each scaled by its own maxima.
__global__ void __launch_bounds__(kThreads) quantize_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, int kind, int rowwise,
                                                            const float* amax_q, const float* amax_t, uint8_t* q, uint8_t* qt, float* inv_q, float* inv_t) {
  __shared__ float tile[kTile][kTile + 1];
  if (blockIdx.z > 0) {
    const int64_t z = blockIdx.z;
    x += z * rows * cols;
    if (q) q += z * rows * cols;
    if (qt) qt += z * rows * cols;
    if (amax_q) amax_q += z * rows;
    if (amax_t) amax_t += z * cols;
    if (inv_q) inv_q += z * rows;
    if (inv_t) inv_t += z * cols;
  }
  const int64_t r0 = blockIdx.y * int64_t{kTile}, c0 = blockIdx.x * int64_t{kTile};
  const int row_in = threadIdx.x / (kTile / kVec), col_in = (threadIdx.x % (kTile / kVec)) * kVec;
  const float top = fp8_max(kind);
  const float whole = rowwise ? 0.0f : top / fmaxf(amax_q[0], kAmaxFloor);
  if (!rowwise && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) inv_q[0] = fmaxf(amax_q[0], kAmaxFloor) / top;
  TileLoad t;
  load_tile(x, rows, cols, r0, c0, t);
#pragma unroll
  for (int i = 0; i < kTile / kRowsAtOnce; ++i) {
    const int64_t r = r0 + i * kRowsAtOnce + row_in, c = c0 + col_in;
    if (q && r < rows && c < cols) {
      const float s = rowwise ? top / fmaxf(amax_q[r], kAmaxFloor) : whole;
      *reinterpret_cast<uint2*>(q + r * cols + c) = to_fp8x8(t.v[i], s, kind);
    }
    if (rowwise && inv_q && c0 == 0 && col_in == 0 && r < rows) inv_q[r] = fmaxf(amax_q[r], kAmaxFloor) / top;
    if (qt) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) tile[i * kRowsAtOnce + row_in][col_in + j] = t.v[i][j];
    }
  }
  if (!qt) return;
  __syncthreads();
  // qt [cols, rows]: thread t takes column c0 + t/8 (and + 32), rows r0 + (t%8)·8 .. + 8.
  const int rows_in = (threadIdx.x % (kTile / kVec)) * kVec;
#pragma unroll
  for (int k = 0; k < kTile / kRowsAtOnce; ++k) {
    const int j = k * kRowsAtOnce + threadIdx.x / (kTile / kVec);
    const int64_t cc = c0 + j, rr = r0 + rows_in;
    if (cc >= cols || rr >= rows) continue;
    const float s = rowwise ? top / fmaxf(amax_t[cc], kAmaxFloor) : whole;
    float v[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = tile[rows_in + e][j];
    *reinterpret_cast<uint2*>(qt + cc * rows + rr) = to_fp8x8(v, s, kind);  // rows a multiple of 8: checked by the caller
    if (rowwise && inv_t && r0 == 0 && rows_in == 0) inv_t[cc] = fmaxf(amax_t[cc], kAmaxFloor) / top;
  }
}

// Blockwise (DeepSeek-V3's scaling): one 128 x 128 tile of x a block of 256 threads, read once.
// square = 0: q's scale per 1 x 128 block of a row (inv_q column-major [rows, cols / 128]: (c / 128)
// · rows + r) and qt's per 128 rows of a column (inv_t column-major [cols, rows / 128]: (r / 128) ·
// cols + c), the layouts torch's scaled product reads; square = 1: the tile's one scale for both
// (inv_q row-major [rows / 128, cols / 128], inv_t its transpose). The libtorch expressions these
// replace (a pass each for the maximum, the scale, the rounding, the layout) took 0.9 s of 1.28 s
// over 3 traced steps of the ~1B on an H200: blockwise ran at 0.41x bf16.
constexpr int kBlock = 128, kBlockRowsAtOnce = kThreads / (kBlock / kVec);  // 16 threads a row of the tile, 16 rows at once
// Shared rows of 130 bf16 (65 words): a column read by adjacent lanes touches consecutive words.
constexpr int kBlockStride = kBlock + 2;

__global__ void __launch_bounds__(kThreads) quantize_blocks_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, int kind, int square,
                                                                   uint8_t* q, uint8_t* qt, float* inv_q, float* inv_t) {
  __shared__ __align__(16) __nv_bfloat16 tile[kBlock][kBlockStride];  // (bf162 stores: 4-byte aligned rows of 260 bytes)
  __shared__ float column_half[2][kBlock];
  __shared__ float warps[kThreads / 32];
  const int64_t r0 = blockIdx.y * int64_t{kBlock}, c0 = blockIdx.x * int64_t{kBlock};
  const int lane = threadIdx.x % (kBlock / kVec), row_in = threadIdx.x / (kBlock / kVec);
  const float top = fp8_max(kind);
  float v[kBlock / kBlockRowsAtOnce][kVec], row_amax[kBlock / kBlockRowsAtOnce], all = 0;
#pragma unroll
  for (int i = 0; i < kBlock / kBlockRowsAtOnce; ++i) {
    const int r = i * kBlockRowsAtOnce + row_in;
    load8(x + (r0 + r) * cols + c0 + lane * kVec, v[i]);
    float m = 0;
#pragma unroll
    for (int j = 0; j < kVec; j += 2) {
      *reinterpret_cast<__nv_bfloat162*>(&tile[r][lane * kVec + j]) = __floats2bfloat162_rn(v[i][j], v[i][j + 1]);  // exact: x is bf16
      m = fmaxf(m, fmaxf(fabsf(v[i][j]), fabsf(v[i][j + 1])));
    }
    // The row's 16 threads are adjacent lanes of one warp.
#pragma unroll
    for (int o = 1; o < kBlock / kVec; o *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    row_amax[i] = m;
    all = fmaxf(all, m);
  }
  float tile_amax = 0;
  if (square) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) all = fmaxf(all, __shfl_xor_sync(0xffffffffu, all, o));
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = all;
  }
  __syncthreads();  // the tile, and the warps' maxima
  if (square) {
    for (int w = 0; w < kThreads / 32; ++w) tile_amax = fmaxf(tile_amax, warps[w]);
    tile_amax = fmaxf(tile_amax, kAmaxFloor);
    if (threadIdx.x == 0) {
      if (inv_q) inv_q[blockIdx.y * int64_t{gridDim.x} + blockIdx.x] = tile_amax / top;
      if (inv_t) inv_t[blockIdx.x * int64_t{gridDim.y} + blockIdx.y] = tile_amax / top;
    }
  }
  if (q) {
#pragma unroll
    for (int i = 0; i < kBlock / kBlockRowsAtOnce; ++i) {
      const int64_t r = r0 + i * kBlockRowsAtOnce + row_in;
      const float amax = square ? tile_amax : fmaxf(row_amax[i], kAmaxFloor);
      *reinterpret_cast<uint2*>(q + r * cols + c0 + lane * kVec) = to_fp8x8(v[i], top / amax, kind);
      if (!square && lane == 0) inv_q[blockIdx.x * rows + r] = amax / top;
    }
  }
  if (!qt) return;
  if (!square) {  // each column's maximum over the tile's 128 rows: two threads a column, 64 rows each
    const int j = threadIdx.x % kBlock, half = threadIdx.x / kBlock;
    float m = 0;
    for (int e = 0; e < kBlock / 2; ++e) m = fmaxf(m, fabsf(__bfloat162float(tile[half * (kBlock / 2) + e][j])));
    column_half[half][j] = m;
    __syncthreads();
  }
  // qt [cols, rows]: column c0 + j of x as 128 contiguous bytes, 8 a thread (rows r0 + lane·8 ..).
#pragma unroll
  for (int k = 0; k < kBlock / kBlockRowsAtOnce; ++k) {
    const int j = k * kBlockRowsAtOnce + row_in;
    const float amax = square ? tile_amax : fmaxf(fmaxf(column_half[0][j], column_half[1][j]), kAmaxFloor);
    float w[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) w[e] = __bfloat162float(tile[lane * kVec + e][j]);
    *reinterpret_cast<uint2*>(qt + (c0 + j) * rows + r0 + lane * kVec) = to_fp8x8(w, top / amax, kind);
    if (!square && lane == 0) inv_t[blockIdx.y * cols + c0 + j] = amax / top;
  }
}

// Rowwise without a transpose, in one pass: a warp a row, each lane keeping its 16-byte words of
// the row in registers (at most kChunks of them: rows of up to 32 · 8 · kChunks elements) between the
// maximum and the scaling. The two-pass pair above reads x twice (5 bytes an element against 3):
// the routed experts' operands, quantised for every routed row of every MoE layer, are where that
// showed (docs/benchmarks.md, 2026-11-28).
template <int kChunks>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, int kind, uint8_t* q, float* inv_q) {
  const int lane = threadIdx.x % 32;
  const int64_t r = blockIdx.x * int64_t{kThreads / 32} + threadIdx.x / 32;
  if (r >= rows) return;
  const __nv_bfloat16* row = x + r * cols;
  const int64_t words = cols / kVec;
  uint4 raw[kChunks];
  float m = 0;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t w = i * 32 + lane;
    if (w < words) {
      raw[i] = *reinterpret_cast<const uint4*>(row + w * kVec);
      float v[kVec];
      unpack8(raw[i], v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) m = fmaxf(m, fabsf(v[j]));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float top = fp8_max(kind), amax = fmaxf(m, kAmaxFloor), s = top / amax;
  if (lane == 0) inv_q[r] = amax / top;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t w = i * 32 + lane;
    if (w < words) {
      float v[kVec];
      unpack8(raw[i], v);
      *reinterpret_cast<uint2*>(q + r * cols + w * kVec) = to_fp8x8(v, s, kind);
    }
  }
}

dim3 tiles(int64_t rows, int64_t cols, int64_t batch) {
  return dim3(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile), static_cast<unsigned>(batch));
}

}  // namespace

extern "C" {

void dsrun_fp8_amax(const void* x, int64_t batch, int64_t rows, int64_t cols, float* row_amax, float* col_amax, float* tensor_amax, cudaStream_t stream) {
  if (row_amax) cudaMemsetAsync(row_amax, 0, sizeof(float) * batch * rows, stream);
  if (col_amax) cudaMemsetAsync(col_amax, 0, sizeof(float) * batch * cols, stream);
  if (tensor_amax) cudaMemsetAsync(tensor_amax, 0, sizeof(float), stream);
  if (batch > 0 && rows > 0 && cols > 0)
    amax_kernel<<<tiles(rows, cols, batch), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols, row_amax, col_amax, tensor_amax);
  note_launch();
}

void dsrun_fp8_quantize(const void* x, int64_t batch, int64_t rows, int64_t cols, int kind, int rowwise, const float* amax_q, const float* amax_t,
                        void* q, void* qt, float* inv_q, float* inv_t, cudaStream_t stream) {
  if (batch > 0 && rows > 0 && cols > 0)
    quantize_kernel<<<tiles(rows, cols, rowwise ? batch : 1), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols, kind, rowwise, amax_q, amax_t,
                                                           static_cast<uint8_t*>(q), static_cast<uint8_t*>(qt), inv_q, inv_t);
  note_launch();
}

int64_t dsrun_fp8_quantize_rows_max_cols(void) { return int64_t{32} * kVec * 16; }

void dsrun_fp8_quantize_rows(const void* x, int64_t rows, int64_t cols, int kind, void* q, float* inv_q, cudaStream_t stream) {
  // Wider rows would not fit the registers: the caller takes the two-pass kernels (fp8_linear.cpp).
  if (cols > dsrun_fp8_quantize_rows_max_cols()) __builtin_trap();
  if (rows > 0 && cols > 0) {
    const unsigned blocks = static_cast<unsigned>((rows + kThreads / 32 - 1) / (kThreads / 32));
    const int64_t per_lane = (cols / kVec + 31) / 32;
    const auto* in = static_cast<const __nv_bfloat16*>(x);
    auto* out = static_cast<uint8_t*>(q);
    if (per_lane <= 4) quantize_rows_kernel<4><<<blocks, kThreads, 0, stream>>>(in, rows, cols, kind, out, inv_q);
    else if (per_lane <= 8) quantize_rows_kernel<8><<<blocks, kThreads, 0, stream>>>(in, rows, cols, kind, out, inv_q);
    else quantize_rows_kernel<16><<<blocks, kThreads, 0, stream>>>(in, rows, cols, kind, out, inv_q);
  }
  note_launch();
}

void dsrun_fp8_quantize_blocks(const void* x, int64_t rows, int64_t cols, int kind, int square, void* q, void* qt, float* inv_q, float* inv_t,
                               cudaStream_t stream) {
  if (rows > 0 && cols > 0)
    quantize_blocks_kernel<<<dim3(static_cast<unsigned>(cols / kBlock), static_cast<unsigned>(rows / kBlock)), kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), rows, cols, kind, square, static_cast<uint8_t*>(q), static_cast<uint8_t*>(qt), inv_q, inv_t);
  note_launch();
}
}
