// `flywheel bench push`: bring-your-own-trainer over the network, measured end to end.
//
// Starts a real fleet on loopback (flywheel publish with a push token, one relay, N
// model-less workers), puts a TCP proxy that shapes the client -> publisher direction to
// the upload link rate (token bucket; this machine has no netem) in front of the
// publisher's HTTP port, and then, all through that proxy:
//   1. pushes v1 in full (push/push_client.h) and waits until every worker serves it;
//   2. uploads the same file with `curl -T` (the peer: one PUT of the whole file into an
//      upload, which is then aborted) — the same bytes over the same shaped link;
//   3. runs further AdamW steps of one simulation (bench/checkpoint_gen.h: RL-like bf16
//      updates), pushing every even step as a local delta and publishing every odd one
//      from a drop — the fleet's own sync time, the baseline the push is held to — and
//      waits each time until every worker serves it.
// Reports per push: the changed words, bytes uploaded and their ratio to the checkpoint,
// client encode time, upload time (create + parts + commit, which includes the
// publisher's verification, apply and publish), the wire floor (uploaded bytes / link
// rate), the time from the commit until every worker serves the version, and the next
// step's drop -> all serving time. Readiness comes from the workers' reports (every second,
// through the relay), in the push and in the drop alike.
// Checks: every worker's weights hash equals the pushed checkpoint's; a delta push uploads
// <= 1/40 of the checkpoint; push -> all serving <= 1.3 x wire floor + drop -> all serving
// (issue 13's target).
#pragma once

#include <ostream>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct PushBenchOptions {
  uint64_t checkpoint_bytes = 1ull << 30;
  double link_bits_per_s = 1e9;  // upload link; 0: unshaped
  int workers = 2;
  int steps = 2;                 // delta pushes after the full one
  int threads = 2;               // client encode and publisher threads
  std::string flywheel_binary;   // empty: this executable
  std::string work_dir;          // empty: a fresh temporary directory
  bool keep = false;
  bool check = true;
  std::string markdown_out;      // write the '## Push benchmark' section here
};

Status RunPushBench(const PushBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
