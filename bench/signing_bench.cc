#include "bench/signing_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>
#include <vector>

#include "bench/checkpoint_gen.h"
#include "bench/peers.h"
#include "bench/stats.h"
#include "bench/util.h"
#include "delta/delta.h"
#include "ops/process.h"
#include "sync/signing.h"

namespace flywheel::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kPieceBytes = 1 << 20;
constexpr double kManifestTargetMs = 5.0;
constexpr double kShaFloorFraction = 0.8;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

sync::ArtifactInfo InfoOf(sync::ArtifactKind kind, uint64_t version, std::span<const std::byte> bytes) {
  sync::ArtifactInfo info;
  info.kind = kind;
  info.base_version = kind == sync::ArtifactKind::kDelta ? version - 1 : 0;
  info.base_hash = kind == sync::ArtifactKind::kDelta ? Hash128{1, 1} : Hash128{};
  info.target_version = version;
  info.target_hash = Hash128{2, 2};
  info.size_bytes = bytes.size();
  info.piece_bytes = kPieceBytes;
  info.piece_hashes = sync::PieceHashes(bytes, kPieceBytes);
  return info;
}

// The checkpoint pair's delta and keyframe, and the delta's encode time.
struct Artifacts {
  std::vector<std::byte> delta, keyframe;
  double encode_ms = 0;
};

Result<Artifacts> MakeArtifacts(const SigningBenchOptions& options) {
  std::cerr << "signing bench: generating a " << options.checkpoint_bytes / (1 << 20)
            << " MiB checkpoint pair (lr " << options.learning_rate << ") ..." << std::flush;
  GeneratorOptions generate;
  generate.checkpoint_bytes = options.checkpoint_bytes;
  generate.adamw.learning_rate = options.learning_rate;
  generate.threads = options.threads;
  FW_ASSIGN_OR_RETURN(CheckpointPair pair, GenerateCheckpointPair(generate));
  std::cerr << " done\nsigning bench: encoding the delta and the keyframe ..." << std::flush;
  delta::EncodeOptions encode;
  encode.base_version = 1;
  encode.target_version = 2;
  encode.threads = options.threads;
  Artifacts out;
  const auto encode_start = Clock::now();
  FW_ASSIGN_OR_RETURN(out.delta, delta::Encode(pair.BaseView(), pair.TargetView(), encode));
  out.encode_ms = Ms(Clock::now() - encode_start);
  encode.base_version = 0;
  FW_ASSIGN_OR_RETURN(out.keyframe, delta::EncodeKeyframe(pair.TargetView(), encode));
  std::cerr << " done\n";
  return out;
}

// A fresh key pair in a temporary directory, removed with this object.
struct BenchKeys {
  std::string dir;
  std::optional<sync::SigningKey> key;
  std::optional<sync::TrustedKeys> trusted;
  ~BenchKeys() {
    std::error_code ignored;
    if (!dir.empty()) fs::remove_all(dir, ignored);
  }
  Status Generate() {
    dir = (fs::temp_directory_path() / ("flywheel-signing-bench-" + sync::NewRunId())).string();
    FW_ASSIGN_OR_RETURN(sync::KeyFiles files, sync::GenerateSigningKeys(dir));
    FW_ASSIGN_OR_RETURN(key, sync::SigningKey::Load(files.private_key));
    FW_ASSIGN_OR_RETURN(trusted, sync::TrustedKeys::Load({files.public_key}));
    return Status::Ok();
  }
};

// Manifest only: sign and verify, `rounds` times; milliseconds of each.
Status TimeManifests(const BenchKeys& keys, const sync::SignedManifest& signed_manifest,
                     const sync::ArtifactInfo& info, int rounds, std::vector<double>& sign_ms,
                     std::vector<double>& verify_ms) {
  for (int i = 0; i < rounds; ++i) {
    auto start = Clock::now();
    const std::string signature = keys.key->Sign(signed_manifest.manifest);
    sign_ms.push_back(Ms(Clock::now() - start));
    start = Clock::now();
    Result<sync::ManifestFacts> facts =
        sync::VerifyManifest(*keys.trusted, {signed_manifest.manifest, signature}, info);
    verify_ms.push_back(Ms(Clock::now() - start));
    if (!facts.ok()) return facts.status().WithContext("a fresh signature did not verify");
  }
  return Status::Ok();
}

// A whole artifact: SignArtifact (SHA-256 + manifest) and the receiver's checks.
struct ArtifactCost {
  std::string name;
  uint64_t bytes = 0;
  double sign_ms = 0, check_ms = 0;
};

Result<ArtifactCost> TimeArtifact(const BenchKeys& keys, const std::string& name,
                                  const sync::ArtifactInfo& info,
                                  const std::vector<std::byte>& bytes) {
  ArtifactCost cost{name, bytes.size()};
  auto start = Clock::now();
  FW_ASSIGN_OR_RETURN(sync::SignedManifest signed_manifest,
                      sync::SignArtifact(*keys.key, info, bytes, "bench", 1));
  cost.sign_ms = Ms(Clock::now() - start);
  start = Clock::now();
  FW_ASSIGN_OR_RETURN(sync::ManifestFacts facts,
                      sync::VerifyManifest(*keys.trusted, signed_manifest, info));
  FW_RETURN_IF_ERROR(sync::CheckArtifactBytes(facts, info, bytes));
  cost.check_ms = Ms(Clock::now() - start);
  // A correctness run too: one flipped byte is refused.
  std::vector<std::byte> flipped(bytes.begin(),
                                 bytes.begin() + std::min<size_t>(bytes.size(), 1 << 20));
  flipped[flipped.size() / 2] ^= std::byte{1};
  if (flipped.size() == bytes.size() && sync::CheckArtifactBytes(facts, info, flipped).ok()) {
    return Status::Internal("a flipped byte passed CheckArtifactBytes");
  }
  return cost;
}

