// flywheel: the command-line front end of the delta codec and its benchmark.
//
// main() parses the command line (CLI11), then runs the one selected action. Exit codes
// and the one-line error contract are in tools/commands.h.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <exception>
#include <fstream>
#include <iostream>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <string_view>
#include <filesystem>
#include <cerrno>
#include <cstring>
#include <unistd.h>

#include "base/env.h"
#include "tools/commands.h"

#ifndef FLYWHEEL_VERSION
#define FLYWHEEL_VERSION "unknown"
#endif

namespace flywheel::tools {

bool NeedsTorch(int argc, char** argv) {
  std::vector<std::string_view> words;  // the command words, options left out
  bool model = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--model" || arg.starts_with("--model=")) model = true;
    if (!arg.empty() && arg[0] != '-' && words.size() < 2) words.push_back(arg);
  }
  if (words.empty()) return false;
  if (words[0] == "train" || words[0] == "serve-trainer") return true;
  if (words[0] == "worker") return model;
  if (words[0] == "bench" && words.size() > 1) {
    return words[1] == "trainer" || words[1] == "rollout" || words[1] == "parity" ||
           words[1] == "pipeline" || words[1] == "serving" || words[1] == "training-api" ||
           words[1] == "packed-experts" || words[1] == "fp8";
  }
  return false;
}

Status TorchOnly(const std::string& command) {
  return Status::Internal(command + " needs libtorch: run it with flywheel-torch");
}

int DefaultThreads() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

Result<std::string> ReadTokenFile(const std::string& path, const std::string& flag) {
  FW_RETURN_IF_ERROR(CheckPrivateFile(path, flag));
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read " + flag + " " + path);
  std::string token;
  std::getline(in, token);
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.empty()) return Status::InvalidArgument(flag + " " + path + " is empty");
  return token;
}

Result<std::vector<transport::ScopedToken>> ReadScopedTokens(const std::vector<std::string>& specs) {
  std::vector<transport::ScopedToken> tokens;
  for (const std::string& spec : specs) {
    const size_t colon = spec.find(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == spec.size()) {
      return Status::InvalidArgument("--scoped-token-file '" + spec +
                                     "' is not SCOPES:FILE (e.g. read:/etc/flywheel/dashboard.token)");
    }
    Result<uint32_t> scopes = transport::ParseScopes(spec.substr(0, colon));
    if (!scopes.ok()) return scopes.status().WithContext("--scoped-token-file " + spec);
    FW_ASSIGN_OR_RETURN(std::string token, ReadTokenFile(spec.substr(colon + 1), "--scoped-token-file"));
    tokens.push_back({std::move(token), *scopes});
  }
  return tokens;
}

namespace {

constexpr const char* kDescription =
    "flywheel: asynchronous RL post-training of language models, and the sparse bit-exact\n"
    "deltas that ship every new policy version to rollout workers in several regions.\n"
    "`flywheel demo` runs the whole loop (trainer, relays, workers) on this machine.\n"
    "Consecutive RL checkpoints differ in a few percent of their bf16 words; a flywheel\n"
    "delta stores only those words (positions and values, entropy-coded), applies back\n"
    "bit for bit, and is verified by per-tensor and whole-checkpoint hashes.";

constexpr const char* kFooter =
    "\nExamples:\n"
    "  flywheel delta encode --base step100.safetensors --target step101.safetensors \\\n"
    "      --out 101.fwd --base-version 100 --target-version 101\n"
    "  flywheel delta apply --base step100.safetensors --delta 101.fwd --out step101.safetensors\n"
    "  flywheel delta inspect 101.fwd --json\n"
    "  flywheel checkpoint hash step101.safetensors path/to/sharded_dir\n"
    "  flywheel demo                      # the pipeline-RL demo\n"
    "\n"
    "Exit status: 0 on success, 1 when the command failed (missing or corrupt input, wrong\n"
    "base, I/O error), 2 when the command line was wrong. A failure prints one line,\n"
    "'flywheel: <what failed>: <why>', on stderr and leaves no partial output file.\n"
    "Run 'flywheel <command> --help' for the options of each command.";

// Errors must stay on one line whatever the library put in its message.
std::string OneLine(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  std::replace(text.begin(), text.end(), '\r', ' ');
  return text;
}

// "delta encode": the names of the subcommands parsed so far (deepest last).
std::string CommandPath(const CLI::App& app) {
  std::string path;
  const CLI::App* current = &app;
  while (!current->get_subcommands().empty()) {
    current = current->get_subcommands().front();
    if (!path.empty()) path += ' ';
    path += current->get_name();
  }
  return path;
}

// Lists each subcommand with the first line of its description only; `<command> --help`
// shows the whole description.
class Formatter : public CLI::Formatter {
 public:
  std::string make_subcommand(const CLI::App* sub) const override {
    const std::string& description = sub->get_description();
    std::stringstream out;
    CLI::detail::format_help(out, sub->get_display_name(true),
                             description.substr(0, description.find('\n')), get_column_width());
    return out.str();
  }
};

void SetUpLogging(bool verbose) {
  // spdlog's default logger writes to stdout; diagnostics belong on stderr, and only
  // when asked for, so that scripts see exactly what each command prints.
  auto logger = spdlog::stderr_color_mt("flywheel");
  logger->set_pattern("[%H:%M:%S.%e] %^%l%$ %v");
  spdlog::set_default_logger(logger);
  spdlog::set_level(verbose ? spdlog::level::debug : spdlog::level::off);
}

// `flywheel` runs a torch command by replacing itself with the flywheel-torch beside it;
// returns only when that is impossible (it then says why, in one line).
int HandOverToTorch(char** argv) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string torch =
      ((ec ? std::filesystem::path(argv[0]) : self).parent_path() / "flywheel-torch").string();
  ::execv(torch.c_str(), argv);
  const int error = errno;
  std::cerr << "flywheel: this command needs libtorch, which `flywheel` does not load; it runs "
               "in flywheel-torch, but "
            << torch << " cannot be run: " << std::strerror(error) << std::endl;
  return kExitFailure;
}

