// A minimal fork-join helper over a process-wide pool of worker threads: runs fn(i) for
// i in [0, count) on up to `threads` threads (the caller is one of them), handing out
// indices in order from a shared counter (callers sort work biggest first). Workers
// persist, so per-thread scratch buffers survive between calls.
#pragma once

#include <cstddef>
#include <functional>

namespace flywheel {

// Runs `job` on up to `helpers` pool threads as they become free. Jobs that start after
// `close()` has been observed must do nothing: see ParallelFor.
void SubmitToPool(size_t helpers, std::function<void()> job);

template <typename Fn>
void ParallelFor(size_t count, int threads, Fn&& fn);

}  // namespace flywheel

#include "checkpoint/parallel_impl.h"
