// sync/signing.h: keys on disk, signing and every way a manifest can fail to verify.
#include "sync/signing.h"

#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint/hash.h"
#include "sync/catalog_verifier.h"

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;

class SigningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "signing_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    Result<KeyFiles> files = GenerateSigningKeys((dir_ / "keys").string());
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    files_ = *files;
    Result<SigningKey> key = SigningKey::Load(files_.private_key);
    ASSERT_TRUE(key.ok()) << key.status().ToString();
    key_ = *key;
    Result<TrustedKeys> trusted = TrustedKeys::Load({files_.public_key});
    ASSERT_TRUE(trusted.ok()) << trusted.status().ToString();
    trusted_ = *trusted;
    bytes_.resize(300000);
    for (size_t i = 0; i < bytes_.size(); ++i) bytes_[i] = static_cast<std::byte>(i * 131 + 7);
    info_.kind = ArtifactKind::kDelta;
    info_.base_version = 4;
    info_.target_version = 5;
    info_.base_hash = Hash128{1, 2};
    info_.target_hash = Hash128{3, 4};
    info_.size_bytes = bytes_.size();
    info_.piece_bytes = 65536;
    for (size_t begin = 0; begin < bytes_.size(); begin += info_.piece_bytes) {
      const size_t end = std::min(bytes_.size(), begin + info_.piece_bytes);
      info_.piece_hashes.push_back(HashBytes64(std::span(bytes_).subspan(begin, end - begin)));
    }
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  SignedManifest Signed(const ArtifactInfo& info) {
    Result<SignedManifest> signed_manifest = SignArtifact(*key_, info, bytes_, "run-1", 1000);
    EXPECT_TRUE(signed_manifest.ok()) << signed_manifest.status().ToString();
    return signed_manifest.ok() ? *signed_manifest : SignedManifest{};
  }

  // VerifyManifest's error for `info` against a signature of info_; "" if it verifies.
  std::string Refusal(const ArtifactInfo& info, SignedManifest signed_manifest) {
    Result<ManifestFacts> facts = VerifyManifest(trusted_, signed_manifest, info);
    if (facts.ok()) return "";
    EXPECT_EQ(facts.status().code(), StatusCode::kMismatch) << facts.status().ToString();
    return facts.status().message();
  }

  // A keyframe of version 4 (the version before info_'s target).
  ArtifactInfo KeyframeOfV4() const {
    ArtifactInfo keyframe = info_;
    keyframe.kind = ArtifactKind::kKeyframe;
    keyframe.base_version = 0;
    keyframe.base_hash = Hash128{};
    keyframe.target_version = 4;
    keyframe.target_hash = Hash128{1, 2};
    return keyframe;
  }

  fs::path dir_;
  KeyFiles files_;
  std::optional<SigningKey> key_;
  TrustedKeys trusted_;
  std::vector<std::byte> bytes_;
  ArtifactInfo info_;
};

TEST_F(SigningTest, GeneratedKeyFilesArePemWithAPrivate0600AndAreNeverOverwritten) {
  struct stat info {};
  ASSERT_EQ(::stat(files_.private_key.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);
  EXPECT_EQ(files_.key_id.size(), 16u);
  EXPECT_EQ(files_.key_id, key_->key_id());
  EXPECT_EQ(trusted_.key_ids(), std::vector<std::string>{files_.key_id});
  std::ifstream pub(files_.public_key);
  std::string first;
  std::getline(pub, first);
  EXPECT_EQ(first, "-----BEGIN PUBLIC KEY-----");
  const auto before = fs::last_write_time(files_.private_key);
  Result<KeyFiles> again = GenerateSigningKeys((dir_ / "keys").string());
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("refusing to overwrite"), std::string::npos);
  EXPECT_EQ(fs::last_write_time(files_.private_key), before);
  // A second pair has another id.
  Result<KeyFiles> other = GenerateSigningKeys((dir_ / "other").string());
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->key_id, files_.key_id);
}

