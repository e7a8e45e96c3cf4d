#include "bench/peers.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ops/process.h"

namespace flywheel::bench {

using ops::FileTail;
using ops::ProcessGroup;
using ops::ReadWholeFile;
using Json = nlohmann::ordered_json;

std::optional<std::string> FindExecutable(const std::string& name) {
  const char* path = std::getenv("PATH");
  const std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t begin = 0;
  while (begin <= dirs.size()) {
    size_t end = dirs.find(':', begin);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(begin, end - begin);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    begin = end + 1;
  }
  return std::nullopt;
}

Result<double> OpensslSpeed(const std::string& algorithm) {
  const std::optional<std::string> openssl = FindExecutable("openssl");
  if (!openssl) return Status::Unavailable("openssl is not installed (apt-get install openssl)");
  ops::RunOptions run;
  run.timeout = std::chrono::milliseconds(30000);
  FW_ASSIGN_OR_RETURN(ops::Completion done,
                      ops::RunToCompletion(*openssl,
                                                {"speed", "-evp", algorithm, "-bytes", "16384",
                                                 "-seconds", "1"},
                                                run));
  if (done.exit_code != 0) {
    return Status::Unavailable("openssl speed -evp " + algorithm + " exited with " +
                               std::to_string(done.exit_code));
  }
  // The result line: "AES-128-GCM     123456.78k" (k = 1000 bytes/s); the name's case
  // differs from the argument's.
  std::istringstream lines(done.out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string name, rate;
    words >> name >> rate;
    if (name.size() != algorithm.size() || rate.empty() || rate.back() != 'k') continue;
    bool same = true;
    for (size_t i = 0; i < name.size(); ++i) {
      same = same && std::tolower(static_cast<unsigned char>(name[i])) ==
                         std::tolower(static_cast<unsigned char>(algorithm[i]));
    }
    if (!same) continue;
    const std::string number = rate.substr(0, rate.size() - 1);
    char* end = nullptr;
    const double thousands = std::strtod(number.c_str(), &end);
    if (end == number.c_str() || *end != '\0' || !(thousands > 0)) {
      return Status::Unavailable("openssl speed printed an unreadable rate '" + rate + "' for " +
                                 algorithm);
    }
    return thousands * 1000;
  }
  return Status::Unavailable("no " + algorithm + " line in openssl speed's output");
}

namespace {

// Whether some socket listens on TCP `port` (IPv4 or IPv6), from /proc/net/tcp{,6}.
bool IsListening(uint16_t port) {
  char port_hex[8];
  std::snprintf(port_hex, sizeof(port_hex), "%04X", port);
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const size_t colon = local.rfind(':');
      if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == port_hex) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace

Result<double> MeasureIperf3(const std::string& iperf3, int seconds, uint64_t write_bytes,
                             const std::string& log_dir) {
  // iperf3 takes no port 0: FreePort's race is accepted (a lost race is a failed run).
  FW_ASSIGN_OR_RETURN(const uint16_t port, ops::FreePort());
  const std::string port_text = std::to_string(port);
  ProcessGroup processes(log_dir);
  FW_ASSIGN_OR_RETURN(const size_t server,
                      processes.Start("iperf3-server", iperf3, {"-s", "-1", "-p", port_text}));
  Status died = Status::Ok();
  const Status listening = ops::WaitUntil(
      [&] {
        if (IsListening(port)) return true;
        died = processes.CheckRunning(server);
        return !died.ok();
      },
      std::chrono::seconds(10), "iperf3 -s to listen on port " + port_text);
  FW_RETURN_IF_ERROR(died);
  FW_RETURN_IF_ERROR(listening);
  FW_ASSIGN_OR_RETURN(const size_t client, processes.Start("iperf3-client", iperf3,
                                                           {"-c", "127.0.0.1", "-p", port_text,
                                                            "-t", std::to_string(seconds), "-l",
                                                            std::to_string(write_bytes), "-J"}));
  FW_ASSIGN_OR_RETURN(const int wait_status,
                      processes.Wait(client, std::chrono::seconds(seconds + 30)));
  const std::string client_out = processes.stdout_path(client);
  if (!(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0)) {
    return Status::Unavailable("iperf3 -c failed: " + FileTail(client_out, 400));
  }
  FW_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(client_out));
  const Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  const Json::json_pointer pointer("/end/sum_received/bits_per_second");
  if (!json.is_object() || !json.contains(pointer) || !json[pointer].is_number()) {
    return Status::Corruption("iperf3 -J output has no end.sum_received.bits_per_second: " +
                              text.substr(0, 300));
  }
  (void)processes.StopAll();
  return json[pointer].get<double>() / 8.0;
}


}  // namespace flywheel::bench
