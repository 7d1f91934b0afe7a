// DeviceScope and check_cuda (csrc/include/ep/check.cuh) against a stand-in for the five CUDA runtime calls
// they make, so that their logic runs on a machine with one GPU or none: the real two-GPU check is
// tests/test_streams.py::test_ops_leave_the_callers_current_device_on_two_gpus. Built and run by
// tests/test_device_scope.py; prints "ok" and exits 0, or names the first check that failed and exits 1.
#include <cstdio>
#include <new>
#include <stdexcept>

#include "ep/check.cuh"

namespace {
int current_device = 0;
int device_count = 2;
int set_calls = 0;
cudaError_t last_error = cudaSuccess;  // as the runtime keeps it: set by a failed call, cleared when read
}  // namespace

// The stand-in runtime: a current device per process and a count of cudaSetDevice calls.
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  ++set_calls;
  if (device < 0 || device >= device_count) return last_error = cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  const cudaError_t error = last_error;
  last_error = cudaSuccess;
  return error;
}
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorInvalidDevice"; }
const char* cudaGetErrorString(cudaError_t) { return "invalid device ordinal"; }

#define EXPECT(condition)                                                    \
  do {                                                                       \
    if (!(condition)) {                                                      \
      std::printf("failed at line %d: %s\n", __LINE__, #condition);         \
      return 1;                                                              \
    }                                                                        \
  } while (0)

int main() {
  // Another device is current: the scope makes ours current, then gives the caller's back.
  current_device = 0, set_calls = 0;
  {
    const ep::DeviceScope scope(1);
    EXPECT(current_device == 1);
  }
  EXPECT(current_device == 0);
  EXPECT(set_calls == 2);

  // Ours is current already: no call at all (most launches).
  current_device = 1, set_calls = 0;
  { const ep::DeviceScope scope(1); }
  EXPECT(current_device == 1 && set_calls == 0);

  // The release paths' variant does the same.
  current_device = 0, set_calls = 0;
  {
    const ep::DeviceScope scope(1, std::nothrow);
    EXPECT(current_device == 1);
  }
  EXPECT(current_device == 0 && set_calls == 2);

  // A device that cannot be made current: the scope throws, and the caller's device stays.
  current_device = 0, set_calls = 0;
  bool threw = false;
  try {
    const ep::DeviceScope scope(5);
  } catch (const std::runtime_error&) {
    threw = true;
  }
  EXPECT(threw && current_device == 0 && set_calls == 1);
  // The error it raised is not left as the runtime's last error either: the next launch's
  // cudaGetLastError() would report it again, as that launch's own failure.
  EXPECT(cudaGetLastError() == cudaSuccess);

  // ...while the release paths' variant goes on, and gives back nothing it did not change.
  {
    const ep::DeviceScope scope(5, std::nothrow);
  }
  EXPECT(current_device == 0 && set_calls == 2);

  std::printf("ok\n");
  return 0;
}
