// The benches' shared reporting (bench/bench.h): the note printed under a
// table when a figure beat the reference it is measured against.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bench/report.h"

namespace strata::bench {
namespace {

std::string NoteOf(const std::vector<RatioFigure>& figures) {
  testing::internal::CaptureStdout();
  PrintAboveOneNote(figures, "the bound");
  return testing::internal::GetCapturedStdout();
}

TEST(AboveOneNoteTest, SilentWhileEveryFigureIsAtMostOne) {
  EXPECT_EQ(NoteOf({}), "");
  EXPECT_EQ(NoteOf({{"a ratio", 1.0, 1.0}, {"b ratio", 0.5, 0.999}}), "");
  EXPECT_EQ(NoteOf({{"c ratio", 0.9}}), "");  // no paired figure
}

TEST(AboveOneNoteTest, NamesEachFigureAboveOneAndTheReference) {
  const std::string note = NoteOf({{"host adamw fp32 efficiency", 1.028, 0.88},
                                   {"host sm3 fp32 efficiency", 0.84, 0.85},
                                   {"load ratio", 0.97, 1.004},
                                   {"uring read ratio", 1.2}});
  EXPECT_EQ(note.rfind("note: above 1 (", 0), 0u) << note;
  EXPECT_NE(note.find("host adamw fp32 efficiency 1.028, paired 0.880"),
            std::string::npos)
      << note;
  // A paired figure alone above 1 is named too.
  EXPECT_NE(note.find("load ratio 0.970, paired 1.004"), std::string::npos)
      << note;
  // Without a paired figure, none is printed.
  EXPECT_NE(note.find("; uring read ratio 1.200)"), std::string::npos) << note;
  EXPECT_EQ(note.find("sm3"), std::string::npos) << note;
  EXPECT_NE(note.find("): the bound was measured slower"), std::string::npos)
      << note;
  EXPECT_EQ(note.back(), '\n');
}

}  // namespace
}  // namespace strata::bench
