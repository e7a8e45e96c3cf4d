#include "rl/publish.h"

#include "base/env.h"

namespace flywheel::rl {

double DeltaDensity(uint64_t changed_words, uint64_t total_words) {
  return total_words == 0 ? 0.0 : static_cast<double>(changed_words) / static_cast<double>(total_words);
}

Result<PublishedVersion> PublishVersion(trainer::TrainingClient& client,
                                        pipeline::Coordinator& coordinator, uint64_t version) {
  coordinator.NotePublished(version, UnixMicrosNow());
  // The snapshot (and its copy of the weights) ends with this function.
  FW_ASSIGN_OR_RETURN(trainer::SamplerSnapshot snapshot, client.SaveWeightsForSampler(version));
  coordinator.SetVersion(version);
  PublishedVersion published;
  published.version = version;
  published.full_bytes = snapshot.bytes;
  published.delta_bytes = snapshot.published_delta_bytes;
  published.keyframe_bytes = snapshot.published_keyframe_bytes;
  published.delta_density = DeltaDensity(snapshot.changed_words, snapshot.total_words);
  return published;
}

std::optional<uint64_t> VersionToPublishOnResume(uint64_t published, uint64_t restored) {
  if (published < restored) return restored;
  if (published > restored) return published + 1;
  return std::nullopt;
}

}  // namespace flywheel::rl
