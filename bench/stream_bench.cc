#include "bench/stream_bench.h"

#include <algorithm>
#include <cmath>
#include <iostream>

#include "bench/peers.h"
#include "bench/stream_measure.h"

namespace flywheel::bench {
namespace {

constexpr double kTcpRatioTarget = 0.70;  // flywheel's plain stream vs iperf3
constexpr double kTlsRatioTarget = 0.60;  // one TLS 1.3 stream vs iperf3

std::string Gbit(double bytes_per_second) { return Fixed(bytes_per_second * 8 / 1e9, 2); }

// One flywheel run; NaN (and a failure) when it did not complete.
double RunFlywheel(const std::string& name, transport::StreamBenchOptions options,
                   std::vector<Status>& failures, std::string* cipher) {
  std::cerr << "[stream bench] flywheel " << name << ", "
            << Fixed(static_cast<double>(options.bytes) / 1e6, 1) << " MB ..." << std::flush;
  Result<transport::StreamBenchResult> measured = transport::MeasureLoopbackStream(options);
  if (!measured.ok()) {
    std::cerr << " failed\n";
    failures.push_back(measured.status().WithContext("loopback stream, flywheel " + name));
    return LoopbackStreamReport::kNotMeasured;
  }
  std::cerr << " " << Gbit(measured->bytes_per_second) << " Gbit/s in "
            << Fixed(measured->seconds, 1) << " s\n";
  if (cipher != nullptr && !measured->cipher.empty()) *cipher = measured->cipher;
  return measured->bytes_per_second;
}

}  // namespace

LoopbackStreamReport MeasureLoopbackStreams(const LoopbackStreamOptions& options,
                                            std::vector<Status>& failures) {
  LoopbackStreamReport report;
  report.seconds = options.seconds;
  report.streams = std::max(options.streams, 1);
  report.write_bytes = options.write_bytes;
  ScopedWorkDir scratch;
  std::string log_dir = options.log_dir;
  if (log_dir.empty()) {
    Status made = scratch.Prepare("", "flywheel-stream-bench", /*keep=*/false);
    if (!made.ok()) failures.push_back(made);
    log_dir = scratch.path();
  }
  if (const std::optional<std::string> iperf3 = FindExecutable("iperf3"); !iperf3) {
    report.iperf3_skipped =
        "iperf3 is not installed (the peer is missing; apt-get install iperf3 to get this row)";
    std::cerr << "[stream bench] " << report.iperf3_skipped << "\n";
  } else {
    std::cerr << "[stream bench] iperf3, " << options.seconds << " s ..." << std::flush;
    Result<double> iperf = MeasureIperf3(*iperf3, options.seconds, options.write_bytes, log_dir);
    std::cerr << (iperf.ok() ? " " + Gbit(*iperf) + " Gbit/s\n" : " failed\n");
    if (iperf.ok()) {
      report.iperf3 = *iperf;
    } else {
      report.iperf3_skipped = "iperf3 failed: " + iperf.status().ToString();
      failures.push_back(iperf.status().WithContext("loopback stream, iperf3"));
    }
  }
  Result<double> aes = OpensslSpeed("aes-128-gcm");
  if (aes.ok()) {
    report.aes_gcm = *aes;
  } else {
    report.aes_gcm_skipped = aes.status().message();
  }
  constexpr uint64_t kMinBytes = 256ull << 20, kMaxBytes = 16ull << 30;
  report.flywheel_bytes =
      std::isfinite(report.iperf3)
          ? std::clamp(static_cast<uint64_t>(report.iperf3 * options.seconds), kMinBytes, kMaxBytes)
          : 2ull << 30;
  transport::StreamBenchOptions run;
  run.bytes = report.flywheel_bytes;
  run.frame_bytes = options.write_bytes;
  report.tcp = RunFlywheel("TCP", run, failures, nullptr);
  run.tls = true;
  report.tls = RunFlywheel("TLS 1.3", run, failures, &report.cipher);
  run.streams = report.streams;
  report.tls_multi = RunFlywheel("TLS 1.3 x " + std::to_string(report.streams) + " streams", run,
                                 failures, &report.cipher);
  return report;
}

Table LoopbackStreamTable(const LoopbackStreamReport& report) {
  Table table;
  table.header = {"stream", "Gbit/s", "vs iperf3", "vs AES-GCM floor", "vs TLS ceiling"};
  const double ceiling = report.TlsCeiling();
  auto row = [&](const std::string& name, double rate) {
    if (!std::isfinite(rate)) return;
    table.rows.push_back({name, Gbit(rate), Fixed(rate / report.iperf3, 2),
                          Fixed(rate / report.aes_gcm, 2), Fixed(rate / ceiling, 2)});
  };
  row("iperf3 TCP (peer)", report.iperf3);
  row("openssl speed -evp aes-128-gcm, 1 core (crypto floor)", report.aes_gcm);
  row("TLS ceiling, one core per side: 1 / (1/AES-GCM + 1/iperf3)", ceiling);
  row("flywheel TCP", report.tcp);
  const std::string suite = report.cipher.empty() ? "" : " " + report.cipher;
  row("flywheel TLS 1.3" + suite + ", 1 stream", report.tls);
  row("flywheel TLS 1.3" + suite + ", " + std::to_string(report.streams) + " streams",
      report.tls_multi);
  return table;
}

std::string LoopbackStreamSetup(const LoopbackStreamReport& report) {
  std::string line = "over 127.0.0.1, " + std::to_string(report.write_bytes >> 10) +
                     " KiB writes/frames; iperf3 for " + std::to_string(report.seconds) +
                     " s, each flywheel run " + Fixed(static_cast<double>(report.flywheel_bytes) / 1e6, 1) +
                     " MB; each side of a flywheel run on one thread";
  if (!report.iperf3_skipped.empty()) line += "; skipped " + report.iperf3_skipped;
  if (!report.aes_gcm_skipped.empty()) line += "; no crypto floor: " + report.aes_gcm_skipped;
  return line;
}

std::vector<std::string> LoopbackStreamChecks(const LoopbackStreamReport& report) {
  std::vector<std::string> lines;
  auto check = [&](const std::string& what, double target, double rate) {
    const std::string line = what + " >= " + Fixed(target, 2) + " x iperf3 on loopback";
    if (!std::isfinite(report.iperf3)) {
      lines.push_back(line + ": n/a (no iperf3 figure: " + report.iperf3_skipped + ")");
    } else if (!std::isfinite(rate)) {
      lines.push_back(line + ": FAIL (not measured)");
    } else {
      lines.push_back(line + ": " + PassFail(rate / report.iperf3 >= target) + " (" +
                      Fixed(rate / report.iperf3, 2) + ")");
    }
  };
  check("flywheel TCP stream", kTcpRatioTarget, report.tcp);
  check("one flywheel TLS 1.3 stream", kTlsRatioTarget, report.tls);
  return lines;
}

nlohmann::ordered_json LoopbackStreamJson(const LoopbackStreamReport& report) {
  auto number = [](double value) -> nlohmann::ordered_json {
    return std::isfinite(value) ? nlohmann::ordered_json(value) : nlohmann::ordered_json();
  };
  return {{"seconds", report.seconds},
          {"streams", report.streams},
          {"write_bytes", report.write_bytes},
          {"flywheel_bytes", report.flywheel_bytes},
          {"iperf3_bytes_per_second", number(report.iperf3)},
          {"iperf3_skipped", report.iperf3_skipped},
          {"openssl_aes_128_gcm_bytes_per_second", number(report.aes_gcm)},
          {"flywheel_tcp_bytes_per_second", number(report.tcp)},
          {"flywheel_tls_bytes_per_second", number(report.tls)},
          {"flywheel_tls_multi_bytes_per_second", number(report.tls_multi)},
          {"tls_cipher", report.cipher},
          {"flywheel_tcp_vs_iperf3", number(report.TcpRatio())},
          {"flywheel_tls_vs_iperf3", number(report.TlsRatio())}};
}

Status RunLoopbackStreamBench(const LoopbackStreamOptions& options, std::ostream& out) {
  if (options.seconds < 1) return Status::InvalidArgument("--seconds must be >= 1");
  if (options.streams < 1) return Status::InvalidArgument("--streams must be >= 1");
  std::vector<Status> failures;
  const LoopbackStreamReport report = MeasureLoopbackStreams(options, failures);
  const Table table = LoopbackStreamTable(report);
  const std::vector<std::string> checks = LoopbackStreamChecks(report);
  out << "loopback stream (" << LoopbackStreamSetup(report) << "):\n" << RenderText(table)
      << "\nchecks:\n";
  for (const std::string& line : checks) out << "  " << line << "\n";
  out << std::flush;
  if (!options.markdown_out.empty()) {
    std::string section = "## Loopback stream benchmark\n\n" + LoopbackStreamSetup(report) +
                          ".\n\n" + RenderMarkdown(table) + "\n";
    for (const std::string& line : checks) section += "- " + line + "\n";
    FW_RETURN_IF_ERROR(
        WriteMarkdownSection(options.markdown_out, "## Loopback stream benchmark", section));
  }
  if (!failures.empty()) return failures.front();
  if (options.check) {
    for (const std::string& line : checks) {
      if (line.find(": FAIL") != std::string::npos) return Status::Unavailable("missed: " + line);
    }
  }
  return Status::Ok();
}

}  // namespace flywheel::bench
