// flywheel: the command-line front end of the delta codec and its benchmark.
//
// main() parses the command line (CLI11), then runs the one selected action. Exit codes
// and the one-line error contract are in tools/commands.h.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ops/process.h"
#include "tools/commands.h"

#ifndef FLYWHEEL_VERSION
#define FLYWHEEL_VERSION "unknown"
#endif

namespace flywheel::tools {

namespace {

// The commands marked by MarkTorchOnly, with the option that makes each one need libtorch
// ("" for always). Filled while the command table is built, read once before parsing.
std::vector<std::pair<const CLI::App*, std::string>>& TorchMarks() {
  static std::vector<std::pair<const CLI::App*, std::string>> marks;
  return marks;
}

bool HasOption(int argc, char** argv, const std::string& option) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == option || arg.starts_with(option + "=")) return true;
  }
  return false;
}

}  // namespace

void MarkTorchOnly(CLI::App* command, const std::string& when_option) {
  TorchMarks().emplace_back(command, when_option);
}

bool NeedsTorch(const CLI::App& app, int argc, char** argv) {
  const CLI::App* command = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string_view word = argv[i];
    if (word.empty() || word[0] == '-') continue;
    const auto named = command->get_subcommands(
        [&](const CLI::App* sub) { return sub->check_name(std::string(word)); });
    if (named.empty()) continue;  // an option's value
    command = named.front();
    for (const auto& [marked, when_option] : TorchMarks()) {
      if (marked == command && (when_option.empty() || HasOption(argc, argv, when_option))) {
        return true;
      }
    }
  }
  return false;
}

Status TorchOnly(const std::string& command) {
  return Status::Internal(command + " needs libtorch: run it with flywheel-torch");
}

int DefaultThreads() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

std::string SelfProgram() {
  Result<std::string> self = ops::ExecutablePath();
  return self.ok() ? *self : "flywheel";
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

// libgomp's threads (torch's intra-op pool) spin after every parallel region unless
// OMP_WAIT_POLICY says otherwise, and on a machine with as many cores as threads they take
// the cores OpenBLAS's own threads need for the next matmul: decoding 32 sequences on the
// 167M bench model took 2.4x as long (723 vs 300 ms a step, `flywheel bench serving
// --section decode`), training steps the same or slower. libgomp reads the variable when it
// loads, so it must be in the environment before the process starts: set here unless the
// user chose a policy. Numerics do not change.
bool SetPassiveOpenMp() {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return false;
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  return true;
}

// `flywheel` runs a torch command by replacing itself with the flywheel-torch beside it;
// returns only when that is impossible (it then says why, in one line).
int HandOverToTorch(char** argv) {
  SetPassiveOpenMp();
  Result<std::string> self = ops::ExecutablePath();
  const std::string torch =
      (std::filesystem::path(self.ok() ? *self : argv[0]).parent_path() / "flywheel-torch")
          .string();
  ::execv(torch.c_str(), argv);
  const int error = errno;
  std::cerr << "flywheel: this command needs libtorch, which `flywheel` does not load; it runs "
               "in flywheel-torch, but "
            << torch << " cannot be run: " << std::strerror(error) << std::endl;
  return kExitFailure;
}

int Run(int argc, char** argv) {
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
  AddReportCommand(app, action);
  AddPlanCommand(app, action);
  AddShapesCommand(app, action);
  AddDatasetCommands(app, action);
  AddServeCommands(app, action);
  AddCertsCommands(app, action);
  // After the subcommands, which would inherit it otherwise; they have their own.
  app.footer(kFooter);
  if (!WithTorch() && NeedsTorch(app, argc, argv)) return HandOverToTorch(argv);
  // flywheel-torch started directly: once more with the policy in place (see above).
  if (WithTorch() && NeedsTorch(app, argc, argv) && SetPassiveOpenMp()) {
    if (Result<std::string> self = ops::ExecutablePath(); self.ok()) ::execv(self->c_str(), argv);
  }

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
