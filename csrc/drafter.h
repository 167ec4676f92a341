// A draft: the tokens a drafter (n-gram lookup or draft model) proposes for one step.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "llama.h"
#include "sampling.h"

namespace specdec {

// kGrammar: the tokens a request's grammar forces next (a point mass each, like an n-gram's).
// kIndex: a copy from earlier requests' outputs (SharedNgramIndex); kNgram copies its own text;
// kPrediction copies the output the caller expects (Prediction).
enum class DraftSource { kModel = 0, kNgram = 1, kGrammar = 2, kIndex = 3, kPrediction = 4 };
constexpr int kDraftSources = static_cast<int>(DraftSource::kPrediction) + 1;

struct Draft {
    DraftSource source = DraftSource::kModel;
    std::vector<llama_token> tokens;
    // q for each token when sampling; nullptr marks a point-mass draft (q = 1 on the token).
    // Pointers stay valid until the next propose().
    std::vector<const Distribution*> q;
    // The first `forced` tokens are the grammar's (kGrammar), whatever `source` drafted after.
    int forced = 0;
    // Of them, the first `certain` are each the only token the grammar allows at its place:
    // accepted without the target's logits, whose rows then skip the output layer.
    int certain = 0;
    // Sampling: the draft model drafted q's argmax, a point mass; q is kept to measure both
    // acceptance rules.
    bool point_mass = false;
    // Tokens the drafter decoded to catch up with the committed text before drafting: one or
    // two in a step that follows a draft, more after steps without one.
    int caught_up = 0;
    double t_catch_up = 0.0;  // seconds the catching up took
    // The draft model's logits were NaN or infinite where it would have drafted next: the
    // draft stops there (the tokens before it are sound) and must not be trusted again.
    bool non_finite = false;
    // The draft model stopped short of K: its probability of its next token was below p_min.
    bool below_p_min = false;

    // Empties it for a copy from `from` (no model decoded: nothing caught up).
    void start_copy(DraftSource from) {
        tokens.clear();
        q.clear();
        source = from;
        caught_up = 0;
        t_catch_up = 0.0;
    }
};

}  // namespace specdec
