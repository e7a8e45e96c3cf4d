// `flywheel bench egress` (tools/bench_commands.h): a relay's egress with 1 child and with
// a fan-out of children over TLS, against the AEAD one-core ceiling and plain TCP's
// gather write against a copying one (bench/egress_bench.h).
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <span>

#include "base/env.h"
#include "bench/egress_bench.h"
#include "tools/bench_commands.h"

namespace flywheel::tools {

namespace {

struct EgressArgs {
  bench::EgressOptions options;
  uint64_t size_mb = 1024;
  bool quick = false;
  bool check = false;
  std::string json_out;
};

Status RunEgressBench(EgressArgs args) {
  if (args.quick) {
    args.size_mb = 64;
    args.options.source_bytes = 16ull << 20;
    args.options.cipher_seconds = 0.05;
    args.options.openssl_speed = false;
  }
  args.options.bytes = args.size_mb << 20;
  Result<bench::EgressRates> rates = bench::MeasureEgress(args.options);
  if (!rates.ok()) return Failed("egress benchmark failed", rates.status());
  std::cout << bench::EgressReport(*rates);
  std::cout.flush();
  if (!args.json_out.empty()) {
    const std::string text = bench::EgressJson(*rates).dump(2) + "\n";
    FW_RETURN_IF_ERROR(WriteFileAtomically(args.json_out, std::as_bytes(std::span(text))));
  }
  if (args.check && (rates->fanout_ratio < 1.8 || rates->stream_vs_ceiling < 0.9)) {
    return Status::Unavailable("egress benchmark: a target was missed (see the report)");
  }
  return Status::Ok();
}

}  // namespace

void AddEgressBenchCommand(CLI::App& bench_app, Action& action) {
  auto args = std::make_shared<EgressArgs>();
  CLI::App* egress = bench_app.add_subcommand(
      "egress",
      "Benchmark a relay's egress: an in-process relay (its connections on an egress pool)\n"
      "serves 1 child, then --children children, then the children from a one-thread pool\n"
      "(the single network thread as a peer), over TLS on loopback; every piece is checked\n"
      "at every child. Prints total egress, the relay's cores used and its rate per core\n"
      "(TLS seal + send, for the projection), one TLS stream against the AEAD one-core\n"
      "ceiling (EVP in-process, and `openssl speed -evp` when present), and plain TCP's\n"
      "gather write against a copying one.");
  egress->add_option("--children", args->options.children, "Children in the fan-out run")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  egress->add_option("--egress-threads", args->options.egress_threads,
                     "The relay's egress pool (0: this machine's cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  egress->add_option("--size-mb", args->size_mb, "Payload per run, split over its children")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{4}, uint64_t{1} << 20));
  egress->add_option("--window", args->options.window, "Piece requests in flight per child")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  egress->add_flag("--quick", args->quick, "Small sizes (a smoke run of a few seconds)");
  egress->add_flag("!--no-plain", args->options.plain, "Skip the plain TCP runs");
  egress->add_flag("--check", args->check,
                   "Fail when fan-out / 1 child < 1.8 or one stream / ceiling < 0.9");
  egress->add_option("--json", args->json_out, "Also write the results as JSON here")
      ->type_name("PATH");
  egress->callback([args, &action] { action = [args] { return RunEgressBench(*args); }; });
}

}  // namespace flywheel::tools
