// `flywheel bench egress`: how fast one relay serves its children, and what bounds it.
//
// An in-process relay (sync::Server over a cached artifact in memory, its connections on
// an egress pool: ListenerOptions::egress) serves children over loopback; each child asks
// for pieces with a window of requests in flight and checks every piece's XXH3 against
// the source's. Measured in one run:
// - total egress with 1 child, with N children, and with N children on a one-thread pool
//   (today's single network thread: the pool's peer), and the relay's CPU seconds (its
//   network thread + its pool), so the per-core rate (payload bytes per relay CPU-second:
//   TLS seal + send) is printed for the projection;
// - the AES-GCM one-core ceiling of the negotiated suite: EVP seal and open of 16 KiB
//   records in-process, and `openssl speed -evp` when the binary exists; one TLS stream
//   is set against min(seal, open) (one core per side);
// - plain TCP with the gather write (frame head + cached piece in one sendmsg, no copy)
//   against the copy-into-one-buffer write (ConnectionOptions::gather_writes = false).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct EgressOptions {
  int children = 8;                     // the fan-out case (1 child is always measured too)
  int egress_threads = 0;               // the relay's pool; 0: this machine's cores
  uint64_t bytes = 1ull << 30;          // payload per configuration, split over its children
  uint64_t piece_bytes = 1ull << 20;    // the cached pieces
  uint64_t source_bytes = 64ull << 20;  // the cached artifact (pieces are served round robin)
  int window = 4;                       // piece requests in flight per child
  double cipher_seconds = 0.3;          // each in-process AES-GCM measurement
  bool openssl_speed = true;            // run `openssl speed -evp` as a peer when present
  bool plain = true;                    // measure plain TCP (gather vs copy) too
};

// One relay configuration.
struct EgressRun {
  bool tls = true;
  bool gather_writes = true;
  int children = 0;
  int egress_threads = 0;
  uint64_t bytes = 0;              // payload received by all children, every piece verified
  double seconds = 0;              // first request to last piece
  double bytes_per_second = 0;     // total egress
  double relay_cpu_seconds = 0;    // the relay's network thread + its pool, in the window
  double relay_cores = 0;          // relay_cpu_seconds / seconds
  double per_core_bytes_per_second = 0;  // bytes / relay_cpu_seconds
  std::string cipher;              // the negotiated TLS suite; "" over plain TCP
};

struct EgressRates {
  int cores = 0;  // std::thread::hardware_concurrency()
  EgressRun one_child, many_children, many_children_one_thread;
  double fanout_ratio = 0;  // many_children / one_child (target >= 1.8 on 2 cores)
  double pool_ratio = 0;    // many_children / many_children_one_thread
  // The negotiated suite's AEAD on one core, 16 KiB records (bytes of plaintext per s).
  std::string aead;  // "AES-256-GCM", "AES-128-GCM" or "ChaCha20-Poly1305"
  double seal_bytes_per_second = 0;
  double open_bytes_per_second = 0;
  double openssl_speed_bytes_per_second = 0;  // 0: not run (no binary, or turned off)
  double stream_vs_ceiling = 0;  // one_child / min(seal, open) (target >= 0.9)
  EgressRun plain_gather, plain_copy;  // 1 child each; absent when !options.plain
  double gather_ratio = 0;             // plain_gather / plain_copy
};

// Runs every measurement above; an error when a child got a wrong byte or a connection
// failed (the message says which).
Result<EgressRates> MeasureEgress(const EgressOptions& options);

// One configuration alone (the projection's per-core rate: children = 1, tls = true).
Result<EgressRun> MeasureRelayEgress(const EgressOptions& options, int children,
                                     int egress_threads, bool tls, bool gather_writes);

// The report: a table with the ratios and their targets, and the same as JSON.
std::string EgressReport(const EgressRates& rates);
nlohmann::json EgressJson(const EgressRates& rates);

}  // namespace flywheel::bench
