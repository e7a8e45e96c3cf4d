// The flywheel CLI's subcommands. Each Add*Commands call registers its subcommands on
// `app`; when one of them is selected on the command line, parsing stores its action in
// `action`, and main() runs it after the whole command line parsed cleanly.
//
// Error contract of every action: it returns a non-OK status whose message says what
// failed (which command, which files) followed by the library's status; main() prints it
// as exactly one line, `flywheel: <message>`, on stderr and exits with 1. Nothing else is
// written to stderr on failure; outputs are atomic (the libraries guarantee it), so a
// failed command leaves no output file behind and never touches an existing one.
#pragma once

#include <functional>
#include <string>

#include "base/status.h"
#include "tools/common_flags.h"

namespace CLI {
class App;
}

namespace flywheel::tools {

// What the selected subcommand will do once parsing finished.
using Action = std::function<Status()>;

// Exit codes of the CLI.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // a run-time failure (I/O, corrupt input, wrong base)
inline constexpr int kExitUsage = 2;    // the command line itself was wrong

// Two executables are built from these sources. `flywheel-torch` (FLYWHEEL_WITH_TORCH)
// links libtorch and runs every command. `flywheel` does not: it starts in milliseconds and
// runs every command that needs no tensor math itself. Both register the same commands, so
// `flywheel --help` lists them all; a command that needs libtorch says so where it is
// registered (MarkTorchOnly), and before parsing, main() hands such a command over to the
// flywheel-torch beside it (execv, same arguments).
//
// The sources that do not mention FLYWHEEL_WITH_TORCH are compiled once, for both
// (tools/CMakeLists.txt); WithTorch() is the one place that tells the two apart at run time
// (tools/flavour.cc, compiled per executable).
bool WithTorch();

// Marks `command` as one that needs libtorch: always, or, with `when_option`, only when that
// option is on the command line (`worker --model`). Its action in `flywheel` is TorchOnly.
void MarkTorchOnly(CLI::App* command, const std::string& when_option = "");

// Whether the command line names a command of `app` (the whole table, registered) that
// MarkTorchOnly marked.
bool NeedsTorch(const CLI::App& app, int argc, char** argv);

// What a torch command's action returns in `flywheel` (main() hands those over before
// parsing, so it only shows if the hand-over was bypassed).
Status TorchOnly(const std::string& command);

// `--threads` default: every core the machine reports (at least 1).
int DefaultThreads();

// This executable's path (ops::ExecutablePath), for starting it again as a child process;
// "flywheel" (found on PATH) when it cannot be resolved.
std::string SelfProgram();

// `<what>: <status>`, keeping the status code's name: "cannot apply d.fwd: corruption: ...".
inline Status Failed(const std::string& what, const Status& status) {
  return Status(status.code(), what + ": " + status.ToString());
}

// `delta encode`, `delta apply`, `delta inspect`.
void AddDeltaCommands(CLI::App& app, Action& action);
// `checkpoint hash`, `checkpoint info`.
void AddCheckpointCommands(CLI::App& app, Action& action);
// `bench codec|fleet|trainer|rollout|parity|pipeline`.
void AddBenchCommands(CLI::App& app, Action& action);
// `certs`: a test CA and certificates for the TLS flags.
void AddCertsCommands(CLI::App& app, Action& action);
// `publish`, `relay`, `worker`: the weight-sync roles.
void AddSyncCommands(CLI::App& app, Action& action);
// `push`, `versions`, `pin`, `unpin`: clients of a publisher's push API.
void AddPushCommands(CLI::App& app, Action& action);
// `serve-trainer` and `service`: the training service (docs/TRAINING_API.md).
void AddServeCommands(CLI::App& app, Action& action);
// `demo` and `train`: the pipeline-RL loop.
void AddRlCommands(CLI::App& app, Action& action);
// `flywheel report serve DIR` (tools/cmd_rl.cc).
void AddReportCommand(CLI::App& app, Action& action);
// `flywheel plan`: a run's memory plan (model/memory_plan.h).
void AddPlanCommand(CLI::App& app, Action& action);
// `flywheel shapes`: the training shapes (pipeline/shapes.h).
void AddShapesCommand(CLI::App& app, Action& action);
// `dataset make sort|reverse|add` and `model make-tiny`: the demo's task and model as files.
void AddDatasetCommands(CLI::App& app, Action& action);
// `bench pipeline` (registered by AddBenchCommands).
void AddPipelineBenchCommand(CLI::App& bench_app, Action& action);

}  // namespace flywheel::tools
