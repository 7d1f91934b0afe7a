// Sizes every part of the extension agrees on.
#pragma once

namespace ep {

constexpr int kMaxRanks = 32;          // a warp's lanes hold one destination rank each
constexpr int kMaxLocalExperts = 256;  // shared-memory tables hold one entry per local expert
constexpr int kThreads = 512;          // threads per block of the register-copy data kernels

}  // namespace ep
