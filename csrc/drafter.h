// What the engine needs from anything that proposes draft tokens.
#pragma once

#include <vector>

#include "llama.h"
#include "sampling.h"

namespace specdec {

struct Draft {
    std::vector<llama_token> tokens;
    // q for each token when sampling; nullptr marks a point-mass draft (q = 1 on the token).
    // Pointers stay valid until the next propose().
    std::vector<const Distribution*> q;
};

class Drafter {
public:
    virtual ~Drafter() = default;
    // Starts a new generation: forgets all state, then reads the prompt.
    virtual void begin(const std::vector<llama_token>& prompt) = 0;
    // Proposes up to k tokens to follow `committed` (prompt + generated so far). Sampled from q
    // when sampling, q's argmax when greedy. Catching up with, or rolling back to, `committed`
    // is the drafter's job: it sees the whole sequence each time.
    virtual void propose(const std::vector<llama_token>& committed, int k,
                         const SamplingParams& sampling, Rng& rng, Draft& out) = 0;
};

}  // namespace specdec
