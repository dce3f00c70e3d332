// Launch cost for the overhead target (issue 4: at limit 100 or unset, preloaded / native <= 1.02).
//     launch_overhead <blocks> <launches per block> <grid>
// Launches an empty kernel through the runtime (so through cuLaunchKernel, hooked when preloaded)
// in blocks, synchronising every 1024 launches, and prints the median block's ns per launch:
//     launch_ns <ns>
// tests/gpu/overhead.sh runs it in interleaved native / preloaded runs pinned to one CPU.
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cuda_check.cuh"

__global__ void empty_kernel() {}


static double now_ns() {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char **argv) {
  int blocks = argc > 1 ? atoi(argv[1]) : 7;
  int per_block = argc > 2 ? atoi(argv[2]) : 20000;
  int grid = argc > 3 ? atoi(argv[3]) : 1;
  CHECK(cudaFree(0));
  for (int i = 0; i < 4096; i++) empty_kernel<<<grid, 32>>>();
  CHECK(cudaDeviceSynchronize());
  std::vector<double> per_launch;
  for (int b = 0; b < blocks; b++) {
    double t0 = now_ns();
    for (int i = 0; i < per_block; i++) {
      empty_kernel<<<grid, 32>>>();
      if ((i & 1023) == 1023) CHECK(cudaStreamSynchronize(0));
    }
    CHECK(cudaDeviceSynchronize());
    per_launch.push_back((now_ns() - t0) / per_block);
  }
  std::sort(per_launch.begin(), per_launch.end());
  printf("launch_ns %.1f\n", per_launch[per_launch.size() / 2]);
  return 0;
}
