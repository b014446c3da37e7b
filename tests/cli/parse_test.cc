#include "bench/parse.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace strata::bench {
namespace {

TEST(ParseSizeTest, SuffixesArePowersOf1024) {
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("4K"), 4096u);
  EXPECT_EQ(*ParseSize("4kib"), 4096u);
  EXPECT_EQ(*ParseSize("1M"), 1u << 20);
  EXPECT_EQ(*ParseSize("2G"), uint64_t{2} << 30);
  EXPECT_EQ(*ParseSize("1TB"), uint64_t{1} << 40);
  EXPECT_EQ(*ParseSize(" 8 M "), 8u << 20);
}

TEST(ParseSizeTest, LargestValuesFitAndOneMoreDoesNot) {
  EXPECT_EQ(*ParseSize("18446744073709551615"),
            std::numeric_limits<uint64_t>::max());
  EXPECT_FALSE(ParseSize("18446744073709551616").ok());
  EXPECT_EQ(*ParseSize("16777215T"), uint64_t{16777215} << 40);
  EXPECT_FALSE(ParseSize("16777216T").ok());
  EXPECT_EQ(*ParseSize("8388608T"), uint64_t{1} << 63);
}

TEST(ParseSizeTest, OverflowIsAnErrorNamingTheValue) {
  for (const char* s : {"99999999999999999999999", "99999999999T",
                        "17179869184G", "18446744073709551616K"}) {
    auto v = ParseSize(s);
    ASSERT_FALSE(v.ok()) << s;
    EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(v.status().message().find("64 bits"), std::string::npos) << s;
  }
}

TEST(ParseSizeTest, GarbageIsRefused) {
  for (const char* s : {"", " ", "K", "-1", "1.5G", "1X", "abc", "1KK"}) {
    EXPECT_FALSE(ParseSize(s).ok()) << "'" << s << "'";
  }
}

TEST(ParseSizeOptionTest, RangeMessageNamesTheOption) {
  auto v = ParseSizeOption("--size", "0", 4096, 1u << 30);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(
      v.status().message().find("--size: 0 B is out of range 4 KiB..1 GiB"),
      std::string::npos)
      << v.status().message();
  auto o = ParseSizeOption("--size", "99999999999999999999999", 1, 2);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message().rfind("--size: ", 0), 0u);
}

TEST(ParseListTest, EmptyListsAreRefused) {
  EXPECT_FALSE(ParseSizeListOption("--sizes", "", 1, 10).ok());
  EXPECT_FALSE(ParseSizeListOption("--sizes", ",", 1, 10).ok());
  EXPECT_FALSE(ParseIntListOption("--threads", " , ", 0, 4).ok());
  EXPECT_FALSE(ParseChoiceListOption("--rw", "", {"read", "write"}).ok());
  auto c = ParseChoiceListOption("--pattern", ",", {"seq", "rand"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("--pattern: empty list"),
            std::string::npos);
}

TEST(ParseListTest, ItemsAreTrimmedAndDuplicatesDropped) {
  EXPECT_EQ(SplitList(" a, b ,,c "), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(
      *ParseChoiceListOption("--rw", "read,read,write", {"read", "write"}),
      (std::vector<std::string>{"read", "write"}));
  EXPECT_FALSE(ParseChoiceListOption("--rw", "read,bogus", {"read"}).ok());
}

TEST(ParseIntOptionTest, RangeAndSyntax) {
  EXPECT_EQ(*ParseIntOption("--reps", "7", 1, 10), 7);
  EXPECT_EQ(*ParseIntOption("--reps", "+7", 1, 10), 7);
  EXPECT_EQ(*ParseIntOption("--t", "-3", -5, 5), -3);
  auto zero = ParseIntOption("--queue-depth", "0", 1, 1024);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().message(),
            "--queue-depth: 0 is out of range 1..1024");
  for (const char* s : {"", "-", "abc", "1.5", "3x", "99999999999999999999999",
                        "-99999999999999999999"}) {
    EXPECT_FALSE(ParseIntOption("--threads", s, 0, 4096).ok()) << s;
  }
  EXPECT_FALSE(ParseIntOption("--threads", "-3", 0, 4096).ok());
  EXPECT_FALSE(ParseIntOption("--threads", "99999999999", 0, 4096).ok());
}

TEST(ParseDoubleOptionTest, RefusesNanInfAndOutOfRange) {
  EXPECT_DOUBLE_EQ(*ParseDoubleOption("--min-time", "0.5", 0, 10, true), 0.5);
  EXPECT_DOUBLE_EQ(*ParseDoubleOption("--latency-us", "0", 0, 10), 0.0);
  for (const char* s : {"nan", "NaN", "inf", "-inf", "-1", "0", "11", "", "x",
                        "1e999", "0.5s"}) {
    EXPECT_FALSE(ParseDoubleOption("--min-time", s, 0, 10, true).ok()) << s;
  }
}

TEST(FormatBytesTest, LargestDividingUnit) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(5000), "5000 B");
  EXPECT_EQ(FormatBytes(4096), "4 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 40), "3 TiB");
}

}  // namespace
}  // namespace strata::bench
