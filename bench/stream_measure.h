// Loopback throughput of one flywheel data stream, for `flywheel bench fleet` to print
// next to iperf3's single-stream figure on the same machine.
#pragma once

#include <cstdint>

#include "base/status.h"

namespace flywheel::transport {

struct StreamBenchOptions {
  bool tls = false;                  // TLS 1.3 with test certificates (mutual auth)
  uint64_t bytes = 2ull << 30;       // payload bytes to move
  uint64_t frame_bytes = 1ull << 20; // payload per frame (a piece)
};

struct StreamBenchResult {
  double bytes_per_second = 0;  // payload bytes received / seconds
  double seconds = 0;
  uint64_t wire_bytes = 0;  // including frame prefixes and headers
};

// A Listener and a Dial'd Connection over 127.0.0.1, each on its own thread (as iperf3's
// client and server are separate processes); the sender queues frames of frame_bytes
// payload as fast as Send() accepts them, the receiver counts until all arrived.
Result<StreamBenchResult> MeasureLoopbackStream(const StreamBenchOptions& options);

}  // namespace flywheel::transport