// The checks against the targets and the openssl peer; false in `ok` when one missed.
std::vector<std::string> SigningChecks(double sign_ms, double verify_ms,
                                       const ArtifactCost& keyframe, bool& ok) {
  std::vector<std::string> checks;
  const bool manifest_ok = sign_ms <= kManifestTargetMs && verify_ms <= kManifestTargetMs;
  checks.push_back("sign and verify a manifest <= " + Fixed(kManifestTargetMs, 0) +
                   " ms each: " + PassFail(manifest_ok) + " (" + Fixed(sign_ms, 3) + " / " +
                   Fixed(verify_ms, 3) + " ms)");
  const Result<double> openssl_speed = OpensslSpeed("sha256");
  const double our_sha_rate = keyframe.bytes / (keyframe.check_ms / 1000);
  bool sha_ok = true;
  if (openssl_speed.ok() && std::isfinite(*openssl_speed)) {
    const double openssl_rate = *openssl_speed;
    sha_ok = our_sha_rate >= kShaFloorFraction * openssl_rate;
    checks.push_back("SHA-256 pass >= " + Fixed(kShaFloorFraction, 1) +
                     " x openssl speed -evp sha256 (peer, " + Fixed(openssl_rate / 1e9, 2) +
                     " GB/s): " + PassFail(sha_ok) + " (" + Fixed(our_sha_rate / 1e9, 2) +
                     " GB/s = " + Fixed(our_sha_rate / openssl_rate, 2) + " x)");
  } else {
    checks.push_back("SHA-256 vs openssl speed: n/a (" +
                     (openssl_speed.ok() ? std::string() : openssl_speed.status().message()) + ")");
  }
  ok = manifest_ok && sha_ok;
  return checks;
}

}  // namespace

Status RunSigningBench(const SigningBenchOptions& options, std::ostream& out) {
  if (options.rounds < 1) return Status::InvalidArgument("--rounds must be >= 1");
  FW_ASSIGN_OR_RETURN(const Artifacts artifacts, MakeArtifacts(options));
  BenchKeys keys;
  FW_RETURN_IF_ERROR(keys.Generate());
  const sync::ArtifactInfo delta_info = InfoOf(sync::ArtifactKind::kDelta, 2, artifacts.delta);
  const sync::ArtifactInfo keyframe_info =
      InfoOf(sync::ArtifactKind::kKeyframe, 2, artifacts.keyframe);
  FW_ASSIGN_OR_RETURN(sync::SignedManifest delta_signed,
                      sync::SignArtifact(*keys.key, delta_info, artifacts.delta, "bench", 1));
  std::vector<double> sign_ms, verify_ms;
  FW_RETURN_IF_ERROR(
      TimeManifests(keys, delta_signed, delta_info, options.rounds, sign_ms, verify_ms));
  std::vector<ArtifactCost> costs;
  FW_ASSIGN_OR_RETURN(ArtifactCost delta_cost,
                      TimeArtifact(keys, "delta", delta_info, artifacts.delta));
  costs.push_back(delta_cost);
  FW_ASSIGN_OR_RETURN(ArtifactCost keyframe_cost,
                      TimeArtifact(keys, "keyframe", keyframe_info, artifacts.keyframe));
  costs.push_back(keyframe_cost);

  Table table;
  table.header = {"per version", "bytes", "publisher (ms)", "each receiver (ms)", "note"};
  table.rows.push_back({"manifest (Ed25519)", Grouped(delta_signed.manifest.size()),
                        Fixed(Median(sign_ms, NAN), 3), Fixed(Median(verify_ms, NAN), 3),
                        "median of " + std::to_string(options.rounds)});
  for (const ArtifactCost& cost : costs) {
    table.rows.push_back({cost.name + " + SHA-256", Grouped(cost.bytes), Fixed(cost.sign_ms, 2),
                          Fixed(cost.check_ms, 2),
                          Fixed(cost.bytes / (cost.check_ms / 1000) / 1e9, 2) + " GB/s"});
  }
  table.rows.push_back({"delta encode (scale)", Grouped(options.checkpoint_bytes),
                        Fixed(artifacts.encode_ms, 1), "-",
                        std::to_string(options.threads) + " threads"});
  std::ostringstream report;
  report << "flywheel signing benchmark: signed versions on a "
         << Fixed(options.checkpoint_bytes / 1e9, 2) << " GB bf16 checkpoint (lr "
         << options.learning_rate << ", delta "
         << Fixed(100.0 * artifacts.delta.size() / options.checkpoint_bytes, 2)
         << " % of it), one thread\n\n"
         << RenderText(table) << "\n";
  bool ok = true;
  for (const std::string& line :
       SigningChecks(Median(sign_ms, NAN), Median(verify_ms, NAN), costs[1], ok)) {
    report << line << "\n";
  }
  out << report.str();
  if (!options.markdown_out.empty()) {
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Signing benchmark",
                                            "## Signing benchmark\n\n```\n" + report.str() + "```\n"));
  }
  if (options.check && !ok) return Status::Mismatch("a signing target was missed");
  return Status::Ok();
}

}  // namespace flywheel::bench
