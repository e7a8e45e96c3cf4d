// `flywheel bench stream`: one flywheel data stream over loopback against its peers.
//
// Runs, one after another on this machine: iperf3's single TCP stream (the socket peer),
// `openssl speed -evp aes-128-gcm` on one core (the crypto floor a TLS stream cannot beat
// on one core per side), then flywheel's framed stream (transport/connection.h) plain,
// with TLS 1.3 on one connection, and with TLS 1.3 on several connections at once (as a
// worker fetches an artifact; each side still serves them from its one thread). Each
// flywheel run moves about what iperf3 moved in the same time. Checks: TCP >= 0.70 x
// iperf3, one TLS stream >= 0.60 x iperf3; the table also shows the TLS ceiling of one core
// per side (see TlsCeiling). `flywheel bench fleet` ends with the same measurement.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"
#include "bench/util.h"

namespace flywheel::bench {

struct LoopbackStreamOptions {
  int seconds = 3;         // iperf3's duration; flywheel's runs move about the same bytes
  int streams = 4;         // connections in the multi-stream run (a worker's default)
  uint64_t write_bytes = 1u << 20;  // iperf3's write and flywheel's frame payload
  std::string log_dir;     // iperf3's output (default: a temporary directory)
  std::string markdown_out;  // write the '## Loopback stream benchmark' section here
  bool check = true;         // fail the command on a missed target
};

struct LoopbackStreamReport {
  static constexpr double kNotMeasured = std::numeric_limits<double>::quiet_NaN();
  int seconds = 0;
  int streams = 0;
  uint64_t write_bytes = 0;
  uint64_t flywheel_bytes = 0;  // payload each flywheel run moved
  double iperf3 = kNotMeasured;  // bytes/s
  std::string iperf3_skipped;    // why there is no iperf3 row, when there is none
  double aes_gcm = kNotMeasured;  // openssl speed -evp aes-128-gcm, 16 KiB blocks, bytes/s
  std::string aes_gcm_skipped;
  double tcp = kNotMeasured, tls = kNotMeasured, tls_multi = kNotMeasured;  // bytes/s
  std::string cipher;            // the suite the TLS runs negotiated

  double TcpRatio() const { return tcp / iperf3; }
  // What one TLS stream can reach when each side has one core for both the AEAD and the
  // socket work that iperf3's stream needs: 1 / (1/aes_gcm + 1/iperf3). On a machine whose
  // two ends share few cores (a 2-core loopback run) this, not iperf3, bounds the ratio.
  double TlsCeiling() const { return 1.0 / (1.0 / aes_gcm + 1.0 / iperf3); }
  double TlsRatio() const { return tls / iperf3; }
};

// Measures what the header describes; a failed peer becomes a skipped row, a failed
// flywheel run one of `failures`.
LoopbackStreamReport MeasureLoopbackStreams(const LoopbackStreamOptions& options,
                                            std::vector<Status>& failures);
Table LoopbackStreamTable(const LoopbackStreamReport& report);
std::string LoopbackStreamSetup(const LoopbackStreamReport& report);  // one line
std::vector<std::string> LoopbackStreamChecks(const LoopbackStreamReport& report);
nlohmann::ordered_json LoopbackStreamJson(const LoopbackStreamReport& report);

// `flywheel bench stream`: the measurement, its table and checks (and --markdown).
Status RunLoopbackStreamBench(const LoopbackStreamOptions& options, std::ostream& out);

}  // namespace flywheel::bench
