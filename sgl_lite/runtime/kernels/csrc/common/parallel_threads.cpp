// The OS thread ids of the threads that run torch's parallel regions (at::parallel_for), by thread number.
//
// Why: the thread governor (cpu_host/thread_governor.py) reads how long the threads running a
// forward waited for a CPU; the process's other threads (its event loop, tokenizers) wait too when it is
// busy, without slowing the forward. Their ids are only known from inside a parallel region.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

namespace {

std::vector<int64_t> parallel_thread_ids() {
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> ids(threads, -1);
  // One item per thread: with grain 1 each thread of the region takes at least one.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t number = at::get_thread_num();
    if (number >= 0 && number < threads) ids[number] = static_cast<int64_t>(syscall(SYS_gettid));
  });
  return ids;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) { m.def("parallel_thread_ids() -> int[]", &parallel_thread_ids); }
