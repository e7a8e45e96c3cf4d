// Multi-process data parallel through torch's own c10d (Gloo on CPU): every rank holds the
// whole model, runs forward_backward on its own share of the batch, and optim_step sums the
// gradients and the accumulation normalisers over all ranks before the AdamW update, so
// the ranks step exactly as one process would on the union of their batches (up to float
// summation order) and stay identical.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::trainer {

struct DataParallelOptions {
  // Rendezvous: "tcp://HOST:PORT" (rank 0 listens there, the others connect) or
  // "file:///path/to/file" (a file every rank can reach; it must not exist beforehand).
  std::string init_method;
  int rank = 0;
  int world_size = 1;
  std::string interface_host = "127.0.0.1";  // address Gloo binds for its transport
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
};

class DataParallel {
 public:
  // Joins the group; blocks until every rank arrives or the timeout passes.
  static Result<std::unique_ptr<DataParallel>> Join(const DataParallelOptions& options);
  ~DataParallel();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Sums `tensors` (fp32/fp64, any shapes) across ranks in place, as one flat buffer.
  Status AllReduceSum(std::vector<torch::Tensor>& tensors);
  // Overwrites `tensors` on every rank with rank 0's values.
  Status Broadcast(std::vector<torch::Tensor>& tensors);

 private:
  struct Impl;
  explicit DataParallel(std::unique_ptr<Impl> impl, int rank, int world_size);
  std::unique_ptr<Impl> impl_;
  int rank_, world_size_;
};

}  // namespace flywheel::trainer
