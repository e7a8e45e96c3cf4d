// `flywheel push`, `flywheel versions`, `flywheel pin`, `flywheel unpin`: thin commands over
// a publisher's push API (push/push_client.h, docs/PUSH_API.md).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "push/push_client.h"
#include "tools/commands.h"
#include "tools/progress.h"

namespace flywheel::tools {
namespace {

struct PushArgs {
  std::string url, cache_dir, client;
  TokenFlags tokens;
  transport::TlsOptions tls;  // --ca, --tls-cert, --tls-key
  std::string checkpoint;
  uint64_t version = 0;
  std::vector<std::string> meta;
  double wait_fraction = -1;  // < 0: no wait
  double timeout_s = 300;
  bool no_delta = false, json = false;
  uint64_t part_mib = 16;
  int threads = DefaultThreads();
  uint64_t pin_version = 0;
};

Result<sync::PushClientOptions> ClientOptions(const PushArgs& args) {
  sync::PushClientOptions options;
  options.url = args.url;
  FW_ASSIGN_OR_RETURN(options.token, ResolveToken(args.tokens, TokenFallback::kNone));
  options.ca_file = args.tls.ca_file;
  options.cert_file = args.tls.cert_file;
  options.key_file = args.tls.key_file;
  options.cache_dir = args.cache_dir;
  options.client = args.client;
  options.use_delta = !args.no_delta;
  options.part_bytes = args.part_mib << 20;
  options.threads = args.threads;
  return options;
}

// --meta k=v: a number or true/false/null when it parses as JSON, else the string.
Result<nlohmann::json> ParseMeta(const std::vector<std::string>& pairs) {
  nlohmann::json metadata = nlohmann::json::object();
  for (const std::string& pair : pairs) {
    const size_t eq = pair.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Status::InvalidArgument("--meta '" + pair + "' is not KEY=VALUE");
    }
    const std::string value = pair.substr(eq + 1);
    nlohmann::json parsed = nlohmann::json::parse(value, nullptr, false);
    metadata[pair.substr(0, eq)] =
        parsed.is_discarded() || parsed.is_structured() || parsed.is_string() ? nlohmann::json(value)
                                                                               : parsed;
  }
  return metadata;
}

std::string RowLine(const nlohmann::json& row) {
  char text[512];
  std::snprintf(text, sizeof(text), "v%llu  %-7s %s  %s  keyframe %s  delta %s",
                static_cast<unsigned long long>(row.value("version", uint64_t{0})),
                row.value("source", std::string("?")).c_str(),
                row.value("weights_hash", std::string()).substr(0, 16).c_str(),
                row.value("created_at", std::string()).c_str(),
                FormatBytes(row.value("keyframe_bytes", uint64_t{0})).c_str(),
                FormatBytes(row.value("delta_bytes", uint64_t{0})).c_str());
  std::string line = text;
  if (row.contains("pinned_to") && !row["pinned_to"].is_null()) {
    line += "  pin of v" + std::to_string(row["pinned_to"].get<uint64_t>());
  }
  if (row.contains("metadata") && !row["metadata"].empty()) line += "  " + row["metadata"].dump();
  return line;
}

Status RunPush(const PushArgs& args) {
  FW_ASSIGN_OR_RETURN(sync::PushClientOptions options, ClientOptions(args));
  sync::PushRequest request;
  request.checkpoint = args.checkpoint;
  if (args.version > 0) request.version = args.version;
  FW_ASSIGN_OR_RETURN(request.metadata, ParseMeta(args.meta));
  ProgressBar bar;
  Result<sync::PushOutcome> pushed =
      sync::Push(options, request, [&bar](uint64_t sent, uint64_t total) { bar.Update(sent, total); });
  bar.Finish();
  if (!pushed.ok()) return Failed("push", pushed.status());
  const uint64_t version = pushed->row.value("version", uint64_t{0});
  nlohmann::json readiness;
  if (args.wait_fraction >= 0) {
    Result<nlohmann::json> served = sync::WaitServing(
        options, version, args.wait_fraction,
        std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000)));
    if (!served.ok()) return Failed("push: waiting for the fleet", served.status());
    readiness = *served;
  }
  if (args.json) {
    std::cout << nlohmann::json{{"row", pushed->row},
                                {"kind", pushed->kind},
                                {"uploaded_bytes", pushed->uploaded_bytes},
                                {"checkpoint_bytes", pushed->checkpoint_bytes},
                                {"sent_bytes", pushed->sent_bytes},
                                {"fell_back", pushed->fell_back},
                                {"resumes", pushed->resumes},
                                {"encode_seconds", pushed->encode_seconds},
                                {"upload_seconds", pushed->upload_seconds},
                                {"readiness", readiness}}
                     .dump()
              << "\n";
    return Status::Ok();
  }
  if (pushed->fell_back) std::cerr << "flywheel: delta refused, pushed in full: " << pushed->fallback_reason << "\n";
  std::printf("pushed %s: %s of %s uploaded (%.2f%%)\n%s\n", pushed->kind.c_str(),
              FormatBytes(pushed->uploaded_bytes).c_str(),
              FormatBytes(pushed->checkpoint_bytes).c_str(),
              100.0 * static_cast<double>(pushed->uploaded_bytes) /
                  static_cast<double>(std::max<uint64_t>(1, pushed->checkpoint_bytes)),
              RowLine(pushed->row).c_str());
  if (!readiness.is_null()) {
    std::printf("serving: %llu of %llu workers hold v%llu\n",
                static_cast<unsigned long long>(readiness.value("serving", uint64_t{0})),
                static_cast<unsigned long long>(readiness.value("workers", uint64_t{0})),
                static_cast<unsigned long long>(version));
  }
  return Status::Ok();
}

