// `flywheel bench` subcommands registered from their own files (each owns its options and
// report): egress (relay fan-out), churn (200 workers), join (a worker joining at the head).
#pragma once

#include "tools/commands.h"

namespace flywheel::tools {

void AddEgressBenchCommand(CLI::App& bench_app, Action& action);
void AddChurnBenchCommand(CLI::App& bench_app, Action& action);
void AddJoinBenchCommand(CLI::App& bench_app, Action& action);

}  // namespace flywheel::tools
