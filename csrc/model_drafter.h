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
    bool can_look_back() const override { return true; }
    // Decodes all but the last committed token (the next draft decodes it, for its logits),
    // with logits on the rows that score committed[first..].
    void look_back(const std::vector<llama_token>& committed, size_t first,
                   const HindsightFn& score) override;

  private:
    // Makes the cache hold exactly committed[0..n-1) and decodes the rest, logits on the last.
    // Returns how many tokens it decoded.
    int catch_up(const std::vector<llama_token>& committed);
    // Appends tokens[from..to) to the cache, logits on tokens[logits_from..]; `on_decoded` runs
    // after each decode, while its logits can still be read.
    void decode_range(const std::vector<llama_token>& tokens, size_t from, size_t to,
                      size_t logits_from,
                      const std::function<void(const Batch&)>& on_decoded = nullptr);

    Model& model_;
    Batch batch_;
    DecodeFn decode_;
    std::vector<Distribution> q_;
    SamplingWorkspace workspace_;
};

}  // namespace specdec