TEST_F(SigningTest, BadKeyFilesAreClearStartupErrors) {
  ::chmod(files_.private_key.c_str(), 0644);
  Result<SigningKey> open = SigningKey::Load(files_.private_key);
  ASSERT_FALSE(open.ok());
  EXPECT_NE(open.status().message().find("mode 0644"), std::string::npos) << open.status().ToString();
  EXPECT_NE(open.status().message().find("chmod 600"), std::string::npos);

  Result<SigningKey> missing = SigningKey::Load((dir_ / "nope.key").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope.key"), std::string::npos);

  const std::string garbage = (dir_ / "garbage.key").string();
  { std::ofstream(garbage) << "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"; }
  ::chmod(garbage.c_str(), 0600);
  Result<SigningKey> malformed = SigningKey::Load(garbage);
  ASSERT_FALSE(malformed.ok());
  EXPECT_NE(malformed.status().message().find("is not a PEM private key"), std::string::npos);

  // A public key given as the signing key, and a private key given as a trusted key.
  const std::string pub_copy = (dir_ / "pub-as-private.key").string();
  fs::copy_file(files_.public_key, pub_copy);
  ::chmod(pub_copy.c_str(), 0600);
  EXPECT_FALSE(SigningKey::Load(pub_copy).ok());
  ::chmod(files_.private_key.c_str(), 0600);
  Result<TrustedKeys> private_as_trusted = TrustedKeys::Load({files_.private_key});
  ASSERT_FALSE(private_as_trusted.ok());
  EXPECT_NE(private_as_trusted.status().message().find("is a private key"), std::string::npos);
  Result<TrustedKeys> not_a_key = TrustedKeys::Load({garbage});
  EXPECT_FALSE(not_a_key.ok());
}

TEST_F(SigningTest, AGenuineManifestVerifiesAndNamesItsFacts) {
  const SignedManifest signed_manifest = Signed(info_);
  EXPECT_EQ(signed_manifest.signature.size(), 64u);
  Result<ManifestFacts> facts = VerifyManifest(trusted_, signed_manifest, info_);
  ASSERT_TRUE(facts.ok()) << facts.status().ToString();
  EXPECT_EQ(facts->run_id, "run-1");
  EXPECT_EQ(facts->version, 5u);
  EXPECT_EQ(facts->created_unix_ms, 1000u);
  EXPECT_EQ(facts->key_id, key_->key_id());
  EXPECT_TRUE(CheckArtifactBytes(*facts, info_, bytes_).ok());
}

TEST_F(SigningTest, EveryFieldOfTheCatalogEntryIsBound) {
  const SignedManifest genuine = Signed(info_);
  ASSERT_EQ(Refusal(info_, genuine), "");
  auto changed = [&](auto change) {
    ArtifactInfo other = info_;
    change(other);
    return Refusal(other, genuine);
  };
  EXPECT_NE(changed([](ArtifactInfo& i) { i.target_version = 6; }).find("is for v5"), std::string::npos);
  EXPECT_NE(changed([](ArtifactInfo& i) { i.base_version = 3; }).find("base"), std::string::npos);
  EXPECT_NE(changed([](ArtifactInfo& i) { i.base_hash = Hash128{9, 9}; }).find("base"), std::string::npos);
  EXPECT_NE(changed([](ArtifactInfo& i) { i.target_hash = Hash128{9, 9}; }).find("target hash"),
            std::string::npos);
  EXPECT_NE(changed([](ArtifactInfo& i) { i.size_bytes += 1; }).find("size"), std::string::npos);
  EXPECT_NE(changed([](ArtifactInfo& i) { i.piece_hashes[2] ^= 1; }).find("piece hashes"),
            std::string::npos);
  EXPECT_NE(changed([](ArtifactInfo& i) { i.kind = ArtifactKind::kKeyframe; }), "");
}

TEST_F(SigningTest, UnsignedTamperedAndUnknownSignaturesAreRefused) {
  const SignedManifest genuine = Signed(info_);
  EXPECT_NE(Refusal(info_, {}).find("unsigned"), std::string::npos);
  SignedManifest flipped = genuine;
  flipped.signature[10] ^= 1;
  EXPECT_NE(Refusal(info_, flipped).find("bad signature"), std::string::npos);
  SignedManifest tampered = genuine;
  tampered.manifest[tampered.manifest.size() / 2] ^= 1;
  EXPECT_NE(Refusal(info_, tampered), "");
  SignedManifest truncated = genuine;
  truncated.signature.resize(32);
  EXPECT_NE(Refusal(info_, truncated).find("bad signature"), std::string::npos);
  SignedManifest garbage{"\xff\xff\xff not protobuf", genuine.signature};
  EXPECT_NE(Refusal(info_, garbage), "");
  // Signed by a key nobody trusts.
  Result<KeyFiles> rogue_files = GenerateSigningKeys((dir_ / "rogue").string());
  ASSERT_TRUE(rogue_files.ok());
  Result<SigningKey> rogue = SigningKey::Load(rogue_files->private_key);
  ASSERT_TRUE(rogue.ok());
  Result<SignedManifest> by_rogue = SignArtifact(*rogue, info_, bytes_, "run-1", 1000);
  ASSERT_TRUE(by_rogue.ok());
  EXPECT_NE(Refusal(info_, *by_rogue).find("not trusted"), std::string::npos);
  // Rotation: trusting both keys accepts both; dropping the old one refuses it.
  Result<TrustedKeys> both = TrustedKeys::Load({files_.public_key, rogue_files->public_key});
  ASSERT_TRUE(both.ok());
  EXPECT_TRUE(VerifyManifest(*both, *by_rogue, info_).ok());
  EXPECT_TRUE(VerifyManifest(*both, genuine, info_).ok());
}

TEST_F(SigningTest, BytesMustHaveTheSignedSha256) {
  Result<ManifestFacts> facts = VerifyManifest(trusted_, Signed(info_), info_);
  ASSERT_TRUE(facts.ok());
  std::vector<std::byte> forged = bytes_;
  forged[123456] ^= std::byte{1};
  const Status refused = CheckArtifactBytes(*facts, info_, forged);
  EXPECT_EQ(refused.code(), StatusCode::kMismatch);
  EXPECT_NE(refused.message().find("signed SHA-256"), std::string::npos);
  forged.pop_back();
  EXPECT_FALSE(CheckArtifactBytes(*facts, info_, forged).ok());
}

TEST_F(SigningTest, VersionsOnlyGoUpWithinARunAndOlderRunsAreReplays) {
  const ManifestFacts none;
  const ManifestFacts served{.run_id = "a", .version = 7, .created_unix_ms = 5000};
  EXPECT_TRUE(CheckFresh(none, served).ok());
  EXPECT_TRUE(CheckFresh(served, {.run_id = "a", .version = 8, .created_unix_ms = 4000}).ok());
  EXPECT_NE(CheckFresh(served, {.run_id = "a", .version = 7, .created_unix_ms = 9000}).message().find("replayed"),
            std::string::npos);
  EXPECT_FALSE(CheckFresh(served, {.run_id = "a", .version = 3, .created_unix_ms = 9000}).ok());
  EXPECT_TRUE(CheckFresh(served, {.run_id = "b", .version = 1, .created_unix_ms = 6000}).ok());
  EXPECT_NE(CheckFresh(served, {.run_id = "b", .version = 99, .created_unix_ms = 5000}).message().find("older run"),
            std::string::npos);
}

TEST_F(SigningTest, CatalogVerifierKeepsOnlyVerifiedArtifactsAndCountsEachRefusalOnce) {
  Catalog catalog;
  const ArtifactInfo keyframe = KeyframeOfV4();
  catalog.artifacts = {keyframe, info_};
  catalog.signatures[KeyOf(keyframe)] = Signed(keyframe);  // info_ (v5) is unsigned
  catalog.head_version = 5;
  catalog.head_hash = info_.target_hash;
  CatalogVerifier verifier(trusted_);
  Catalog first = catalog;
  verifier.Filter(&first, "test");
  ASSERT_EQ(first.artifacts.size(), 1u);
  EXPECT_EQ(first.artifacts[0].target_version, 4u);
  EXPECT_EQ(first.head_version, 4u);  // the unverified head is not believed
  EXPECT_EQ(first.head_hash, keyframe.target_hash);
  EXPECT_EQ(verifier.failures(), 1u);
  EXPECT_NE(verifier.FactsOf(KeyOf(keyframe)), nullptr);
  EXPECT_EQ(verifier.FactsOf(KeyOf(info_)), nullptr);
  Catalog second = catalog;  // the same catalog again: not counted twice
  verifier.Filter(&second, "test");
  EXPECT_EQ(verifier.failures(), 1u);
  // Without trusted keys nothing is filtered.
  CatalogVerifier off{TrustedKeys{}};
  Catalog third = catalog;
  off.Filter(&third, "test");
  EXPECT_EQ(third.artifacts.size(), 2u);
  EXPECT_EQ(third.head_version, 5u);
}

// This process's resident memory, and the heap in use (glibc's count), for figures.
struct MemoryUse {
  uint64_t rss = 0;
  uint64_t heap = 0;
};
MemoryUse MemoryNow() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  const struct mallinfo2 info = ::mallinfo2();
  return {resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)), info.uordblks + info.hblkhd};
}

