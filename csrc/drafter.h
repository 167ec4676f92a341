// What the engine needs from anything that proposes draft tokens.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "llama.h"
#include "sampling.h"

namespace specdec {

enum class DraftSource { kModel = 0, kNgram = 1 };

struct Draft {
    DraftSource source = DraftSource::kModel;
    std::vector<llama_token> tokens;
    // q for each token when sampling; nullptr marks a point-mass draft (q = 1 on the token).
    // Pointers stay valid until the next propose().
    std::vector<const Distribution*> q;
    // Tokens the drafter decoded to catch up with the committed text before drafting: one or
    // two in a step that follows a draft, more after steps without one.
    int caught_up = 0;
    double t_catch_up = 0.0;  // seconds the catching up took
    // The draft model's logits were NaN or infinite where it would have drafted next: the
    // draft stops there (the tokens before it are sound) and must not be trusted again.
    bool non_finite = false;
};

// Receives, for token t of the committed text, the draft's logits for the token after
// committed[0..t): what it would have drafted there.
using HindsightFn = std::function<void(size_t t, const float* logits)>;

class Drafter {
  public:
    virtual ~Drafter() = default;
    // Starts a new generation: forgets all state, then reads the prompt.
    virtual void begin(const std::vector<llama_token>& prompt) = 0;
    // Proposes up to k tokens to follow `committed` (prompt + generated so far). Sampled from q
    // when sampling, q's argmax when greedy. Catching up with, or rolling back to, `committed`
    // is the drafter's job: it sees the whole sequence each time.
    // Stops early (after at least one token) when the draft's own probability of its next
    // token is below p_min.
    virtual void propose(const std::vector<llama_token>& committed, int k, float p_min,
                         const SamplingParams& sampling, Rng& rng, Draft& out) = 0;
    // Whether look_back() works: a model drafter's catch-up yields its logits for free.
    virtual bool can_look_back() const { return false; }
    // Catches up with `committed` and calls `score` for each token from `first` on (fewer if
    // the cache already held some).
    virtual void look_back(const std::vector<llama_token>& /*committed*/, size_t /*first*/,
                           const HindsightFn& /*score*/) {}
};

// Asks each drafter in turn and keeps the first non-empty draft (e.g. n-gram, then model).
class FallbackDrafter : public Drafter {
  public:
    FallbackDrafter(std::unique_ptr<Drafter> first, std::unique_ptr<Drafter> second)
        : first_(std::move(first)), second_(std::move(second)) {}
    void begin(const std::vector<llama_token>& prompt) override {
        first_->begin(prompt);
        second_->begin(prompt);
    }
    void propose(const std::vector<llama_token>& committed, int k, float p_min,
                 const SamplingParams& sampling, Rng& rng, Draft& out) override {
        first_->propose(committed, k, p_min, sampling, rng, out);
        if (out.tokens.empty()) second_->propose(committed, k, p_min, sampling, rng, out);
    }

  private:
    std::unique_ptr<Drafter> first_;
    std::unique_ptr<Drafter> second_;
};

}  // namespace specdec
