// What more than one kernel family under engine/model/kernels/ uses: the block-wide sum, the grid
// sizes of the grid-stride and row-wise launches, and note_launch (defined once, in launch.cu).
// The kernels behind fused_kernels.h read their inputs once and write their outputs once, with
// arithmetic in fp32; compiled only for CUDA builds (CMakeLists.txt), no torch headers.
#pragma once

#include <cstdint>

namespace dsrun_kernels {

// Sum over the block; every thread gets the total. `shared` holds one float per warp.
inline __device__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

// Blocks for the grid-stride kernels: one element a thread, up to 32 blocks per SM of an H100.
inline int grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<int>(blocks < 132 * 32 ? (blocks > 0 ? blocks : 1) : 132 * 32);  // grid-stride beyond 32 blocks/SM
}

// Blocks for the row-wise kernels: a row each, up to 16 per SM of an H100; beyond, blocks walk rows.
inline int row_blocks(int64_t rows) { return static_cast<int>(rows < 132 * 16 ? (rows > 0 ? rows : 1) : 132 * 16); }

// Records the last launch's error (cudaGetLastError) for dsrun_fused_last_error; every entry point
// calls it after its launches. Defined in launch.cu.
void note_launch();

}  // namespace dsrun_kernels
