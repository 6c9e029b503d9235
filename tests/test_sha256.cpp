// core/io/sha256.h against FIPS 180-4's example vectors, Python's hashlib, and itself in odd chunks and on a file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "core/io/sha256.h"

using dflash::io::Sha256;
using dflash::io::sha256_file;
using dflash::io::sha256_hex;

TEST(Sha256, FipsVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, ChunksAndFilesGiveTheSameHash) {
  std::string text;
  for (int i = 0; i < 5000; ++i) text += static_cast<char>((i * 131 + i / 7) & 0xff);
  const std::string whole = sha256_hex(text);
  EXPECT_EQ(whole, "e24f488618dfc305d3a54c74feec4ede97d2a787b2d96ff6518788670fb29ab6");  // Python's hashlib
  for (size_t chunk : {1, 3, 55, 56, 63, 64, 65, 1000}) {
    Sha256 s;
    for (size_t p = 0; p < text.size(); p += chunk) s.update(std::string_view(text).substr(p, chunk));
    EXPECT_EQ(s.hex(), whole) << "chunk " << chunk;
  }
  const auto path = std::filesystem::temp_directory_path() / ("dflash_sha256_" + std::to_string(::getpid()) + ".bin");
  std::ofstream(path, std::ios::binary) << text;
  EXPECT_EQ(sha256_file(path.string()), whole);
  std::filesystem::remove(path);
  try {
    sha256_file(path.string());
    FAIL() << "no error for a missing file";
  } catch (const dflash::Error& e) {
    EXPECT_NE(std::string(e.message()).find(path.string()), std::string::npos) << e.message();
  }
}