int Run(int argc, char** argv) {
  if (!kWithTorch && NeedsTorch(argc, argv)) return HandOverToTorch(argv);
  CLI::App app(kDescription, "flywheel");
  app.set_version_flag("--version", std::string("flywheel ") + FLYWHEEL_VERSION,
                       "Print the version and exit");
  app.formatter(std::make_shared<Formatter>());  // inherited by every subcommand
  app.require_subcommand(1);
  // Subcommands created below inherit this: -v may come after the subcommand too.
  app.fallthrough();
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Log diagnostics (timings, sizes) to stderr");

  Action action;
  AddDeltaCommands(app, action);
  AddCheckpointCommands(app, action);
  AddBenchCommands(app, action);
  AddSyncCommands(app, action);
  AddPushCommands(app, action);
  AddRlCommands(app, action);
  AddServeCommands(app, action);
  AddCertsCommands(app, action);
  // After the subcommands, which would inherit it otherwise; they have their own.
  app.footer(kFooter);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // --help and --version arrive as "errors" with exit code 0.
    if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(error);
    const std::string command = CommandPath(app);
    std::string message = error.what();
    // CLI11 reports "A subcommand is required" for a misspelt command; name the word.
    if (error.get_name() == "RequiredError" && message.find("subcommand") != std::string::npos) {
      for (const std::string& word : app.remaining(/*recurse=*/true)) {
        if (!word.empty() && word[0] != '-') {
          message = "unknown command '" + word + "'";
          break;
        }
      }
    }
    const std::string help =
        command.empty() ? "flywheel --help" : "flywheel " + command + " --help";
    std::cerr << "flywheel: " << (command.empty() ? "usage" : command) << ": " << OneLine(message)
              << " (see '" << help << "')" << std::endl;
    return kExitUsage;
  }

  SetUpLogging(verbose);
  if (!action) {  // Unreachable with require_subcommand on every level; kept as a guard.
    std::cerr << "flywheel: usage: no command given (see 'flywheel --help')" << std::endl;
    return kExitUsage;
  }
  const Status status = action();
  if (!status.ok()) {
    std::cout.flush();
    std::cerr << "flywheel: " << OneLine(status.message()) << std::endl;
    return kExitFailure;
  }
  return kExitOk;
}

}  // namespace
}  // namespace flywheel::tools

int main(int argc, char** argv) {
  // Library failures are Status values; anything thrown is a bug or memory exhaustion.
  // Either way the user gets one line, not an abort with a stack trace.
  try {
    return flywheel::tools::Run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::cerr << "flywheel: out of memory" << std::endl;
  } catch (const std::exception& error) {
    std::cerr << "flywheel: internal error: " << flywheel::tools::OneLine(error.what())
              << std::endl;
  }
  return flywheel::tools::kExitFailure;
}
