#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench/util.h"
#include "delta/delta_file.h"

namespace flywheel::bench {

Status WriteMarkdownSection(const std::string& path, const std::string& heading,
                            const std::string& section) {
  std::string text;
  if (std::filesystem::exists(path)) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return Status::IOError("cannot read " + path);
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::string out;
  bool replaced = false;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (!replaced && lines[i].rfind(heading, 0) == 0) {
      out += section;
      replaced = true;
      size_t next = i + 1;
      while (next < lines.size() && lines[next].rfind("## ", 0) != 0) ++next;
      if (next < lines.size()) out += "\n";
      i = next - 1;
      continue;
    }
    out += lines[i] + "\n";
  }
  if (!replaced) {
    if (!out.empty() && out.back() != '\n') out += "\n";
    if (!out.empty()) out += "\n";
    out += section;
  }
  return delta::WriteFileAtomically(path, std::as_bytes(std::span(out)));
}

}  // namespace flywheel::bench
