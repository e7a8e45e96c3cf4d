// A test suite base with a fresh directory of test certificates
// (transport::WriteTestCertificates: ca, server, client, rogue), removed after the suite.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>

#include "transport/certs.h"

namespace flywheel::transport {

class CertificateSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "flywheel_certs_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = new std::string(pattern);
    const Status status = WriteTestCertificates(*dir_);
    ASSERT_TRUE(status.ok()) << status.ToString();
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
    dir_ = nullptr;
  }
  static std::string Path(const std::string& name) { return *dir_ + "/" + name; }

  static inline std::string* dir_ = nullptr;
};

}  // namespace flywheel::transport
