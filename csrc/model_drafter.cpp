#include "model_drafter.h"

#include <algorithm>
#include <chrono>

namespace specdec {

ModelDrafter::ModelDrafter(Model& model, int max_draft, DecodeFn decode)
    : model_(model),
      batch_(model.n_batch()),
      decode_(std::move(decode)),
      q_(static_cast<size_t>(std::max(max_draft, 1))) {}

void ModelDrafter::begin(const std::vector<llama_token>& /*prompt*/) {
    // The prompt is decoded by the first propose(): a generation that never drafts (the
    // adaptive policy may decide so) never pays for it. What the cache already holds of it
    // (the previous request's prefix) is kept: catch_up() decodes only the rest.
}

void ModelDrafter::decode_range(const std::vector<llama_token>& tokens, size_t from, size_t to,
                                size_t logits_from,
                                const std::function<void(const Batch&)>& on_decoded) {
    const auto first_pos = static_cast<llama_pos>(model_.held().size());
    decode_in_chunks(batch_, tokens, from, to, first_pos, logits_from, 0, [&](const Batch& b) {
        decode_(model_, b);
        if (on_decoded) on_decoded(b);
    });
}

int ModelDrafter::catch_up(const std::vector<llama_token>& committed) {
    const size_t common = model_.keep_common_prefix(committed, committed.size() - 1);
    decode_range(committed, common, committed.size(), committed.size() - 1);
    return static_cast<int>(committed.size() - common);
}

void ModelDrafter::look_back(const std::vector<llama_token>& committed, size_t first,
                             const HindsightFn& score) {
    if (committed.size() < 2) return;
    const size_t end = committed.size() - 1;
    const size_t common = model_.keep_common_prefix(committed, end);
    // Row t - 1 holds the logits for token t; positions are indices into `committed`.
    decode_range(committed, common, end, std::max<size_t>(first, 1) - 1, [&](const Batch& b) {
        const llama_batch& raw = b.get();
        for (int32_t row = 0; row < raw.n_tokens; ++row)
            if (raw.logits[row])
                score(static_cast<size_t>(raw.pos[row]) + 1,
                      llama_get_logits_ith(model_.ctx(), row));
    });
}

void ModelDrafter::propose(const std::vector<llama_token>& committed, int k, float p_min,
                           const SamplingParams& sampling, Rng& rng, Draft& out) {
    out.tokens.clear();
    out.q.clear();
    out.source = DraftSource::kModel;
    out.non_finite = false;
    if (static_cast<size_t>(k) > q_.size()) q_.resize(static_cast<size_t>(k));
    const auto start = std::chrono::steady_clock::now();
    out.caught_up = catch_up(committed);
    out.t_catch_up =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int n_vocab = model_.n_vocab();
    for (int i = 0; i < k; ++i) {
        const float* logits = llama_get_logits_ith(model_.ctx(), -1);
        if (!all_finite(logits, n_vocab)) {
            out.non_finite = true;
            break;
        }
        llama_token token;
        float confidence;
        const Distribution* q = nullptr;
        if (sampling.greedy()) {
            token = argmax(logits, n_vocab);
            confidence = p_min > 0.0f ? max_probability(logits, n_vocab, token) : 1.0f;
        } else {
            Distribution& dist = q_[static_cast<size_t>(i)];
            make_distribution(logits, n_vocab, sampling, workspace_, dist);
            token = sample(dist, rng);
            confidence = dist[token];
            q = &dist;
        }
        if (i > 0 && confidence < p_min) break;
        out.tokens.push_back(token);
        out.q.push_back(q);
        // The last draft token is never decoded here: the target verifies it, and if it is
        // accepted the next catch_up() decodes it together with the target's token.
        if (i + 1 < k)
            decode_range(out.tokens, static_cast<size_t>(i), static_cast<size_t>(i) + 1,
                         static_cast<size_t>(i));
    }
}

}  // namespace specdec
