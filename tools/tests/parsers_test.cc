// Unit tests for the CLI's .npy reader/writer, flag parser and 16-bit float conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "src/core/half.h"
#include "tools/args.h"
#include "tools/npy.h"

namespace flashcte::tools {
namespace {

// A .npy image with an arbitrary header text (padded like numpy) and payload.
std::vector<uint8_t> Image(const std::string& dict, const std::vector<uint8_t>& payload,
                           int major = 1) {
  std::string header = dict;
  const size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + header.size() + 1) % 64) header += ' ';
  header += '\n';
  std::vector<uint8_t> out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major), 0};
  const uint32_t len = static_cast<uint32_t>(header.size());
  for (size_t i = 0; i < (major == 1 ? 2u : 4u); ++i) out.push_back((len >> (8 * i)) & 0xff);
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

std::vector<uint8_t> Int32Payload(const std::vector<int32_t>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::string ParseError(const std::vector<uint8_t>& image) {
  NpyArray a;
  std::string error;
  EXPECT_FALSE(parse_npy(image.data(), image.size(), &a, &error));
  EXPECT_FALSE(error.empty());
  return error;
}

TEST(Npy, RoundTripsEveryDtypeAndRank) {
  const float f[6] = {1, 2, 3, 4, 5, 6};
  const int64_t i64[6] = {-1, 2, -3, 4, -5, 1ll << 40};
  struct Case {
    NpyDtype dtype;
    const void* data;
  } cases[] = {{NpyDtype::kFloat32, f},
               {NpyDtype::kInt64, i64},
               {NpyDtype::kInt32, f},
               {NpyDtype::kFloat16, f},
               {NpyDtype::kFloat64, i64}};
  for (const Case& c : cases) {
    for (const std::vector<int64_t>& shape :
         {std::vector<int64_t>{}, {6}, {2, 3}, {1, 2, 3}, {1, 1, 2, 1, 3}, {0, 5}}) {
      const std::vector<uint8_t> bytes = serialize_npy(c.dtype, shape, c.data);
      EXPECT_EQ(bytes[6], 1) << "small headers are written as version 1.0";
      NpyArray a;
      std::string error;
      ASSERT_TRUE(parse_npy(bytes.data(), bytes.size(), &a, &error)) << error;
      EXPECT_EQ(a.dtype, c.dtype);
      EXPECT_EQ(a.shape, shape);
      ASSERT_EQ(a.data.size(), static_cast<size_t>(a.elements() * npy_itemsize(c.dtype)));
      // memcmp with a null pointer is undefined even for 0 bytes (UBSan): empty shapes skip it.
      if (!a.data.empty()) {
        EXPECT_EQ(0, std::memcmp(a.data.data(), c.data, a.data.size()));
      }
      EXPECT_EQ((bytes.size() - a.data.size()) % 64, 0u) << "data must start 64-byte aligned";
    }
  }
}

TEST(Npy, ReadsVersions2And3AndFortranOrder) {
  // A (2, 3) int32 array stored column-major: C order is 0 1 2 / 3 4 5.
  const std::vector<uint8_t> payload = Int32Payload({0, 3, 1, 4, 2, 5});
  for (int major : {1, 2, 3}) {
    NpyArray a;
    std::string error;
    const auto image =
        Image("{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3), }", payload, major);
    ASSERT_TRUE(parse_npy(image.data(), image.size(), &a, &error)) << error;
    std::vector<int32_t> got(6);
    std::memcpy(got.data(), a.data.data(), 24);
    EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 3, 4, 5})) << "version " << major;
  }
  // Harmless variations: double quotes, key order, no trailing comma, Python 2 longs.
  NpyArray a;
  std::string error;
  const auto image = Image("{\"shape\": (2L, 3L), \"fortran_order\": False, \"descr\": \"<i4\"}",
                           Int32Payload({0, 1, 2, 3, 4, 5}));
  ASSERT_TRUE(parse_npy(image.data(), image.size(), &a, &error)) << error;
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
}

