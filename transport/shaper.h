// Link shaping: a token-bucket rate in bytes/s plus an added one-way latency.
//
// A production feature (cap what rollout traffic takes of a WAN link) and the way tests
// and benchmarks emulate WAN links on loopback (this machine has no netem). A shaped
// frame is released when the bucket has passed all its bytes (the bucket's virtual clock
// advances by bytes/rate for every frame, across every connection that shares it) plus
// the latency, so frames pipeline: a link's throughput is the rate, not one frame per
// latency, and a request/response pair costs two latencies (one RTT).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>

namespace flywheel::transport {

using Clock = std::chrono::steady_clock;

// flywheel's one token bucket: WAN link shaping here, and the upload links that
// testing/fault_proxy.h emulates. Thread-safe.
class TokenBucket {
 public:
  // `rate` bytes per second (> 0); up to `burst` bytes pass at once after an idle period.
  TokenBucket(double rate, uint64_t burst) : rate_(rate), burst_(burst) {}

  // Reserves `bytes`; returns when they have passed the bucket (never before `now`).
  Clock::time_point Reserve(uint64_t bytes, Clock::time_point now) {
    std::lock_guard lock(mutex_);
    const auto burst_time = Seconds(static_cast<double>(burst_) / rate_);
    Clock::time_point start = std::max(next_free_, now - burst_time);
    next_free_ = start + Seconds(static_cast<double>(bytes) / rate_);
    return std::max(next_free_, now);
  }
  double rate() const { return rate_; }

 private:
  static Clock::duration Seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  }
  std::mutex mutex_;
  const double rate_;
  const uint64_t burst_;
  Clock::time_point next_free_{};
};

// One direction of a link: an optional (possibly shared) bucket and a latency.
struct LinkShaper {
  std::shared_ptr<TokenBucket> bucket;  // null: no rate limit
  std::chrono::microseconds latency{0};

  bool active() const { return bucket != nullptr || latency.count() > 0; }
  // When a frame of `bytes` handed over at `now` is released.
  Clock::time_point Due(uint64_t bytes, Clock::time_point now) const {
    return (bucket ? bucket->Reserve(bytes, now) : now) + latency;
  }
};

// Both directions of a link, as one --wan-rate/--wan-latency-ms pair configures them.
struct LinkShaping {
  LinkShaper egress;
  LinkShaper ingress;
  bool active() const { return egress.active() || ingress.active(); }
};

// A shaping for `rate` bytes/s (0: unlimited) and `latency_ms` each way, with its own two
// buckets (share the returned object between connections to share the rate).
inline LinkShaping MakeLinkShaping(double rate, double latency_ms) {
  LinkShaping shaping;
  const auto latency = std::chrono::microseconds(static_cast<int64_t>(latency_ms * 1000.0));
  // A burst of 64 KiB or 2 ms of the rate, whichever is larger.
  const uint64_t burst = std::max<uint64_t>(64 << 10, static_cast<uint64_t>(rate * 0.002));
  if (rate > 0) {
    shaping.egress.bucket = std::make_shared<TokenBucket>(rate, burst);
    shaping.ingress.bucket = std::make_shared<TokenBucket>(rate, burst);
  }
  shaping.egress.latency = latency;
  shaping.ingress.latency = latency;
  return shaping;
}

}  // namespace flywheel::transport
