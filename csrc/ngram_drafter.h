// A model-free drafter: finds the most recent earlier occurrence of the sequence's last n tokens
// (n from ngram_max down to ngram_min) in the prompt + generated text, and proposes the tokens
// that followed it. Costs a few hash lookups per step.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "drafter.h"

namespace specdec {

class NgramDrafter {
  public:
    NgramDrafter(int ngram_min, int ngram_max);

    // Proposes up to k point-mass drafts (q = 1 on each token) to follow `committed` (prompt +
    // generated so far, only ever growing); none when there is no match.
    void propose(const std::vector<llama_token>& committed, int k, Draft& out);

  private:
    // Adds every n-gram that ends before the last token, so each maps to a known continuation.
    void index_up_to(const std::vector<llama_token>& tokens, size_t end);
    // Start of the continuation of the most recent earlier match of the last n tokens, or -1.
    long find_continuation(const std::vector<llama_token>& tokens, int n) const;

    int ngram_min_;
    int ngram_max_;
    // by_length_[n - ngram_min_]: hash of an n-gram -> index of the token that followed it
    std::vector<std::unordered_map<uint64_t, uint32_t>> by_length_;
    size_t indexed_ = 0;  // continuations at positions < indexed_ are in the maps
};

}  // namespace specdec