TEST(Npy, RejectsMalformedFilesWithAReason) {
  const std::string ok = "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }";
  const std::vector<uint8_t> payload = Int32Payload({1, 2});
  EXPECT_NE(ParseError({'h', 'e', 'l', 'l', 'o'}).find("not a .npy file"), std::string::npos);
  // Every proper prefix of a valid file fails cleanly.
  const std::vector<uint8_t> full = Image(ok, payload);
  for (size_t n = 0; n < full.size(); ++n) {
    ParseError(std::vector<uint8_t>(full.begin(), full.begin() + n));
  }
  EXPECT_NE(ParseError(std::vector<uint8_t>(full.begin(), full.end() - 1)).find("truncated data"),
            std::string::npos);
  EXPECT_NE(ParseError(std::vector<uint8_t>(full.begin(), full.begin() + 40)).find("truncated"),
            std::string::npos);
  std::vector<uint8_t> extra = full;
  extra.push_back(0);
  EXPECT_NE(ParseError(extra).find("unexpected bytes"), std::string::npos);
  std::vector<uint8_t> version = full;
  version[6] = 4;
  EXPECT_NE(ParseError(version).find("version 4.0"), std::string::npos);
  auto header_error = [&](const std::string& dict) { return ParseError(Image(dict, payload)); };
  EXPECT_NE(
      header_error("{'descr': '>i4', 'fortran_order': False, 'shape': (2,), }").find("big-endian"),
      std::string::npos);
  EXPECT_NE(header_error("{'descr': '|b1', 'fortran_order': False, 'shape': (2,), }")
                .find("unsupported dtype '|b1'"),
            std::string::npos);
  EXPECT_NE(header_error("{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (2,), }")
                .find("structured"),
            std::string::npos);
  EXPECT_NE(header_error("{'descr': '<i4', 'shape': (2,), }").find("no 'fortran_order'"),
            std::string::npos);
  EXPECT_NE(header_error("{'descr': '<i4', 'descr': '<i4', 'fortran_order': False, 'shape': (2,)}")
                .find("twice"),
            std::string::npos);
  EXPECT_NE(header_error("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), 'x': 1}")
                .find("unexpected key 'x'"),
            std::string::npos);
  EXPECT_NE(header_error("{'descr': '<i4', 'fortran_order': False, 'shape': (-2,), }")
                .find("non-negative"),
            std::string::npos);
  EXPECT_NE(
      header_error("{'descr': '<i4', 'fortran_order': False, 'shape': (99999999999999999999,)}")
          .find("absurdly large"),
      std::string::npos);
  EXPECT_NE(header_error("{'descr': '<i4', 'fortran_order': False, 'shape': (4294967296, "
                         "4294967296, 4294967296), }")
                .find("too many"),
            std::string::npos);
  // A zero dimension makes any other dimension harmless.
  NpyArray a;
  std::string error;
  const auto empty =
      Image("{'descr': '<f4', 'fortran_order': True, 'shape': (0, 1099511627776), }", {});
  ASSERT_TRUE(parse_npy(empty.data(), empty.size(), &a, &error)) << error;
  EXPECT_EQ(a.elements(), 0);
}

TEST(Npy, FileErrorsNameTheFile) {
  NpyArray a;
  std::string error;
  EXPECT_FALSE(read_npy("/nonexistent/q.npy", &a, &error));
  EXPECT_EQ(error.rfind("/nonexistent/q.npy: cannot open", 0), 0u) << error;
}

std::vector<FlagSpec> Specs() {
  return {
      {"path", FlagKind::kString, "a file"},
      {"on", FlagKind::kBool, "a switch"},
      {"n", FlagKind::kInt, "a count", -3, 100},
      {"x", FlagKind::kFloat, "a number"},
      {"list", FlagKind::kIntList, "lengths", 0, 50},
      {"dtype", FlagKind::kChoice, "a dtype", 0, 0, "float32|bfloat16"},
  };
}

std::string FlagError(const std::vector<std::string>& args) {
  ParsedFlags f;
  std::string error;
  EXPECT_FALSE(ParseFlags(args, Specs(), &f, &error));
  return error;
}

TEST(Args, ParsesEveryKind) {
  ParsedFlags f;
  std::string error;
  ASSERT_TRUE(ParseFlags({"--path", "a.npy", "--on", "--n", "-3", "--x=0.5", "--list", "1,2,50",
                          "--dtype", "bfloat16"},
                         Specs(), &f, &error))
      << error;
  EXPECT_EQ(f.text("path"), "a.npy");
  EXPECT_TRUE(f.boolean("on", false));
  EXPECT_EQ(f.integer("n", 0), -3);
  EXPECT_EQ(f.real("x", 0), 0.5);
  EXPECT_EQ(f.list("list"), (std::vector<int64_t>{1, 2, 50}));
  EXPECT_EQ(f.text("dtype"), "bfloat16");
  EXPECT_EQ(f.integer("absent", 7), 7);
  for (const char* s : {"true", "1", "True"}) {
    ASSERT_TRUE(ParseFlags({"--on", s}, Specs(), &f, &error));
    EXPECT_TRUE(f.boolean("on", false));
  }
  for (const char* s : {"false", "0", "False"}) {
    ASSERT_TRUE(ParseFlags({"--on", s}, Specs(), &f, &error));
    EXPECT_FALSE(f.boolean("on", true));
  }
  ASSERT_TRUE(ParseFlags({"--n", "1", "--help"}, Specs(), &f, &error));
  EXPECT_TRUE(f.help_requested());
}