// A forger upstream of a verifying node sends catalogs of 100 entries, each with a new
// version and a new 512-byte signature (the most an entry may carry) over a manifest that
// names the trusted key: 10,000 forged entries, then on to 100,000 (it can go on forever).
// Every one is refused and counted once; the node's memory stays within idle + 16 MiB.
TEST_F(SigningTest, ForgedSignedEntriesLeaveAVerifyingNodesMemoryBounded) {
  const SignedManifest genuine = Signed(info_);
  CatalogVerifier verifier(trusted_);
  uint64_t forged = 0;
  auto attack = [&](uint64_t until) {
    while (forged < until) {
      Catalog catalog;
      for (int i = 0; i < 100; ++i, ++forged) {
        ArtifactInfo entry = KeyframeOfV4();
        entry.target_version = 10 + forged;
        std::string signature(512, 'x');
        std::memcpy(signature.data(), &forged, sizeof forged);
        catalog.signatures[KeyOf(entry)] = {genuine.manifest, signature};
        catalog.artifacts.push_back(std::move(entry));
      }
      catalog.head_version = catalog.artifacts.back().target_version;
      verifier.Filter(&catalog, "verifying node");
      ASSERT_TRUE(catalog.artifacts.empty());
    }
  };
  const MemoryUse idle = MemoryNow();
  attack(10000);
  const MemoryUse at_10k = MemoryNow();
  EXPECT_EQ(verifier.failures(), 10000u);
  attack(100000);
  const MemoryUse at_100k = MemoryNow();
  EXPECT_EQ(verifier.failures(), 100000u);
  EXPECT_LE(verifier.remembered_refusals(), 100u);  // the last catalog's, no more
  auto mib = [](uint64_t after, uint64_t before) {
    return (static_cast<double>(after) - static_cast<double>(before)) / double(1 << 20);
  };
  std::printf("verifying node after 10,000 forged entries: RSS idle + %.2f MiB (heap + %.2f MiB); "
              "after 100,000: RSS idle + %.2f MiB (heap + %.2f MiB)\n",
              mib(at_10k.rss, idle.rss), mib(at_10k.heap, idle.heap), mib(at_100k.rss, idle.rss),
              mib(at_100k.heap, idle.heap));
  EXPECT_LE(at_10k.rss, idle.rss + (16u << 20));
  EXPECT_LE(at_100k.rss, idle.rss + (16u << 20));
}

