#include "trainer/data_parallel.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace flywheel::trainer {

struct DataParallel::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
};

namespace {

// Flattens `tensors` into one fp32/fp64 buffer per dtype, runs `op` on it, copies back.
template <typename Op>
Status Flat(std::vector<torch::Tensor>& tensors, const char* what, Op op) {
  if (tensors.empty()) return Status::Ok();
  try {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : tensors) flat_parts.push_back(t.detach().reshape({-1}).to(torch::kDouble));
    torch::Tensor flat = torch::cat(flat_parts);
    std::vector<torch::Tensor> buffers{flat};
    op(buffers);
    int64_t offset = 0;
    torch::NoGradGuard no_grad;
    for (auto& t : tensors) {
      const int64_t n = t.numel();
      t.copy_(buffers[0].narrow(0, offset, n).view(t.sizes()).to(t.scalar_type()));
      offset += n;
    }
  } catch (const std::exception& e) {
    return Status::Unavailable(std::string("data parallel ") + what + " failed: " + e.what());
  }
  return Status::Ok();
}

}  // namespace

DataParallel::DataParallel(std::unique_ptr<Impl> impl, int rank, int world_size)
    : impl_(std::move(impl)), rank_(rank), world_size_(world_size) {}
DataParallel::~DataParallel() = default;

Result<std::unique_ptr<DataParallel>> DataParallel::Join(const DataParallelOptions& options) {
  if (options.world_size < 1) {
    return Status::InvalidArgument("data parallel: world size must be >= 1, got " +
                                   std::to_string(options.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return Status::InvalidArgument("data parallel: rank " + std::to_string(options.rank) +
                                   " is outside [0, " + std::to_string(options.world_size) + ")");
  }
  auto impl = std::make_unique<Impl>();
  const std::string& init = options.init_method;
  try {
    if (init.rfind("file://", 0) == 0) {
      impl->store = c10::make_intrusive<c10d::FileStore>(init.substr(7), options.world_size);
    } else if (init.rfind("tcp://", 0) == 0) {
      const std::string address = init.substr(6);
      const size_t colon = address.rfind(':');
      if (colon == std::string::npos || colon == 0) {
        return Status::InvalidArgument("data parallel: init method '" + init + "' lacks HOST:PORT");
      }
      int port = 0;
      try {
        port = std::stoi(address.substr(colon + 1));
      } catch (const std::exception&) {
        port = -1;
      }
      if (port <= 0 || port > 65535) {
        return Status::InvalidArgument("data parallel: bad port in init method '" + init + "'");
      }
      c10d::TCPStoreOptions store_options;
      store_options.port = static_cast<uint16_t>(port);
      store_options.isServer = options.rank == 0;
      store_options.numWorkers = static_cast<size_t>(options.world_size);
      store_options.timeout = options.timeout;
      impl->store = c10::make_intrusive<c10d::TCPStore>(address.substr(0, colon), store_options);
    } else {
      return Status::InvalidArgument("data parallel: init method '" + init +
                                     "' must start with tcp:// or file://");
    }
    impl->store->setTimeout(options.timeout);
    auto gloo = c10d::ProcessGroupGloo::Options::create(options.timeout);
    gloo->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(options.interface_host));
    impl->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, options.rank,
                                                              options.world_size, gloo);
  } catch (const std::exception& e) {
    return Status::Unavailable("data parallel: joining " + init + " as rank " +
                               std::to_string(options.rank) + " of " +
                               std::to_string(options.world_size) + " failed: " + e.what());
  }
  return std::unique_ptr<DataParallel>(
      new DataParallel(std::move(impl), options.rank, options.world_size));
}

Status DataParallel::AllReduceSum(std::vector<torch::Tensor>& tensors) {
  return Flat(tensors, "all-reduce", [&](std::vector<torch::Tensor>& buffers) {
    impl_->group->allreduce(buffers)->wait();
  });
}

Status DataParallel::Broadcast(std::vector<torch::Tensor>& tensors) {
  return Flat(tensors, "broadcast", [&](std::vector<torch::Tensor>& buffers) {
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    impl_->group->broadcast(buffers, options)->wait();
  });
}

}  // namespace flywheel::trainer
