// Publishing a policy version from the trainer process: the training client's snapshot
// goes to the in-process publisher (sync/publisher.h) and the coordinator learns the new
// version. One pass over the snapshot hashes it; the publisher reuses those hashes and
// its delta encoder counts the changed words, so nothing here compares snapshots, and no
// copy of the previous snapshot is kept here (the version log holds the only one, its head).
#pragma once

#include <cstdint>
#include <optional>

#include "base/status.h"
#include "pipeline/coordinator.h"
#include "trainer/training_client.h"

namespace flywheel::rl {

struct PublishedVersion {
  uint64_t version = 0;
  uint64_t full_bytes = 0;      // serving-dtype bytes of the snapshot
  uint64_t delta_bytes = 0;     // the delta artifact written for it (0: none)
  uint64_t keyframe_bytes = 0;  // the keyframe written for it (0: none)
  // Changed words / words of the delta from the previous version, as the encoder counted
  // them; 0 when no delta was written (the first version, a layout change).
  double delta_density = 0;
};

// changed / total, 0 for total 0.
double DeltaDensity(uint64_t changed_words, uint64_t total_words);

// Publishes the client's weights as `version` through its attached publisher. The
// coordinator is told the publication time first (sync latency is measured from it) and
// the new version after (claims then sample it). REQUIRES: a publisher is attached to
// `client`; `version` above every version published before.
Result<PublishedVersion> PublishVersion(trainer::TrainingClient& client,
                                        pipeline::Coordinator& coordinator, uint64_t version);

// On a resume, the version to publish so that the publisher serves the restored policy:
// `restored` when the publisher is behind the saved state, above `published` when the
// state is older than what was published (a crash between publishing and saving), and
// nothing when it serves `restored` already.
std::optional<uint64_t> VersionToPublishOnResume(uint64_t published, uint64_t restored);

}  // namespace flywheel::rl
