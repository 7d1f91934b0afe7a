// Host helpers for laying out regions in a symmetric buffer: offsets equal on every rank, each
// region 256-byte aligned, and the shape checks every backend's layout starts with.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ep/limits.h"

namespace ep {

inline int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

// Hands out consecutive 256-byte-aligned regions; `size()` is the bytes taken so far.
class RegionBuilder {
 public:
  int64_t take(int64_t bytes) {
    const int64_t at = offset_;
    offset_ = align_up(offset_ + bytes, 256);
    return at;
  }
  int64_t size() const { return offset_; }

 private:
  int64_t offset_ = 0;
};

// Throws std::invalid_argument naming `backend` on a shape its kernels do not support.
inline void check_backend_shape(const char* backend, int num_ranks, int max_tokens, int hidden, int num_local_experts,
                                int max_blocks) {
  const std::string who = std::string("ep_plugin ") + backend + ": ";
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument(who + "num_ranks must be in [1, " + std::to_string(kMaxRanks) + "]");
  if (num_local_experts < 1 || num_local_experts > kMaxLocalExperts)
    throw std::invalid_argument(who + "num_local_experts must be in [1, " + std::to_string(kMaxLocalExperts) + "]");
  if (hidden < 8 || hidden % 8) throw std::invalid_argument(who + "hidden must be a positive multiple of 8");
  if (max_tokens < 1 || max_blocks < 1) throw std::invalid_argument(who + "max_tokens and max_blocks >= 1");
}

// Throws std::invalid_argument "ep_plugin <backend>: <what>". The launch checks below call it only when a
// check fails: on every launch's path they build no string.
[[noreturn]] inline void refuse_launch(const char* backend, const std::string& what) {
  throw std::invalid_argument(std::string("ep_plugin ") + backend + ": " + what);
}

// Throws std::invalid_argument naming `backend` when a launch asks for more than its buffer was built for
// (the Python layer never does; this guards the extension's own API): blocks past max_blocks would raise
// done flags past their region, tokens past max_tokens would index rows past theirs.
template <typename Regions>
inline void check_launch_fits(const char* backend, const Regions& regions, int num_blocks, int num_tokens = 0) {
  if (num_blocks < 1 || num_blocks > regions.max_blocks)
    refuse_launch(backend, "num_blocks " + std::to_string(num_blocks) + " outside [1, max_blocks=" +
                               std::to_string(regions.max_blocks) + "] of this buffer");
  if (num_tokens < 0 || num_tokens > regions.max_tokens)
    refuse_launch(backend, "num_tokens " + std::to_string(num_tokens) + " outside [0, max_tokens=" +
                               std::to_string(regions.max_tokens) + "] of this buffer");
}

// Throws std::invalid_argument naming `backend` when a launch's rows do not fit what its kernels copy: rows of
// a positive multiple of 16 bytes (the vector and bulk copies' unit), scales of whole floats, a row and its
// scales within one staging slot of the buffer. The Python layer never asks otherwise; a row past its slot
// would overwrite the next token's, and the last one the region after it, which peers write.
template <typename Regions>
inline void check_rows_fit(const char* backend, const Regions& regions, int64_t row_bytes, int64_t scale_bytes) {
  if (row_bytes <= 0 || row_bytes % 16)
    refuse_launch(backend, "row_bytes " + std::to_string(row_bytes) + " is not a positive multiple of 16");
  if (scale_bytes < 0 || scale_bytes % 4)
    refuse_launch(backend, "scale_bytes " + std::to_string(scale_bytes) + " is not a multiple of 4");
  if (row_bytes + scale_bytes > regions.slot_bytes)
    refuse_launch(backend, "a row of " + std::to_string(row_bytes) + " + " + std::to_string(scale_bytes) +
                               " bytes is larger than this buffer's slot of " + std::to_string(regions.slot_bytes));
}

}  // namespace ep