Status RunVersions(const PushArgs& args) {
  FW_ASSIGN_OR_RETURN(sync::PushClientOptions options, ClientOptions(args));
  Result<nlohmann::json> versions = sync::CallPublisher(options, "GET", "/v1/versions");
  if (!versions.ok()) return Failed("versions", versions.status());
  if (args.json) {
    std::cout << versions->dump(2) << "\n";
    return Status::Ok();
  }
  for (const nlohmann::json& row : (*versions)["versions"]) std::printf("%s\n", RowLine(row).c_str());
  const nlohmann::json& pin = (*versions)["pin"];
  std::printf("head v%llu%s\n",
              static_cast<unsigned long long>(versions->value("head_version", uint64_t{0})),
              pin.is_object() ? (", pinned to v" + std::to_string(pin["pinned_to"].get<uint64_t>()))
                                    .c_str()
                              : "");
  return Status::Ok();
}

Status RunPin(const PushArgs& args, bool pin) {
  FW_ASSIGN_OR_RETURN(sync::PushClientOptions options, ClientOptions(args));
  const nlohmann::json body =
      pin ? nlohmann::json{{"version", args.pin_version}, {"client", args.client}} : nlohmann::json::object();
  Result<nlohmann::json> answer = sync::CallPublisher(options, "POST", pin ? "/v1/pin" : "/v1/unpin", body);
  if (!answer.ok()) return Failed(pin ? "pin" : "unpin", answer.status());
  if (args.json) {
    std::cout << answer->dump() << "\n";
  } else if (pin) {
    std::printf("pinned to v%llu's weights\n%s\n",
                static_cast<unsigned long long>(args.pin_version), RowLine(*answer).c_str());
  } else {
    std::printf("unpinned; head v%llu\n",
                static_cast<unsigned long long>(answer->value("head_version", uint64_t{0})));
  }
  return Status::Ok();
}

void AddConnectionOptions(CLI::App* app, PushArgs& args, const char* flag) {
  app->add_option(flag, args.url, "The publisher's HTTP address (http://HOST:PORT or https://...)")
      ->type_name("URL")
      ->required();
  AddTokenFlags(app, args.tokens, "Bearer token (the push token; reads accept it too)");
  app->add_option("--ca", args.tls.ca_file, "CA file to verify an https:// publisher against")
      ->type_name("F");
  AddTlsFlags(app, args.tls,
              "Client certificate (PEM) for a publisher that requires one (its --tls-ca)", "");
  app->add_flag("--json", args.json, "Print JSON instead of text");
}

}  // namespace

void AddPushCommands(CLI::App& app, Action& action) {
  auto args = std::make_shared<PushArgs>();
  CLI::App* push = app.add_subcommand(
      "push",
      "Push a checkpoint to a publisher over HTTP (resumable; docs/PUSH_API.md).\n"
      "Keeps a copy of the last checkpoint pushed to each publisher and uploads only the\n"
      "delta from it when the publisher still holds that version (else the full checkpoint).");
  AddConnectionOptions(push, *args, "--to");
  push->add_option("checkpoint", args->checkpoint,
                   "A .safetensors file, or a directory (model.safetensors, or shards + index)")
      ->required();
  push->add_option("--version", args->version, "Version to publish (default: the head + 1)")
      ->type_name("N")
      ->check(CLI::Range(uint64_t{1}, UINT64_MAX));
  push->add_option("--meta", args->meta, "Metadata KEY=VALUE for the ledger (repeatable)")
      ->type_name("K=V");
  push->add_option("--wait", args->wait_fraction,
                   "Then wait until this fraction of the workers serve it (flag alone: 1.0)")
      ->type_name("FRACTION")
      ->expected(0, 1)
      ->default_str("1.0")
      ->check(CLI::Range(0.0, 1.0));
  push->add_option("--timeout", args->timeout_s, "Give up waiting after this long")
      ->type_name("S")
      ->capture_default_str();
  push->add_flag("--no-delta", args->no_delta, "Always upload the full checkpoint; no cache");
  push->add_option("--cache-dir", args->cache_dir,
                   "Local cache root (default: $FLYWHEEL_CACHE_DIR or ~/.cache/flywheel/push)")
      ->type_name("DIR");
  push->add_option("--client", args->client, "Who pushes, for the ledger (default: user@host)");
  push->add_option("--part-mib", args->part_mib, "Part size of the upload")
      ->type_name("MIB")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1024}));
  push->add_option("--threads", args->threads, "Delta encode threads")->type_name("N");
  push->footer(
      "\nExample:\n"
      "  flywheel push --to http://publisher:7080 --token-file push.token step12/ \\\n"
      "      --meta step=12 --meta loss=0.41 --wait");
  push->callback([args, push, &action] {
    if (push->count("--wait") > 0 && args->wait_fraction < 0) args->wait_fraction = 1.0;
    action = [args] { return RunPush(*args); };
  });

  CLI::App* versions = app.add_subcommand("versions", "List a publisher's version ledger");
  AddConnectionOptions(versions, *args, "--from");
  versions->callback([args, &action] { action = [args] { return RunVersions(*args); }; });

  CLI::App* pin = app.add_subcommand(
      "pin", "Roll the fleet back: publish version V's weights as a new version and hold them");
  AddConnectionOptions(pin, *args, "--to");
  pin->add_option("version", args->pin_version, "The version whose weights to serve")->required();
  pin->add_option("--client", args->client, "Who pins, for the ledger");
  pin->callback([args, &action] { action = [args] { return RunPin(*args, true); }; });

  CLI::App* unpin = app.add_subcommand("unpin", "Resume following pushes and drops");
  AddConnectionOptions(unpin, *args, "--to");
  unpin->callback([args, &action] { action = [args] { return RunPin(*args, false); }; });
}

}  // namespace flywheel::tools
