// build/bin/codec_bench: the codec benchmark as a standalone program (see codec_bench.h).
// Exits 0 when every self-check passed, 1 when one failed, 2 on bad flags.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "bench/codec_bench.h"

namespace {

constexpr const char* kUsage = R"(usage: codec_bench [flags]

Compares flywheel's sparse delta codec with zstd -3, zstd --patch-from and xdelta3 on a
generated pair of consecutive bf16 checkpoints (AdamW step k-1 -> k), against the entropy
floor of the pair. Every encoding is decoded and compared bit for bit with the target.

  --size-mb N       checkpoint size in MiB (default 128)
  --lr X[,Y...]     learning rate(s), one table each; repeatable (default 1e-6,1e-5)
  --steps N         AdamW steps; the pair is (step N-1, step N) (default 3)
  --threads A[,B]   thread counts to measure (default 1,2)
  --reps N          timed repetitions, best reported (default 3)
  --seed N          generator seed (default 1)
  --work-dir DIR    scratch directory for the peer tools' files (default: fresh in $TMPDIR)
  --no-peers        skip zstd / xdelta3
  --markdown FILE   also write the tables as Markdown
  --json FILE       also write the results as JSON
  --help            this text
)";

std::optional<long long> ParseInteger(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return std::nullopt;
  return value;
}

std::optional<double> ParseDouble(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(value)) return std::nullopt;
  return value;
}

std::vector<std::string> SplitCommas(const std::string& text) {
  std::vector<std::string> parts;
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    parts.push_back(text.substr(begin, comma - begin));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return parts;
}

int BadFlag(const std::string& message) {
  std::cerr << "codec_bench: " << message << " (see --help)\n";
  return 2;
}

// The value of the flag at argv[i]: inline (--flag=value) or the next argument (consumed).
struct FlagValue {
  int argc;
  char** argv;
  int& i;
  std::optional<std::string> inline_value;

  std::optional<std::string> Text() {
    if (inline_value) return inline_value;
    if (i + 1 < argc) return std::string(argv[++i]);
    return std::nullopt;
  }
  std::optional<long long> PositiveInteger(long long max) {
    const std::optional<std::string> text = Text();
    if (!text) return std::nullopt;
    const std::optional<long long> number = ParseInteger(*text);
    if (!number || *number < 1 || *number > max) return std::nullopt;
    return number;
  }
};

using Options = flywheel::bench::CodecBenchOptions;

// --lr and --threads: comma-separated lists. An error message, or nullopt.
std::optional<std::string> ApplyListFlag(const std::string& flag, FlagValue& value,
                                         Options& options, bool& learning_rates_given) {
  const std::optional<std::string> text = value.Text();
  if (!text) return flag + " needs a value";
  if (flag == "--lr") {
    if (!learning_rates_given) options.learning_rates.clear();
    learning_rates_given = true;
    for (const std::string& part : SplitCommas(*text)) {
      const std::optional<double> lr = ParseDouble(part);
      if (!lr || *lr <= 0) return "--lr: '" + part + "' is not a positive number";
      options.learning_rates.push_back(*lr);
    }
    return std::nullopt;
  }
  options.threads.clear();
  for (const std::string& part : SplitCommas(*text)) {
    const std::optional<long long> threads = ParseInteger(part);
    if (!threads || *threads < 1 || *threads > 256) {
      return "--threads: '" + part + "' is not a thread count in [1, 256]";
    }
    options.threads.push_back(static_cast<int>(*threads));
  }
  return std::nullopt;
}

// Every flag but --help. An error message, or nullopt.
std::optional<std::string> ApplyFlag(const std::string& flag, FlagValue& value, Options& options,
                                     bool& learning_rates_given) {
  if (flag == "--no-peers") {
    if (value.inline_value) return "--no-peers takes no value";
    options.run_peers = false;
  } else if (flag == "--size-mb") {
    const auto mib = value.PositiveInteger(1 << 20);
    if (!mib) return "--size-mb needs a whole number of MiB >= 1";
    options.checkpoint_bytes = static_cast<uint64_t>(*mib) << 20;
  } else if (flag == "--lr" || flag == "--threads") {
    return ApplyListFlag(flag, value, options, learning_rates_given);
  } else if (flag == "--steps") {
    const auto steps = value.PositiveInteger(1000000);
    if (!steps) return "--steps needs a whole number >= 1";
    options.adam_steps = static_cast<int>(*steps);
  } else if (flag == "--reps") {
    const auto reps = value.PositiveInteger(1000);
    if (!reps) return "--reps needs a whole number in [1, 1000]";
    options.repetitions = static_cast<int>(*reps);
  } else if (flag == "--seed") {
    const std::optional<std::string> text = value.Text();
    const std::optional<long long> seed = text ? ParseInteger(*text) : std::nullopt;
    if (!seed || *seed < 0) return "--seed needs a whole number >= 0";
    options.seed = static_cast<uint64_t>(*seed);
  } else if (flag == "--work-dir" || flag == "--markdown" || flag == "--json") {
    const std::optional<std::string> text = value.Text();
    if (!text || text->empty()) return flag + " needs a path";
    (flag == "--work-dir"   ? options.work_dir
     : flag == "--markdown" ? options.markdown_out
                            : options.json_out) = *text;
  } else {
    return "unknown flag '" + std::string(value.argv[value.i]) + "'";
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  bool learning_rates_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    FlagValue value{argc, argv, i, std::nullopt};
    if (const size_t equals = flag.find('=');
        flag.rfind("--", 0) == 0 && equals != std::string::npos) {
      value.inline_value = flag.substr(equals + 1);
      flag.resize(equals);
    }
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (const auto error = ApplyFlag(flag, value, options, learning_rates_given))
      return BadFlag(*error);
  }
  const flywheel::Status status = flywheel::bench::RunCodecBench(options, std::cout);
  if (!status.ok()) {
    std::cerr << "codec_bench: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
