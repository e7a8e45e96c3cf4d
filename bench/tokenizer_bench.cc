#include "bench/tokenizer_bench.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <vector>

#include "base/env.h"
#include "bench/peers.h"
#include "bench/util.h"
#include "tokenizer/hf_tokenizer.h"

namespace flywheel::bench {

namespace {

namespace fs = std::filesystem;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
using nlohmann::json;

const char* const kProse[] = {
    "The trainer publishes a new policy every few seconds, and every rollout worker must serve "
    "it before its samples go stale. ",
    "Reinforcement learning from verifiable rewards needs many samples per prompt; the fleet "
    "that generates them grows and shrinks with the capacity at hand. ",
    "Der Trainer veröffentlicht alle paar Sekunden eine neue Version, und jeder Worker muss sie "
    "übernehmen, bevor seine Stichproben veralten. Größe, Maßstab, Übergänge. ",
    "Le modèle apprend à résoudre des problèmes de mathématiques ; chaque étape produit une "
    "nouvelle politique qu'il faut distribuer rapidement. Où est la clé ? ",
    "El entrenador publica una política nueva cada pocos segundos; los trabajadores la cargan "
    "sin detener la generación. ¿Cuánto tarda? ¡Muy poco! ",
    "Тренер публикует новую версию политики каждые несколько секунд, и каждый рабочий узел "
    "должен успеть её загрузить. Это важно для обучения. ",
    "Ο εκπαιδευτής δημοσιεύει μια νέα πολιτική κάθε λίγα δευτερόλεπτα. ",
    "训练器每隔几秒钟发布一个新的策略，每个推理节点都必须在样本过时之前加载它。强化学习需要大量样本。",
    "トレーナーは数秒ごとに新しい方策を公開し、各ワーカーはサンプルが古くなる前にそれを読み込む必要があります。",
    "트레이너는 몇 초마다 새로운 정책을 게시하고, 모든 작업자는 샘플이 오래되기 전에 이를 적용해야 합니다. ",
    "يقوم المدرب بنشر سياسة جديدة كل بضع ثوان، ويجب على كل عامل تحميلها قبل أن تصبح العينات قديمة. ",
    "प्रशिक्षक हर कुछ सेकंड में एक नई नीति प्रकाशित करता है, और हर कार्यकर्ता को उसे लोड करना होता है। ",
    "Emoji too: 🚀 shipped, ✅ verified, 🤗 weights, 👩‍💻 on call, 🇯🇵🇩🇪🇫🇷 regions. ",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n<think>\n17 * 23 = 391"
    "\n</think>\n\nThe answer is 391.<|im_end|>\n",
};

const char* const kCode[] = {
    "int main(int argc, char** argv) {\n\tfor (int i = 0; i < argc; ++i) {\n\t\tstd::printf(\"%s\\n\", "
    "argv[i]);\n\t}\n\treturn 0;\n}\n\n",
    "def train(model, batch, lr=1e-6):\n    loss = model(batch).mean()\n    loss.backward()\n"
    "    for p in model.parameters():\n        p.data -= lr * p.grad\n    return loss.item()\n\n",
    "    {\n        \"name\": \"get_weather\",\n        \"arguments\": {\"city\": \"Paris\", "
    "\"unit\": \"celsius\"}\n    }\n",
    "SELECT id, name, created_at FROM runs WHERE step > 1000 ORDER BY created_at DESC LIMIT 20;\n",
};

}  // namespace

std::string MixedLanguageText(size_t bytes) {
  std::mt19937_64 rng(42);
  std::string text;
  text.reserve(bytes + 4096);
  const char* const syllables[] = {"ka", "lo", "mi", "tr", "en", "qu", "ax", "zo", "pe", "rin"};
  while (text.size() < bytes) {
    const uint64_t r = rng();
    if (r % 5 == 0) {
      text += kCode[(r >> 8) % std::size(kCode)];
    } else {
      text += kProse[(r >> 8) % std::size(kProse)];
    }
    // A made-up identifier and a number, so that not every word is one seen before.
    std::string word;
    for (int k = 0, n = 1 + static_cast<int>((r >> 20) % 4); k < n; ++k)
      word += syllables[(r >> (24 + 4 * k)) % std::size(syllables)];
    text += word + "_" + std::to_string((r >> 40) % 100000) + " ";
    if ((r >> 60) == 0) text += "\n\n";
  }
  // Whole characters only: cut at the last newline before the size.
  const size_t cut = text.rfind('\n', bytes);
  text.resize(cut == std::string::npos ? bytes : cut + 1);
  return text;
}

namespace {

// The peer: @huggingface/tokenizers under node on the same text. Its MB/s and ids.
constexpr const char* kReferenceScript = R"JS(
import { Tokenizer } from "@huggingface/tokenizers";
import fs from "fs";
const [tokPath, cfgPath, textPath, outPath] = process.argv.slice(2);
const tok = new Tokenizer(JSON.parse(fs.readFileSync(tokPath, "utf8")),
                          cfgPath ? JSON.parse(fs.readFileSync(cfgPath, "utf8")) : {});
const text = fs.readFileSync(textPath, "utf8");
tok.encode(text.slice(0, 200000), { add_special_tokens: false });
let best = Infinity, ids;
for (let r = 0; r < 2; ++r) {
  const t0 = performance.now();
  ids = tok.encode(text, { add_special_tokens: false }).ids;
  best = Math.min(best, performance.now() - t0);
}
fs.writeFileSync(outPath, JSON.stringify({ seconds: best / 1000, ids: Array.from(ids) }));
)JS";

Result<std::string> ReferenceDir(const TokenizerBenchOptions& options) {
  if (!options.reference_dir.empty()) return fs::absolute(options.reference_dir).string();
  const char* home = std::getenv("HOME");
  const fs::path dir = fs::path(home ? home : "/tmp") / ".cache/flywheel/npm-tokenizers";
  if (fs::exists(dir / "node_modules/@huggingface/tokenizers/package.json")) return dir.string();
  if (!FindExecutable("npm")) return Status::Unavailable("npm is not installed");
  fs::create_directories(dir);
  std::ofstream(dir / "package.json") << R"({"name": "flywheel-bench-tokenizers", "private": true, "type": "module"})";
  const std::string command = "cd '" + dir.string() +
                              "' && timeout 240 npm install --no-audit --no-fund --loglevel=error "
                              "@huggingface/tokenizers@0.2.0 >npm-install.log 2>&1";
  if (std::system(command.c_str()) != 0)
    return Status::Unavailable("npm install @huggingface/tokenizers failed (offline?); see " +
                               (dir / "npm-install.log").string());
  return dir.string();
}

struct PeerRun {
  double seconds = 0;
  std::vector<int32_t> ids;
};

Result<PeerRun> RunReference(const TokenizerBenchOptions& options, const std::string& tokenizer_json,
                             const std::string& config_json, const std::string& text_path) {
  if (!FindExecutable("node")) return Status::Unavailable("node is not installed");
  FW_ASSIGN_OR_RETURN(std::string dir, ReferenceDir(options));
  const fs::path script = fs::path(dir) / "flywheel_tokenizer_bench.mjs";
  std::ofstream(script) << kReferenceScript;
  const std::string out = text_path + ".reference.json";
  const std::string command = "cd '" + dir + "' && timeout 600 node '" + script.string() + "' '" +
                              tokenizer_json + "' '" + config_json + "' '" + text_path + "' '" +
                              out + "' >'" + out + ".log' 2>&1";
  if (std::system(command.c_str()) != 0)
    return Status::Unavailable("the reference failed; see " + out + ".log");
  std::ifstream in(out);
  json answer = json::parse(in, nullptr, false);
  fs::remove(out);
  fs::remove(out + ".log");
  if (answer.is_discarded()) return Status::Unavailable("the reference wrote no answer");
  PeerRun run;
  run.seconds = answer["seconds"].get<double>();
  run.ids = answer["ids"].get<std::vector<int32_t>>();
  return run;
}

// Our encoder against the reference: the cells of our row ("ratio", "parity"), the
// reference's row, and whether the ids were compared and are equal.
struct PeerComparison {
  std::string ratio = "-", parity = "not compared", peer_row;
  bool compared = false, parity_ok = true;
};

PeerComparison CompareWithReference(const TokenizerBenchOptions& options, const std::string& text,
                                    const std::vector<int32_t>& ids, double ours, double mb) {
  PeerComparison c;
  std::string json_path = options.tokenizer, config_path;
  if (fs::is_directory(json_path)) json_path = (fs::path(json_path) / "tokenizer.json").string();
  const fs::path config = fs::path(json_path).parent_path() / "tokenizer_config.json";
  if (fs::exists(config)) config_path = config.string();
  const std::string text_path = (fs::temp_directory_path() /
                                 ("flywheel-tokenizer-bench-" + std::to_string(getpid()) + ".txt"))
                                    .string();
  const Status written = WriteFileAtomically(text_path, std::as_bytes(std::span(text)));
  const Result<PeerRun> peer =
      written.ok()
          ? RunReference(options, fs::absolute(json_path).string(),
                         config_path.empty() ? "" : fs::absolute(config_path).string(), text_path)
          : Result<PeerRun>(written);
  std::error_code ignored;
  fs::remove(text_path, ignored);
  if (!peer.ok()) {
    c.peer_row = "| reference: " + peer.status().message() + " | - | - | - |\n";
    return c;
  }
  const double theirs = mb / peer->seconds;
  size_t same = 0;
  for (size_t i = 0; i < std::min(ids.size(), peer->ids.size()); ++i)
    same += ids[i] == peer->ids[i];
  c.parity_ok = peer->ids == ids;
  c.compared = true;
  char cell[128];
  std::snprintf(cell, sizeof(cell), "%.1fx", ours / theirs);
  c.ratio = cell;
  std::snprintf(cell, sizeof(cell), "%s (%zu of %zu)", c.parity_ok ? "all" : "NO", same,
                std::max(ids.size(), peer->ids.size()));
  c.parity = cell;
  std::snprintf(cell, sizeof(cell),
                "| @huggingface/tokenizers 0.2.0 (node, JS) | %.1f | 1.0x | reference |\n", theirs);
  c.peer_row = cell;
  return c;
}

}  // namespace

