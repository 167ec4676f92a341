#include "model_drafter.h"

#include <algorithm>
#include <chrono>

namespace specdec {

ModelDrafter::ModelDrafter(Model& model, int max_draft, DecodeFn decode)
    : model_(model),
      batch_(model.n_batch()),
      decode_(std::move(decode)),
      max_draft_(std::max(max_draft, 1)),
      q_(static_cast<size_t>(model.n_seq())) {}

void ModelDrafter::decode_range(llama_seq_id seq, const std::vector<llama_token>& tokens,
                                size_t from, size_t to, size_t logits_from,
                                const std::function<void(const Batch&)>& on_decoded) {
    const auto first_pos = static_cast<llama_pos>(model_.held(seq).size());
    decode_in_chunks(
        batch_, tokens, from, to, first_pos, logits_from, 0,
        [&](const Batch& b) {
            decode_(model_, b);
            if (on_decoded) on_decoded(b);
        },
        seq);
}

size_t ModelDrafter::prefill(llama_seq_id seq, const std::vector<llama_token>& committed,
                             size_t budget) {
    if (committed.size() < 2) return 0;
    const size_t end = committed.size() - 1;
    const size_t common = model_.keep_common_prefix(seq, committed, end);
    const size_t stop = std::min(end, common + budget);
    if (stop > common) decode_range(seq, committed, common, stop, stop);
    return stop - common;
}

llama_token ModelDrafter::token_at(const Job& job, size_t t) {
    const auto& committed = *job.committed;
    return t < committed.size() ? committed[t] : job.out->tokens[t - committed.size()];
}

void ModelDrafter::catch_up_all(std::vector<Job>& jobs) {
    rows_.assign(jobs.size(), -1);
    // Each sequence's share of the shared decode. A longer catch-up (after steps without
    // drafting) decodes its head alone first, so the shared decode fits one batch.
    const size_t share = std::max<size_t>(1, static_cast<size_t>(batch_.capacity()) / jobs.size());
    for (Job& job : jobs) {
        const auto& committed = *job.committed;
        const size_t end = committed.size() + job.out->tokens.size();  // forced tokens last
        // Generation::accept has rolled back this step's rejected draft already; the prefix
        // check (a scan of ints) keeps a slot that another request's tokens held honest.
        const size_t common = model_.keep_common_prefix(job.seq, committed, committed.size() - 1);
        job.out->caught_up = static_cast<int>(end - common);
        if (end - common <= share) continue;
        const size_t head_end = end - share;
        decode_range(job.seq, committed, common, std::min(head_end, committed.size()), end);
        if (head_end > committed.size())
            decode_range(job.seq, job.out->tokens, 0, head_end - committed.size(), end);
    }
    batch_.clear();
    for (size_t j = 0; j < jobs.size(); ++j) {
        const size_t end = jobs[j].committed->size() + jobs[j].out->tokens.size();
        for (size_t t = model_.held(jobs[j].seq).size(); t < end; ++t)
            batch_.add(token_at(jobs[j], t), static_cast<llama_pos>(t), t + 1 == end, jobs[j].seq);
        rows_[j] = batch_.size() - 1;
    }
    decode_(model_, batch_);
}

bool ModelDrafter::draft_next(Job& job, int row) {
    Draft& out = *job.out;
    const int n_vocab = model_.n_vocab();
    float* logits = llama_get_logits_ith(model_.ctx(), row);
    if (!all_finite(logits, n_vocab)) {
        out.non_finite = true;
        return false;
    }
    // q masked by the grammar: the draft proposes only what the target may accept.
    if (job.constraint && !mask_draft(job, logits, n_vocab)) return false;
    const size_t i = out.tokens.size();
    llama_token token;
    float confidence;
    const Distribution* q = nullptr;
    if (job.sampling->greedy()) {
        token = argmax(logits, n_vocab);
        confidence = job.p_min > 0.0f ? max_probability(logits, n_vocab, token) : 1.0f;
    } else {
        auto& qs = q_[static_cast<size_t>(job.seq)];
        if (qs.size() <= i) qs.resize(std::max(i + 1, static_cast<size_t>(max_draft_)));
        Distribution& dist = qs[i];
        make_distribution(logits, n_vocab, *job.sampling, workspace_, dist);
        token = job.argmax ? most_likely(dist) : sample(dist, *job.rng);
        confidence = dist[token];
        q = &dist;
    }
    if (i > 0 && confidence < job.p_min) {
        out.below_p_min = true;
        return false;
    }
    out.tokens.push_back(token);
    out.q.push_back(q);
    return !job.constraint || follow_draft(job, token);
}

// A grammar that fails here (past its limits, say) stops the draft: the request's own next
// use of it reports the error, and ends that request alone.
bool ModelDrafter::mask_draft(Job& job, float* logits, int n_vocab) {
    try {
        return job.constraint->mask(logits, n_vocab);
    } catch (...) {
        return false;
    }
}

bool ModelDrafter::follow_draft(Job& job, llama_token token) {
    // The grammar has no state after an end of generation: the draft ends with it.
    if (job.target->is_eog(token)) return false;
    try {
        job.constraint->consume(token);
    } catch (...) {
        return false;
    }
    ++job.consumed;
    return true;
}

namespace {
// Takes back the tokens each grammar took during the draft, however the draft ended. A failed
// rollback leaves the grammar in its error state, which ends that request when it next reads it.
struct GrammarRollback {
    std::vector<ModelDrafter::Job>& jobs;
    ~GrammarRollback() {
        for (auto& job : jobs) {
            if (!job.constraint) continue;
            try {
                job.constraint->rollback(job.consumed);
            } catch (...) {
            }
            job.consumed = 0;
        }
    }
};
}  // namespace

void ModelDrafter::propose(std::vector<Job>& jobs) {
    if (jobs.empty()) return;
    GrammarRollback rollback{jobs};
    for (Job& job : jobs) {
        Draft& out = *job.out;
        out.tokens.resize(static_cast<size_t>(out.forced));
        out.q.resize(static_cast<size_t>(out.forced));
        // A grammar that fails on them is left in its error state: the draft stops at once.
        if (job.constraint)
            for (llama_token t : out.tokens) follow_draft(job, t);
        out.source = DraftSource::kModel;
        out.point_mass = job.argmax && !job.sampling->greedy();
        out.non_finite = false;
        out.below_p_min = false;
    }
    const auto start = std::chrono::steady_clock::now();
    catch_up_all(jobs);
    const double t_catch_up =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (Job& job : jobs) job.out->t_catch_up = t_catch_up;
    // Each round picks one token per sequence still drafting and decodes them together. The
    // last draft token is never decoded here: the target verifies it, and if it is accepted the
    // next catch-up decodes it together with the target's token.
    while (true) {
        batch_.clear();
        for (size_t j = 0; j < jobs.size(); ++j) {
            if (rows_[j] < 0) continue;
            Job& job = jobs[j];
            const bool more =
                draft_next(job, rows_[j]) && static_cast<int>(job.out->tokens.size()) < job.k;
            rows_[j] = -1;
            if (!more) continue;
            const auto pos = static_cast<llama_pos>(model_.held(job.seq).size());
            batch_.add(job.out->tokens.back(), pos, true, job.seq);
            rows_[j] = batch_.size() - 1;
        }
        if (batch_.size() == 0) return;
        decode_(model_, batch_);
    }
}

}  // namespace specdec
