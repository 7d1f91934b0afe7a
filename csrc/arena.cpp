// The combine-input arena's segment allocator (see ep/arena.h). torch calls these with its own
// allocator lock held, from any thread; one mutex guards the tables here.
#include "ep/arena.h"

#include <map>
#include <mutex>
#include <unordered_map>

namespace ep {
namespace arena {
namespace {

struct Part {
  uintptr_t address;
  int64_t bytes;
  bool lent;  // handed to the pool as a segment and not given back yet
};

struct Arena {
  int device;
  std::vector<Part> parts;
};

std::mutex g_mutex;
std::map<uint64_t, Arena> g_arenas;
// What ep_arena_alloc cudaMalloc'd (only that is cudaFree'd), with the arena selected then.
std::unordered_map<void*, uint64_t> g_fallback;
thread_local uint64_t t_selected = 0;

// The smallest free part of `arena` with room for `size`, or null.
Part* best_part(Arena& arena, size_t size) {
  Part* best = nullptr;
  for (Part& part : arena.parts) {
    if (!part.lent && static_cast<size_t>(part.bytes) >= size && (best == nullptr || part.bytes < best->bytes)) {
      best = &part;
    }
  }
  return best;
}

}  // namespace

void register_arena(uint64_t id, int device, const std::vector<std::pair<uintptr_t, int64_t>>& parts) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Arena arena{device, {}};
  for (const auto& [address, bytes] : parts) arena.parts.push_back({address, bytes, false});
  g_arenas[id] = arena;
}

void unregister_arena(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_arenas.erase(id);
}

uint64_t select_arena(uint64_t id) {
  const uint64_t previous = t_selected;
  t_selected = id;
  return previous;
}

int fallback_segments(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  int count = 0;
  for (const auto& [ptr, arena] : g_fallback) count += arena == id ? 1 : 0;
  return count;
}

int lent_parts(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto found = g_arenas.find(id);
  int lent = 0;
  if (found != g_arenas.end()) {
    for (const Part& part : found->second.parts) lent += part.lent ? 1 : 0;
  }
  return lent;
}

}  // namespace arena
}  // namespace ep

extern "C" void* ep_arena_alloc(size_t size, int device, cudaStream_t /*stream*/) {
  using namespace ep::arena;
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto found = g_arenas.find(t_selected);
  if (found != g_arenas.end() && found->second.device == device) {
    if (Part* part = best_part(found->second, size)) {
      part->lent = true;
      return reinterpret_cast<void*>(part->address);
    }
  }
  // No arena, or none of it free: ordinary device memory (torch's device is current here).
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, size) != cudaSuccess) {
    (void)cudaGetLastError();  // torch reports the out-of-memory error itself
    return nullptr;
  }
  g_fallback.emplace(ptr, t_selected);
  return ptr;
}

extern "C" void ep_arena_free(void* ptr, size_t /*size*/, int /*device*/, cudaStream_t /*stream*/) {
  using namespace ep::arena;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_fallback.erase(ptr)) {
    // Nothing to report a failure to (torch frees through us); not left as the runtime's last error either,
    // where the next kernel launch's check would take it for its own.
    if (cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
    return;
  }
  for (auto& [id, arena] : g_arenas) {
    for (Part& part : arena.parts) {
      if (reinterpret_cast<void*>(part.address) == ptr) part.lent = false;
    }
  }
}