Status RunTokenizerBench(const TokenizerBenchOptions& options, std::ostream& out) {
  if (options.tokenizer.empty()) return Status::InvalidArgument("--tokenizer is required");
  const auto load_start = std::chrono::steady_clock::now();
  FW_ASSIGN_OR_RETURN(auto tok, tokenizer::HfTokenizer::Load(options.tokenizer));
  const double load_s = SecondsSince(load_start);
  const std::string text = MixedLanguageText(static_cast<size_t>(options.megabytes * 1e6));
  const double mb = static_cast<double>(text.size()) / 1e6;
  // Warm-up (the word cache fills as it would in a serving process), then the best of
  // `rounds` on one thread.
  FW_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok->Encode(text.substr(0, 200000)));
  double best = 1e300;
  for (int r = 0; r < std::max(1, options.rounds); ++r) {
    const auto start = std::chrono::steady_clock::now();
    FW_ASSIGN_OR_RETURN(ids, tok->Encode(text));
    best = std::min(best, SecondsSince(start));
  }
  const double ours = mb / best;
  // Decoding back gives the text again (NFC: the generated text is already normalized).
  FW_ASSIGN_OR_RETURN(std::string back, tok->Decode(ids, /*skip_special_tokens=*/false));
  const bool round_trip = back == text;
  const PeerComparison peer =
      options.reference ? CompareWithReference(options, text, ids, ours, mb) : PeerComparison{};
  std::ostringstream report;
  char line[512];
  std::snprintf(line, sizeof(line), "tokenizer: %s\n%s; loaded in %.2f s\n", options.tokenizer.c_str(),
                tok->Describe().c_str(), load_s);
  report << line;
  std::snprintf(line, sizeof(line),
                "text: %.2f MB mixed-language (prose in 11 languages, code, emoji, chat markup), "
                "%zu tokens (%.2f bytes/token)\n\n",
                mb, ids.size(), static_cast<double>(text.size()) / static_cast<double>(ids.size()));
  report << line;
  report << "| encoder (one thread) | MB/s | vs reference | ids equal |\n|---|---|---|---|\n";
  std::snprintf(line, sizeof(line), "| flywheel (C++) | %.1f | %s | %s |\n", ours,
                peer.ratio.c_str(), peer.parity.c_str());
  report << line << peer.peer_row;
  const bool speed_ok = ours >= options.min_mb_per_s;
  std::snprintf(line, sizeof(line),
                "\nchecks: %.1f MB/s >= %.0f: %s; ids equal to the reference: %s; decode round "
                "trip: %s\n",
                ours, options.min_mb_per_s, speed_ok ? "yes" : "NO",
                !peer.compared   ? "not compared"
                : peer.parity_ok ? "yes"
                                 : "NO",
                round_trip ? "yes" : "NO");
  report << line;
  out << report.str();
  if (!options.markdown_out.empty()) {
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Tokenizer benchmark",
                                            "## Tokenizer benchmark\n\n" + report.str()));
  }
  if (!round_trip) return Status::Mismatch("decoding the encoded text did not give it back");
  if (!peer.parity_ok) return Status::Mismatch("token ids differ from the reference");
  if (options.check && !speed_ok) return Status::Mismatch("encode throughput is under the target");
  return Status::Ok();
}

}  // namespace flywheel::bench
