// A model-free drafter: finds the most recent earlier occurrence of the sequence's last n tokens
// (n from ngram_max down to ngram_min: long keys first) in the prompt + generated text, and
// proposes the tokens that followed it. Costs a few hash lookups per step.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "drafter.h"

namespace specdec {

// Which requests draft n-gram copies (of their own text, of the shared index).
enum class NgramUse {
    kOff,
    // Requests under `auto` weigh copies against the draft model each step; a fixed K drafts
    // with the model alone.
    kUnderAuto,
    // Every request: a fixed K copies first and asks the model where there is no match.
    kAlways,
};

// Where the text's end repeats earlier text: the continuation starts at committed[from], and
// the `length` tokens before it equal the text's last `length` (length >= the key that found it).
struct NgramMatch {
    long from = -1;  // -1: no match
    int length = 0;
    bool found() const { return from >= 0; }
};

// FNV-1a over n token ids: the key of an n-gram.
uint64_t hash_tokens(const llama_token* tokens, int n);
// How many tokens before a[a_end] equal those before b[b_end], counting on from `known` that are
// (at most NgramDrafter::kMaxMatchLength; never before a[0] or b[0]).
int matched_length(const llama_token* a, long a_end, const llama_token* b, long b_end, int known);

class NgramDrafter {
  public:
    // How far back a match is measured: past this, a longer match tells little more.
    static constexpr int kMaxMatchLength = 64;

    NgramDrafter(int ngram_min, int ngram_max);

    // The match a draft would continue, for `committed` (prompt + generated so far, only ever
    // growing).
    NgramMatch match(const std::vector<llama_token>& committed);
    // Proposes up to k point-mass drafts (q = 1 on each token) to follow `committed`; none when
    // there is no match.
    void propose(const std::vector<llama_token>& committed, int k, Draft& out);
    // The same, continuing a match found on this `committed`.
    static void propose(const std::vector<llama_token>& committed, NgramMatch m, int k, Draft& out);

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
