// Loopback throughput of one flywheel data stream, for `flywheel bench fleet` to print
// next to iperf3's single-stream figure on the same machine.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace flywheel::transport {

struct StreamBenchOptions {
  bool tls = false;                  // TLS 1.3 with test certificates (mutual auth)
  uint64_t bytes = 2ull << 30;       // payload bytes to move
  uint64_t frame_bytes = 1ull << 20; // payload per frame (a piece)
  int streams = 1;                   // connections, all on the one thread of each side
};

struct StreamBenchResult {
  double bytes_per_second = 0;  // payload bytes received / seconds
  double seconds = 0;
  uint64_t wire_bytes = 0;  // including frame prefixes and headers
  std::string cipher;       // the negotiated TLS suite, "" for plain TCP
};

// A Listener and `streams` Dial'd Connections over 127.0.0.1; the listening side runs on
// one thread and the dialling side on another (as iperf3's client and server are separate
// processes, and as a flywheel role serves all its connections from one thread). Each
// sender queues frames of frame_bytes payload as fast as Send() accepts them, the
// receivers count until all arrived; the rate is all payload over the time from the first
// frame received to the last.
Result<StreamBenchResult> MeasureLoopbackStream(const StreamBenchOptions& options);

}  // namespace flywheel::transport
