// The sampling maths: logits -> distribution under the transforms, and the rejection-sampling
// rule that makes speculative output follow the target's distribution exactly
// (Leviathan et al. 2023; Chen et al. 2023). Pure functions, no model needed.
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace specdec {

struct SamplingParams {
    float temperature = 0.0f;  // <= 0: greedy
    int top_k = 0;             // 0: off
    float top_p = 1.0f;        // 1: off
    float min_p = 0.0f;        // 0: off
    bool greedy() const { return temperature <= 0.0f; }
};

// Throws std::invalid_argument naming the first bad field.
void validate(const SamplingParams& params);

// A distribution over the vocabulary: dense probabilities (zero outside the support) and the ids
// where they are nonzero, so lookups are O(1) and walks touch only the support.
struct Distribution {
    std::vector<float> probs;
    std::vector<int32_t> support;
    float operator[](int32_t id) const { return probs[static_cast<size_t>(id)]; }
};

// Reusable scratch space, so the per-token path does not allocate.
struct SamplingWorkspace {
    struct Candidate {
        int32_t id;
        float value;
    };
    std::vector<Candidate> candidates;
};

class Rng {
  public:
    explicit Rng(uint64_t seed) : engine_(seed) {}
    // Uniform in [0, 1) with 53 random bits.
    double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

  private:
    std::mt19937_64 engine_;
};

// Whether every value is finite (no NaN, no infinity): one pass, cheap next to a decode.
bool all_finite(const float* values, int n);

int32_t argmax(const float* logits, int n_vocab);
// The most probable token of a distribution (the lowest id among equals).
int32_t most_likely(const Distribution& d);

// The best token and how far the runner-up's logit is below it (one pass over the row).
struct Top2 {
    int32_t best;
    float margin;
};
Top2 top2(const float* logits, int n_vocab);

// softmax(logits)[best] at temperature 1, where best is the argmax.
float max_probability(const float* logits, int n_vocab, int32_t best);

// A token's log-probability under softmax(logits) at temperature 1, and the `n_top` most
// likely tokens' (most likely first, the lowest id among equals).
struct TokenLogprob {
    int32_t token;
    float logprob;
    std::vector<std::pair<int32_t, float>> top;
};
// `ws` is scratch space, reused so that asking for logprobs does not allocate per token.
void token_logprob(const float* logits, int n_vocab, int32_t token, int n_top,
                   SamplingWorkspace& ws, TokenLogprob& out);

// Applies, in this order: temperature, softmax, top-k, top-p, min-p, renormalisation.
// Target and draft both go through this one function, so p and q always see the same transforms.
void make_distribution(const float* logits, int n_vocab, const SamplingParams& params,
                       SamplingWorkspace& ws, Distribution& out);

int32_t sample(const Distribution& dist, Rng& rng);

// min(1, p(x)/q(x)); q(x) = 0 cannot happen for a token drafted from q, and is treated as reject.
double acceptance_probability(float p_x, float q_x);

// The chance a draft drawn from q is accepted, before the draw: sum over x of min(p(x), q(x)),
// which is 1 - the residual's mass. The policy learns from this rather than from the one
// accept/reject outcome: the same mean, with far less noise.
double acceptance_chance(const Distribution& p, const Distribution& q);

// Accepts draft token x, drawn from q, with probability min(1, p(x)/q(x)).
bool accept_draft(const Distribution& p, const Distribution& q, int32_t x, Rng& rng);
// The same for a point-mass draft (q = 1 on x, as an n-gram draft is): accepts with p(x).
bool accept_point_draft(const Distribution& p, int32_t x, Rng& rng);

// After a rejection: a sample from norm(max(0, p - q)).
int32_t sample_residual(const Distribution& p, const Distribution& q, Rng& rng);
// After rejecting a point-mass draft x: a sample from p with x removed, renormalised.
int32_t sample_residual_point(const Distribution& p, int32_t x, Rng& rng);

}  // namespace specdec
