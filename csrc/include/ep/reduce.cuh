// Row sums in fp32: what both combines use to add a token's rows (expert side and source side).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ep/copy.cuh"

namespace ep {

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& word) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&word);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  int4 word;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&word);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return word;
}

// acc[u] += row(n)[i0 + 32 u] for n < count (16-byte words of 8 bf16, words < `words`), in n order,
// in fp32. Each lane loads kSumUnroll words of kSumRows rows before adding them, so a warp keeps
// 8 KiB of loads in flight.
constexpr int kSumUnroll = 4;
constexpr int kSumRows = 4;

template <typename Row>
__device__ __forceinline__ void add_rows(float (&acc)[kSumUnroll][8], int64_t i0, int words, int count, Row row) {
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int n0 = 0; n0 < count; n0 += kSumRows) {
    int4 w[kSumRows][kSumUnroll];
#pragma unroll
    for (int m = 0; m < kSumRows; ++m) {
      const int4* r = n0 + m < count ? row(n0 + m) : nullptr;
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const int64_t i = i0 + 32 * u;
        w[m][u] = (r != nullptr && i < words) ? r[i] : zero;
      }
    }
#pragma unroll
    for (int m = 0; m < kSumRows; ++m) {
      if (n0 + m < count) {
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u) add_bf16x8(acc[u], w[m][u]);
      }
    }
  }
}

// out[i0 + 32 u] = bf16(acc[u]) for the words in range.
__device__ __forceinline__ void store_sums(int4* out, const float (&acc)[kSumUnroll][8], int64_t i0, int words) {
#pragma unroll
  for (int u = 0; u < kSumUnroll; ++u) {
    if (i0 + 32 * u < words) out[i0 + 32 * u] = pack_bf16x8(acc[u]);
  }
}

// out[i] = bf16(sum over n < count of row(n)[i]) for i < words, summed in fp32 in n order; a
// single row is a plain copy (bf16 -> fp32 -> bf16 is exact).
template <typename Row>
__device__ __forceinline__ void sum_rows(int4* out, int words, int count, Row row, int lane) {
  if (count == 1) {
    warp_copy16(out, row(0), static_cast<int64_t>(words) * 16, lane);
    return;
  }
  for (int i0 = lane; i0 < words; i0 += 32 * kSumUnroll) {
    float acc[kSumUnroll][8] = {};
    add_rows(acc, i0, words, count, row);
    store_sums(out, acc, i0, words);
  }
}

}  // namespace ep
