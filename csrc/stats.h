// The counters and timers of one generation.
#pragma once

#include <string>
#include <vector>

#include "drafter.h"

namespace specdec {

struct Stats {
    int n_prompt = 0;                // prompt tokens
    int n_prompt_cached = 0;         // of them, already in the target's cache (not decoded again)
    int n_prompt_chunks = 0;         // target decodes that read part of the rest
    int n_generated = 0;             // tokens in the result
    bool first_from_prompt = false;  // the first came with the prompt's decode (in t_prompt)
    int n_target_passes = 0;         // target decodes after the prompt (one per step)
    int n_drafted = 0;               // draft tokens proposed
    int n_accepted = 0;              // draft tokens accepted
    int n_cut = 0;                   // committed tokens dropped by EOG, a stop string or max_tokens
    int n_speculative_steps = 0;     // steps that drafted at least one token
    int n_fallback_steps = 0;        // adaptive steps that chose target-only decoding
    int n_p_min_stops = 0;           // model drafts cut short by draft_p_min
    int n_draft_read = 0;            // tokens the draft model read: the prompt, then catch-ups
    std::string fallback_reason;     // why, when any did (short request, low acceptance, ...)
    std::string draft_error;         // why drafting was dropped for this request ("" if it was not)
    int n_shared_steps = 0;          // steps whose target decode held other requests' rows too
    bool recalibrated = false;       // its steps found the costs off; they were measured again
    std::vector<int> steps_at_k;     // [k]: steps that drafted k tokens
    // by DraftSource: model, n-gram, grammar, shared index, prediction
    int drafted_by[kDraftSources] = {};
    int n_argmax_drafted = 0;  // sampling: model drafts that were q's argmax (point masses)
    int accepted_by[kDraftSources] = {};
    int n_prediction = 0;  // tokens of the request's prediction (as far as the context goes)
    int n_prediction_in_output = 0;  // of them, the output's (their longest common subsequence)
    std::vector<int> accepted_at;    // [i]: times draft position i+1 was accepted
    std::vector<int> proposed_at;    // [i]: times draft position i+1 was proposed
    double t_queue = 0.0;            // seconds: waiting for the engine (another call ran)
    double t_prompt = 0.0;           // seconds: prompt decode, both models
    double t_first_token = 0.0;      // seconds: from the call to its first token (0: none)
    double t_draft = 0.0;            // seconds: drafting
    double t_verify = 0.0;           // seconds: target decodes and acceptance
    double t_total = 0.0;            // seconds: the whole call

    void count_proposal(int k) {
        if (steps_at_k.size() <= static_cast<size_t>(k)) steps_at_k.resize(k + 1, 0);
        ++steps_at_k[k];
        n_drafted += k;
        if (k > 0) ++n_speculative_steps;
        if (proposed_at.size() < static_cast<size_t>(k)) proposed_at.resize(k, 0);
        for (int i = 0; i < k; ++i) ++proposed_at[i];
    }
    // Every field under the name callers see (drafted_by and accepted_by split by source): the
    // one list the bindings build a request's stats from.
    template <typename Field>
    void visit(Field&& field) const {
        field("n_prompt", n_prompt);
        field("n_prompt_cached", n_prompt_cached);
        field("n_prompt_chunks", n_prompt_chunks);
        field("n_generated", n_generated);
        field("first_from_prompt", first_from_prompt);
        field("n_target_passes", n_target_passes);
        field("n_drafted", n_drafted);
        field("n_accepted", n_accepted);
        field("n_cut", n_cut);
        field("n_speculative_steps", n_speculative_steps);
        field("n_fallback_steps", n_fallback_steps);
        field("n_p_min_stops", n_p_min_stops);
        field("n_draft_read", n_draft_read);
        field("fallback_reason", fallback_reason);
        field("draft_error", draft_error);
        field("n_shared_steps", n_shared_steps);
        field("recalibrated", recalibrated);
        field("steps_at_k", steps_at_k);
        field("drafted_by_model", drafted_by[0]);
        field("accepted_by_model", accepted_by[0]);
        field("drafted_by_ngram", drafted_by[1]);
        field("accepted_by_ngram", accepted_by[1]);
        field("drafted_by_grammar", drafted_by[2]);
        field("accepted_by_grammar", accepted_by[2]);
        field("drafted_by_index", drafted_by[3]);
        field("accepted_by_index", accepted_by[3]);
        field("drafted_by_prediction", drafted_by[4]);
        field("accepted_by_prediction", accepted_by[4]);
        field("n_prediction", n_prediction);
        field("n_prediction_in_output", n_prediction_in_output);
        field("n_argmax_drafted", n_argmax_drafted);
        field("accepted_at", accepted_at);
        field("proposed_at", proposed_at);
        field("t_queue", t_queue);
        field("t_prompt", t_prompt);
        field("t_first_token", t_first_token);
        field("t_draft", t_draft);
        field("t_verify", t_verify);
        field("t_total", t_total);
    }
    void count_acceptance(int n) {
        n_accepted += n;
        if (accepted_at.size() < proposed_at.size()) accepted_at.resize(proposed_at.size(), 0);
        for (int i = 0; i < n; ++i) ++accepted_at[i];
    }
};

}  // namespace specdec
