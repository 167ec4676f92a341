// A drafter backed by a small model with its own context: one context for every sequence, and
// the drafts of all sequences in a step decoded together.
#pragma once

#include <functional>
#include <vector>

#include "batch.h"
#include "constraint.h"
#include "drafter.h"
#include "model.h"

namespace specdec {

class ModelDrafter {
  public:
    // `decode` runs llama_decode on the draft context and throws on failure or cancellation.
    using DecodeFn = std::function<void(Model&, const Batch&)>;
    ModelDrafter(Model& model, int max_draft, DecodeFn decode);

    // One sequence's share of a batched draft.
    struct Job {
        llama_seq_id seq = 0;
        const std::vector<llama_token>* committed = nullptr;  // prompt + generated so far
        int k = 0;                                            // at most this many tokens
        float p_min = 0.0f;  // stop once the draft's own probability falls below this
        const SamplingParams* sampling = nullptr;
        Rng* rng = nullptr;
        bool argmax = false;  // sampling: draft q's argmax as a point mass instead of x ~ q
        // The request's grammar, at the committed text's state: q is masked to the tokens it
        // allows. The draft continues after out's forced tokens (out->forced), which the
        // draft model decodes first.
        Constraint* constraint = nullptr;
        const Model* target = nullptr;  // with a constraint: whose end-of-generation tokens end it
        Draft* out = nullptr;
        size_t consumed = 0;  // tokens the grammar took during the draft, rolled back after
    };

    // Drafts for every job at once (one job per sequence), after the forced tokens a job's
    // draft holds already. Sampled from q when sampling, q's argmax when greedy; a job stops early
    // (after at least one token, forced ones included) when the draft's probability of its next
    // token is below p_min. One decode catches every sequence up with its committed text, then one
    // decode per draft position holds a token of each sequence still drafting. The jobs give the
    // whole committed sequence: the catch-up decodes what the cache lacks of it, and keeps only
    // their common prefix where the cache holds something else (a slot's earlier request).
    // Generation::accept rolls back rejected draft tokens.
    void propose(std::vector<Job>& jobs);
    // Decodes up to `budget` tokens of what the cache of `seq` lacks of committed[0..n-1) (a
    // prompt, ahead of the first draft); returns how many it decoded.
    size_t prefill(llama_seq_id seq, const std::vector<llama_token>& committed, size_t budget);

  private:
    // Appends tokens[from..to) to the cache of `seq`, logits on tokens[logits_from..];
    // `on_decoded` runs after each decode, while its logits can still be read.
    void decode_range(llama_seq_id seq, const std::vector<llama_token>& tokens, size_t from,
                      size_t to, size_t logits_from,
                      const std::function<void(const Batch&)>& on_decoded = nullptr);
    // The first decode of a batched draft: each job's missing tokens, logits on its last.
    void catch_up_all(std::vector<Job>& jobs);
    // Picks the job's next draft token from the logits at `row`; false when it stops there.
    bool draft_next(Job& job, int row);
    // Masks the logits by the job's grammar; false when it allows nothing or failed.
    static bool mask_draft(Job& job, float* logits, int n_vocab);
    // The job's grammar moves past its drafted token; false when the draft ends there.
    static bool follow_draft(Job& job, llama_token token);
    // Token t of the job's committed text followed by its forced tokens.
    static llama_token token_at(const Job& job, size_t t);

    Model& model_;
    Batch batch_;
    DecodeFn decode_;
    int max_draft_;
    std::vector<std::vector<Distribution>> q_;  // [seq][draft position]
    SamplingWorkspace workspace_;
    std::vector<int> rows_;  // per job: its logits row in the last decode, -1 once it stopped
};

}  // namespace specdec
