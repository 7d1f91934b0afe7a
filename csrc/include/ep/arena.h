// The combine-input arena: memory inside a rank's symmetric buffer that torch's caching allocator
// may hand out, so that a tensor an expert computes with ordinary torch ops already lies where the
// peers can read it (an in-place combine needs no copy).
//
// torch routes allocations to one of its MemPools through a pluggable allocator: two C functions
// it looks up by name in this library (ep_arena_alloc / ep_arena_free below) and calls whenever the
// pool wants a new segment or gives one back. Each arena is a few "parts" (address ranges of a
// buffer, registered from Python); a segment request is served by the smallest free part of the
// arena selected on the calling thread that fits, and otherwise by a plain cudaMalloc, so torch
// never sees an out-of-memory error because of us. A part is never cudaFree'd: its buffer owns it.
// Only what this file cudaMalloc'd is cudaFree'd.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

extern "C" {
// The pool's segment allocator (torch's CUDAPluggableAllocator signature).
__attribute__((visibility("default"))) void* ep_arena_alloc(size_t size, int device, cudaStream_t stream);
__attribute__((visibility("default"))) void ep_arena_free(void* ptr, size_t size, int device, cudaStream_t stream);
}

namespace ep {
namespace arena {

// (address, bytes) of each part; `id` > 0, unique per arena.
void register_arena(uint64_t id, int device, const std::vector<std::pair<uintptr_t, int64_t>>& parts);
// Forget the arena (its buffer goes away). A part the pool still holds is simply dropped when the
// pool gives it back.
void unregister_arena(uint64_t id);
// The arena that segment requests of this thread go to (0 = none: cudaMalloc); returns the one
// selected before (so that nested selections restore it).
uint64_t select_arena(uint64_t id);
// Parts of the arena lent to a pool right now (for tests and diagnostics).
int lent_parts(uint64_t id);
// Segments cudaMalloc'd while the arena was selected and full, not given back yet.
int fallback_segments(uint64_t id);

}  // namespace arena
}  // namespace ep
