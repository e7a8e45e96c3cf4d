// `flywheel certs` and `flywheel keys generate`: credentials.
#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "sync/signing.h"
#include "tools/commands.h"
#include "transport/certs.h"

namespace flywheel::tools {
namespace {

struct CertsArgs {
  std::string out_dir;
  std::vector<std::string> hosts;
  int days = transport::CertificateOptions().valid_days;
};

Status RunCerts(const CertsArgs& args) {
  transport::CertificateOptions options;
  if (!args.hosts.empty()) options.hosts = args.hosts;
  options.valid_days = args.days;
  Status status = transport::WriteTestCertificates(args.out_dir, options);
  if (!status.ok()) return Failed("cannot write certificates to " + args.out_dir, status);
  for (const char* name : {"ca.crt", "ca.key", "server.crt", "server.key", "client.crt",
                           "client.key", "rogue-ca.crt", "rogue.crt", "rogue.key"}) {
    std::cout << args.out_dir << "/" << name << "\n";
  }
  std::cout.flush();
  return Status::Ok();
}

Status RunKeysGenerate(const std::string& out_dir) {
  Result<sync::KeyFiles> files = sync::GenerateSigningKeys(out_dir);
  if (!files.ok()) return Failed("keys generate", files.status());
  std::cout << files->private_key << "  (keep on the publisher: --signing-key; mode 0600)\n"
            << files->public_key << "  (give to relays and workers: --trust-key)\n"
            << "key id " << files->key_id << "\n";
  std::cout.flush();
  return Status::Ok();
}

}  // namespace

void AddCertsCommands(CLI::App& app, Action& action) {
  auto out_dir = std::make_shared<std::string>();
  CLI::App* keys = app.add_subcommand("keys", "Signing keys for published versions");
  keys->require_subcommand(1);
  CLI::App* generate = keys->add_subcommand(
      "generate",
      "Write an Ed25519 key pair: DIR/signing.key (private, mode 0600) and DIR/signing.pub.\n"
      "The publisher signs every version with --signing-key DIR/signing.key; relays and\n"
      "workers given --trust-key DIR/signing.pub refuse anything it did not sign. Existing\n"
      "key files are never overwritten.");
  generate->add_option("--out", *out_dir, "Directory to write (created if missing)")
      ->type_name("DIR")
      ->required();
  generate->footer(
      "\nExample (rotation: trust both keys, switch the publisher, then drop the old one):\n"
      "  flywheel keys generate --out /etc/flywheel/keys-2026-11\n"
      "  flywheel publish ... --signing-key /etc/flywheel/keys-2026-11/signing.key\n"
      "  flywheel worker ... --trust-key keys-2026-10/signing.pub --trust-key keys-2026-11/signing.pub");
  generate->callback([out_dir, &action] { action = [out_dir] { return RunKeysGenerate(*out_dir); }; });

  auto args = std::make_shared<CertsArgs>();
  CLI::App* certs = app.add_subcommand(
      "certs",
      "Write a test CA and server/client certificates for --tls-cert/--tls-key/--tls-ca.\n"
      "EC P-256 keys (mode 0600), SHA-256 signatures; also a rogue client certificate from\n"
      "an unrelated CA, for checking that untrusted clients are refused. For testing and\n"
      "development: the CA key is written beside the certificates.");
  certs->add_option("--out", args->out_dir, "Directory to write (created if missing)")
      ->type_name("DIR")
      ->required();
  certs
      ->add_option("--host", args->hosts,
                   "Server name or IP address for the server certificate; repeat for more\n"
                   "(default: localhost 127.0.0.1 ::1)")
      ->type_name("H");
  certs->add_option("--days", args->days, "Validity in days")
      ->type_name("N")
      ->default_val(args->days)
      ->check(CLI::Range(1, 36500).description(""));
  certs->footer(
      "\nExample:\n"
      "  flywheel certs --out certs/ --host trainer.internal --host 10.0.0.5\n"
      "  (publisher, relay, worker: --tls-cert certs/server.crt --tls-key certs/server.key\n"
      "   --tls-ca certs/ca.crt; server.crt serves and dials, client.crt only dials)");
  certs->callback([args, &action] { action = [args] { return RunCerts(*args); }; });
}

}  // namespace flywheel::tools
