// The peer tools the benchmarks run beside flywheel on the same machine: finding them on
// PATH, `openssl speed` (the crypto floor) and one iperf3 TCP stream over loopback.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

// The first executable `name` on $PATH (or /usr/local/bin:/usr/bin:/bin), if any.
std::optional<std::string> FindExecutable(const std::string& name);

// `openssl speed -evp ALGORITHM -bytes 16384 -seconds 1` on one core: bytes/s of the
// 16 KiB column. Unavailable (naming why) when openssl is missing, fails or prints no
// line for the algorithm.
Result<double> OpensslSpeed(const std::string& algorithm);

// One iperf3 TCP stream over loopback for `seconds` (`iperf3 -s -1` and `iperf3 -c ...
// -l WRITE -J`): bytes/s received. `write_bytes` is iperf3's write size; callers pass
// flywheel's frame size, as iperf3's default (128 KiB) would handicap the peer with 8x the
// syscalls. The two processes' output goes to `log_dir`.
Result<double> MeasureIperf3(const std::string& iperf3, int seconds, uint64_t write_bytes,
                             const std::string& log_dir);

}  // namespace flywheel::bench
