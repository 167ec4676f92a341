// The output a caller expects (OpenAI's predicted outputs: a file's text before an edit, say),
// drafted by copying it: point masses, accepted where the output keeps to it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "drafter.h"
#include "ngram_drafter.h"

namespace specdec {

// The output is read against the prediction as it grows: while it keeps to the prediction, the
// copy goes on from where it stands (a line the text repeats is continued at its own place, not
// at its last occurrence); where it went its own way, its last n tokens find the place again,
// the first after where it last kept to it.
class Prediction {
  public:
    Prediction(std::vector<llama_token> tokens, int ngram_min, int ngram_max);

    // Where a copy would continue, for `seq` (prompt + output), whose output starts at
    // `output_start`: `from` indexes the prediction; length counts matched output tokens.
    NgramMatch match(const std::vector<llama_token>& seq, size_t output_start);
    // Up to k tokens of the prediction from m.from.
    void copy(NgramMatch m, int k, Draft& out) const;
    // How many of the prediction's tokens `output` holds, in order: their longest common
    // subsequence (OpenAI's accepted prediction tokens; the rest are its rejected ones).
    size_t tokens_in(const std::vector<llama_token>& output) const;

  private:
    // Follows the output from where it was read last; `at_` is -1 where it went its own way.
    void follow(const std::vector<llama_token>& seq, size_t output_start);
    // The first continuation at or after `after` of the output's last n tokens, else the first.
    long find(const std::vector<llama_token>& seq, int n, long after) const;

    std::vector<llama_token> tokens_;
    int ngram_min_;
    int ngram_max_;
    // keys_[n - ngram_min_]: (hash of an n-gram, the position that follows it), sorted: flat,
    // so that a long prediction costs 12 bytes a token per key length and one sort to build.
    std::vector<std::vector<std::pair<uint64_t, uint32_t>>> keys_;
    size_t read_ = 0;  // seq positions follow() has read
    long at_ = 0;      // the prediction's position the output goes on at; -1: none
    long last_ = 0;    // where the output last kept to the prediction
};

// The length of a's and b's longest common subsequence, in O(|a| |b| / 64) time and O(|a|)
// memory (bit-parallel, after Allison and Dix / Hyyrö).
size_t common_subsequence(const std::vector<llama_token>& a, const std::vector<llama_token>& b);

}  // namespace specdec
