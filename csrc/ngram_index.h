// One n-gram index over the outputs of every request an engine has served, so that a request can
// copy what earlier ones wrote (agent loops repeat their tool calls, plans and quoted passages).
// A request's own text (its prompt among it) stays with its NgramDrafter; this index holds each
// finished output with the few prompt tokens before it, which key its first tokens.
//
// Scheduler thread only: requests add to it as they retire and draft from it while they step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "copy_policy.h"
#include "drafter.h"
#include "ngram_drafter.h"

namespace specdec {

// The vocabulary an index file's token ids belong to.
struct VocabKey {
    int32_t n_vocab;
    uint64_t fingerprint;  // vocab_fingerprint()
};

class SharedNgramIndex {
  public:
    // Below it an index holds too little to be worth its lookups.
    static constexpr size_t kMinBudget = 4096;

    // Bytes the index may hold (its tokens and its maps, estimated; kMinBudget at least); past
    // it the older half of what it holds is forgotten.
    SharedNgramIndex(int ngram_min, int ngram_max, size_t budget_bytes);

    // A finished request's output, keyed at its start by the prompt's last tokens.
    void add(const std::vector<llama_token>& prompt, const std::vector<llama_token>& output);
    // The most recent earlier output that continues `text`'s last tokens (longest key first);
    // `from` indexes the index's own tokens.
    NgramMatch match(const std::vector<llama_token>& text) const;
    // Up to k point-mass drafts continuing `m`: fewer where that output ended, or where a
    // token's context has not kept its continuation (steady_length).
    void propose(NgramMatch m, int k, Draft& out) const;
    // How many of the tokens continuing `m` (at most k) a copy takes: it stops where that output
    // ended and before a token whose context, at the depth the match reaches, went on
    // differently from one occurrence to the next more often than not, or went on otherwise at
    // its latest occurrence (a tool call's argument after its fixed shell; a line an edit loop
    // keeps changing). Where a context occurred once there is no such evidence.
    int steady_length(NgramMatch m, int k) const;
    // The n tokens continuing `m`, n at most steady_length(m, ...) (propose, measured before).
    void copy(NgramMatch m, int n, Draft& out) const;

    // What the index's drafts were accepted at, by match length, over every request: one
    // request says little, and agent loops send many short ones.
    CopyPolicy& copy_policy() { return copy_; }
    // Writes what it holds (outputs and copy evidence) to `path` (through a temporary file, so
    // a crash leaves the old one), for the vocabulary `vocab`; load() replaces what it holds
    // with a file's. Throws FileError on I/O errors and std::invalid_argument on a file that is
    // no index, or one for another vocabulary (another size, or the same size and other tokens).
    void save(const std::string& path, VocabKey vocab) const;
    void load(const std::string& path, VocabKey vocab);
    size_t bytes() const;
    size_t n_tokens() const { return tokens_.size(); }
    // Forgets everything (the copy evidence too): what add() or load() leave when they fail.
    void clear() noexcept;

  private:
    // Separates outputs, so that no match or draft runs from one into the next.
    static constexpr llama_token kBoundary = -1;
    // A match this long names a place in a text, not a phrase that recurs in many places: its
    // continuation's record is kept under a context of this many tokens (besides the keys').
    static constexpr int kPlaceTokens = 16;

    // What followed a context: where its latest occurrence's continuation is, and how steady
    // the continuation has been from one occurrence to the next.
    struct Continuation {
        uint32_t at = 0;
        uint16_t seen = 0;     // occurrences (counting stops at the type's maximum)
        uint16_t changes = 0;  // occurrences followed by another token than the one before
    };
    using ContextMap = std::unordered_map<uint64_t, Continuation>;
    static void record(ContextMap& map, uint64_t key, const std::vector<llama_token>& tokens,
                       size_t p);
    // The record of the `n` tokens before tokens_[p] (null: none, or another context's).
    const Continuation* context_before(const ContextMap& map, size_t p, int n) const;
    bool steady_at(size_t p, int matched) const;
    void index_from(size_t begin);
    bool write_file(int fd, VocabKey vocab) const;  // closes fd
    void forget_older_half();
    void fit_budget();

    int ngram_min_;
    int ngram_max_;
    size_t budget_;
    std::vector<llama_token> tokens_;  // outputs (each after its prompt's tail), kBoundary after
    // by_length_[n - ngram_min_]: hash of an n-gram -> what followed it
    std::vector<ContextMap> by_length_;
    ContextMap places_;  // hash of kPlaceTokens tokens -> what followed them
    CopyPolicy copy_;
};

}  // namespace specdec