// A delta still streaming is unsigned by nature: it passes the filter without a
// signature (nothing of it is used before its finished entry verifies), does not raise the
// head, and only while its bound is within twice the largest verified artifact + 64 MiB,
// so a forged one cannot make a node fetch without end.
TEST_F(SigningTest, StreamingEntriesPassUnsignedWithinABound) {
  const ArtifactInfo keyframe = KeyframeOfV4();
  ArtifactInfo streaming = info_;
  streaming.streaming = true;
  streaming.target_hash = Hash128{};
  streaming.piece_hashes.resize(2);
  streaming.size_bytes = 2 * info_.piece_bytes;
  streaming.size_bound = 2 * keyframe.size_bytes + (64 << 20);
  Catalog catalog;
  catalog.artifacts = {keyframe, streaming};
  catalog.signatures[KeyOf(keyframe)] = Signed(keyframe);
  catalog.head_version = 4;
  catalog.head_hash = keyframe.target_hash;
  CatalogVerifier verifier(trusted_);
  Catalog within = catalog;
  verifier.Filter(&within, "test");
  ASSERT_EQ(within.artifacts.size(), 2u);
  EXPECT_TRUE(within.artifacts[1].streaming);
  EXPECT_EQ(within.head_version, 4u);
  EXPECT_EQ(verifier.failures(), 0u);
  EXPECT_EQ(verifier.FactsOf(KeyOf(streaming)), nullptr) << "a streaming entry has no verified facts";

  Catalog over = catalog;
  over.artifacts[1].size_bound += 1;
  verifier.Filter(&over, "test");
  ASSERT_EQ(over.artifacts.size(), 1u);
  EXPECT_FALSE(over.artifacts[0].streaming);
  EXPECT_NE(verifier.last_error().find("bound"), std::string::npos) << verifier.last_error();
}

TEST_F(SigningTest, SigningAndVerifyingAManifestTakeMicroseconds) {
  // The per-version cost of signatures, apart from hashing the bytes: far below 5 ms.
  const SignedManifest signed_manifest = Signed(info_);
  const auto start = std::chrono::steady_clock::now();
  constexpr int kRounds = 200;
  for (int i = 0; i < kRounds; ++i) {
    ASSERT_EQ(key_->Sign(signed_manifest.manifest).size(), 64u);
    ASSERT_TRUE(VerifyManifest(trusted_, signed_manifest, info_).ok());
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / kRounds;
  EXPECT_LT(ms, 5.0) << "sign + verify took " << ms << " ms";
}

}  // namespace
}  // namespace flywheel::sync
