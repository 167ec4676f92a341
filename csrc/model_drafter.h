// A drafter backed by a small model with its own context and KV cache.
#pragma once

#include <functional>
#include <vector>

#include "batch.h"
#include "drafter.h"
#include "model.h"

namespace specdec {

class ModelDrafter : public Drafter {
  public:
    // `decode` runs llama_decode on the draft context and throws on failure or cancellation.
    using DecodeFn = std::function<void(Model&, const Batch&)>;
    ModelDrafter(Model& model, int max_draft, DecodeFn decode);

    void begin(const std::vector<llama_token>& prompt) override;
    void propose(const std::vector<llama_token>& committed, int k, float p_min,
                 const SamplingParams& sampling, Rng& rng, Draft& out) override;

  private:
    // Makes the cache hold exactly committed[0..n-1) and decodes the rest, logits on the last.
    // Returns how many tokens it decoded.
    int catch_up(const std::vector<llama_token>& committed);
    // Appends tokens[from..to) to the cache; logits for the last one when asked.
    void decode_range(const std::vector<llama_token>& tokens, size_t from, size_t to,
                      bool logits_on_last);

    Model& model_;
    Batch batch_;
    DecodeFn decode_;
    std::vector<llama_token> cached_;  // tokens whose keys/values are in the draft's cache
    std::vector<Distribution> q_;
    SamplingWorkspace workspace_;
};

}  // namespace specdec