TEST(Args, ErrorsNameTheFlag) {
  EXPECT_EQ(FlagError({"--n", "101"}), "--n: 101 is out of range [-3, 100]");
  EXPECT_EQ(FlagError({"--n", "1x"}), "--n: expected an integer, got '1x'");
  EXPECT_EQ(FlagError({"--n", "99999999999999999999"}),
            "--n: expected an integer, got '99999999999999999999'");
  EXPECT_EQ(FlagError({"--n"}), "--n: missing value");
  EXPECT_EQ(FlagError({"--n", "--on"}), "--n: missing value");
  EXPECT_EQ(FlagError({"--on", "yes"}), "--on: expected true, false, 1 or 0, got 'yes'");
  EXPECT_EQ(FlagError({"--x", "inf"}), "--x: expected a finite number, got 'inf'");
  EXPECT_EQ(FlagError({"--x", " 1"}), "--x: expected a finite number, got ' 1'");
  EXPECT_EQ(FlagError({"--list", "1,,2"}),
            "--list: expected an integer or a comma-separated list of integers, got '1,,2'");
  EXPECT_EQ(FlagError({"--list", "51"}), "--list: 51 is out of range [0, 50]");
  EXPECT_EQ(FlagError({"--dtype", "int8"}),
            "--dtype: expected one of float32|bfloat16, got 'int8'");
  EXPECT_EQ(FlagError({"--dtype", "float"}),
            "--dtype: expected one of float32|bfloat16, got 'float'");
  // CLI11 hands an empty value and none alike to the parser: both are missing.
  EXPECT_EQ(FlagError({"--path", ""}), "--path: missing value");
  EXPECT_EQ(FlagError({"--n="}), "--n: missing value");
  EXPECT_EQ(FlagError({"--on", "--n"}), "--n: missing value");
  EXPECT_EQ(FlagError({"--", "--n", "1"}),
            "unexpected argument '--' (flags are written --name value)");
  EXPECT_EQ(FlagError({"--nope=1"}), "unknown flag '--nope' (--help lists the flags)");
  EXPECT_EQ(FlagError({"-n", "1"}), "unexpected argument '-n' (flags are written --name value)");
  EXPECT_EQ(FlagError({"--nope", "1"}), "unknown flag '--nope' (--help lists the flags)");
  EXPECT_EQ(FlagError({"--n", "1", "--n", "2"}), "--n: given twice");
  EXPECT_EQ(FlagError({"stray"}), "unexpected argument 'stray' (flags are written --name value)");
}

TEST(Args, StrictScalars) {
  int64_t v = 0;
  EXPECT_TRUE(ParseInt64("-9223372036854775808", &v));
  EXPECT_EQ(v, INT64_MIN);
  EXPECT_TRUE(ParseInt64("9223372036854775807", &v));
  EXPECT_EQ(v, INT64_MAX);
  EXPECT_FALSE(ParseInt64("9223372036854775808", &v));
  EXPECT_FALSE(ParseInt64("", &v));
  EXPECT_FALSE(ParseInt64("-", &v));
  EXPECT_FALSE(ParseInt64("1 ", &v));
  double d = 0;
  EXPECT_TRUE(ParseFiniteDouble("1e-3", &d));
  EXPECT_FALSE(ParseFiniteDouble("nan", &d));
  EXPECT_FALSE(ParseFiniteDouble("1e999", &d));
  EXPECT_FALSE(ParseFiniteDouble(std::string("1\0", 2), &d));
}

TEST(Half, RoundsToNearestEven) {
  EXPECT_EQ(half::float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(half::float_to_bf16(1.0f + 0x1p-8f), 0x3f80);      // tie -> even
  EXPECT_EQ(half::float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(half::float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_TRUE(std::isnan(half::bf16_to_float(half::float_to_bf16(std::nanf("")))));
  EXPECT_EQ(half::float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(half::float_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(half::float_to_f16(65520.0f), 0x7c00);  // tie at the top rounds to infinity
  EXPECT_EQ(half::float_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(half::float_to_f16(0x1p-25f), 0x0000);      // tie -> even zero
  EXPECT_EQ(half::float_to_f16(3 * 0x1p-26f), 0x0001);  // 0.75 of the smallest subnormal
  EXPECT_EQ(half::float_to_f16(-0x1p-14f), 0x8400);
  EXPECT_TRUE(std::isnan(half::f16_to_float(half::float_to_f16(std::nanf("")))));
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    ASSERT_EQ(half::float_to_f16(half::f16_to_float(static_cast<uint16_t>(h))), h);
  }
  // float64 goes to the 16-bit formats without rounding twice: 1 + 2^-8 + 2^-30 is above the
  // bf16 tie, but rounding it to float32 first would land exactly on the tie and go down.
  EXPECT_EQ(half::double_to_bf16(1.0 + 0x1p-8 + 0x1p-30), 0x3f81);
  EXPECT_EQ(half::double_to_f16(1.0 + 0x1p-11 + 0x1p-40), 0x3c01);
  EXPECT_EQ(half::double_to_bf16(1e300), 0x7f80);
}

}  // namespace
}  // namespace flashcte::tools
