#include "generation.h"

#include <algorithm>
#include <cfloat>
#include <limits>
#include <utility>

#include "errors.h"

namespace specdec {

#ifdef SPECDEC_TEST_HOOKS
std::atomic<bool> wrong_residual_for_tests{false};
std::atomic<bool> stale_penalties_for_tests{false};
std::atomic<long> verdicts_without_logits_for_tests{0};
#endif

const char* finish_reason_name(FinishReason reason) {
    switch (reason) {
        case FinishReason::kNone:
            return "";
        case FinishReason::kStop:
            return "stop";
        case FinishReason::kLength:
            return "length";
        case FinishReason::kContext:
            return "context";
        case FinishReason::kCancelled:
            return "cancelled";
        case FinishReason::kTimeout:
            return "timeout";
    }
    return "";
}

Generation::Generation(const EngineParts& parts, std::shared_ptr<RequestChannel> channel,
                       llama_seq_id seq, const AdaptivePolicy& policy)
    : parts_(parts),
      channel_(std::move(channel)),
      req_(channel_->request),
      seq_id_(seq),
      policy_(policy),
      rng_(req_.seed),
      text_(req_.stop),
      n_draft_(req_.n_draft >= 0 ? req_.n_draft : parts.default_n_draft),
      constraint_(std::move(channel_->constraint)) {
    if (!req_.ngram_index) parts_.index = nullptr;
    const bool engine_drafts = parts_.drafter != nullptr || parts_.ngram != NgramUse::kOff;
    adaptive_ = speculates_adaptively(req_, engine_drafts);
    // A prediction says the output copies known text: where the engine has no other drafter,
    // the request's own text is looked up too.
    const bool own_copies = parts_.ngram == NgramUse::kAlways ||
                            (parts_.ngram == NgramUse::kUnderAuto && adaptive_) ||
                            (!req_.prediction.empty() && !parts_.drafter);
    if (own_copies) ngram_.emplace(parts_.ngram_min, parts_.ngram_max);
    if (!req_.prediction.empty()) {
        // Past the context the output cannot go: the rest would only cost memory.
        const auto n = std::min(req_.prediction.size(), static_cast<size_t>(parts_.target.n_ctx()));
        stats().n_prediction = static_cast<int>(n);
        prediction_.emplace(
            std::vector<llama_token>(req_.prediction.begin(),
                                     req_.prediction.begin() + static_cast<long>(n)),
            parts_.ngram_min, parts_.ngram_max);
    }
    if (!can_draft(req_, engine_drafts)) n_draft_ = 0;
    if (req_.adaptive && can_draft(req_, engine_drafts) && !adaptive_) {
        n_draft_ = 0;
        stats().fallback_reason = "short request";
    }
    draft_reads_prompt_ahead_ = parts_.drafter != nullptr && !adaptive_ && n_draft_ > 0;
    draft_knows_prompt_ = draft_reads_prompt_ahead_;
    if (penalized()) token_counts_.assign(static_cast<size_t>(parts_.target.n_vocab()), 0);
    if (repeat_penalized()) repeat_stamp_.assign(static_cast<size_t>(parts_.target.n_vocab()), 0);
}

void Generation::begin() {
    admitted_ = Clock::now();
    stats().t_queue = seconds_since(channel_->called);
    stats().n_prompt = static_cast<int>(req_.prompt.size());
    if (adaptive_) policy_.begin_generation();
    seq_ = req_.prompt;
    // The target's cache holds all committed tokens but the last, which each step decodes
    // together with the draft.
    // A scored prompt is read whole: a cached prefix has no logits left to score it with.
    prefilled_ =
        parts_.target.keep_servable_prefix(seq_id_, seq_, scores_prompt() ? 0 : seq_.size() - 1);
    stats().n_prompt_cached = static_cast<int>(prefilled_);
}

int Generation::add_prefill(Batch& batch, int budget) {
    const size_t end = std::min(req_.prompt.size() - 1, prefilled_ + static_cast<size_t>(budget));
    chunk_from_ = prefilled_;
    chunk_first_row_ = batch.size();
    for (size_t i = prefilled_; i < end; ++i)
        batch.add(seq_[i], static_cast<llama_pos>(i), scores_prompt(), seq_id_);
    const int added = static_cast<int>(end - prefilled_);
    prefilled_ = end;
    // The draft reads the prompt alongside, so its first draft does not have to; that read is
    // part of the prompt's cost.
    if (draft_reads_prompt_ahead_) {
        const auto start = Clock::now();
        stats().n_draft_read +=
            static_cast<int>(parts_.drafter->prefill(seq_id_, seq_, static_cast<size_t>(added)));
        stats().t_prompt += seconds_since(start);
    }
    return added;
}

void Generation::prefill_decoded(double seconds) {
    stats().t_prompt += seconds;
    ++stats().n_prompt_chunks;
    if (scores_prompt()) score_prompt_rows();
}

// The row of prompt position i scores the prompt's token i + 1 (the chunk ends before the
// prompt's last token, whose row is the first step's).
void Generation::score_prompt_rows() {
    const int n_vocab = parts_.target.n_vocab();
    for (size_t i = chunk_from_; i < prefilled_; ++i) {
        const float* logits = llama_get_logits_ith(
            parts_.target.ctx(), chunk_first_row_ + static_cast<int32_t>(i - chunk_from_));
        if (!all_finite(logits, n_vocab))
            throw NonFiniteLogitsError("the target model " + parts_.target.path() +
                                       " produced non-finite logits (NaN or Inf) for the prompt "
                                       "token at position " +
                                       std::to_string(i + 1) +
                                       ": the model file or the backend is broken");
        token_logprob(logits, n_vocab, seq_[i + 1], req_.prompt_logprobs, workspace_,
                      result_.prompt_logprobs.emplace_back());
    }
}

void Generation::add_first_row(Batch& batch) {
    k_ = 0;
    forget_draft();
    add_verify_rows(batch);
}

void Generation::check_stop() {
    if (finished()) return;
    if (channel_->cancel_requested()) {
        finish(FinishReason::kCancelled);
    } else if (channel_->past_deadline()) {
        finish(FinishReason::kTimeout);
    } else if (static_cast<int>(seq_.size()) > parts_.target.n_ctx()) {
        finish(FinishReason::kContext);
    }
}

// The most tokens this step may draft: bounded by the context, by what may still be emitted and
// by the room the batch leaves this sequence.
int Generation::draft_cap() const {
    if (drafting_dropped_) return 0;
    const int room_in_context = parts_.target.n_ctx() - static_cast<int>(seq_.size());
    const int still_wanted = req_.max_tokens - static_cast<int>(result_.tokens.size()) - 1;
    int cap = std::min({parts_.max_draft, room_in_context, still_wanted});
    if (parts_.draft)
        cap = std::min(cap, parts_.draft->n_ctx() - static_cast<int>(seq_.size()) + 1);
    return std::max(cap, 0);
}

void Generation::size_room(int row_cap) { cap_ = std::max(std::min(draft_cap(), row_cap - 1), 0); }

int Generation::choose_k(int row_cap) {
    size_room(row_cap);
    const int cap = cap_;
    if (!adaptive_) {
        k_ = std::max(0, std::min(n_draft_, cap));
        return k_;
    }
    if (choose_copy(cap)) return k_;
    if (!parts_.drafter) {  // n-gram only, and nothing worth copying
        k_ = 0;
        return k_;
    }
    fallback_why_.clear();
    const int k = policy_.choose(cap, &fallback_why_);
    falling_back_ = k == 0 && cap > 0;
    k_ = std::max(k, 0);
    return k_;
}

void Generation::hold_target_only(int row_cap) {
    size_room(row_cap);  // forced tokens still fill it
    k_ = 0;
    copying_ = false;
    falling_back_ = true;
    fallback_why_ = "slower than the target alone, as measured";
}

double Generation::modelled_target_only_rate() const {
    return policy_.calibrated() ? 1.0 / policy_.verify_cost(1) : 0.0;
}

// The longest model draft the policy can weigh, at most `cap`.
int Generation::model_cap(int cap) const {
    return std::min({cap, policy_.max_k(), static_cast<int>(policy_.verify_costs().size()) - 1});
}

int Generation::plan_cap() const {
    if (copying_ || !parts_.drafter) return k_;
    return model_cap(cap_);
}

// Under `auto`, a copy (of the request's own text, of the shared index or of the prediction,
// whichever is expected to commit faster) is drafted when copying it is expected to commit
// tokens faster than target-only and than the draft model's best K: each step uses the better
// proposal.
bool Generation::choose_copy(int cap) {
    copying_ = false;
    if ((!ngram_ && !prediction_) || !policy_.calibrated() || cap <= 0) return false;
    int best = 0;
    double best_rate = 0.0;
    const auto consider = [&](DraftSource from, const CopyPolicy& copy, NgramMatch m, int k_cap) {
        const auto [k, rate] = best_copy(copy, m, k_cap);
        if (k > 0 && rate > best_rate) {
            best = k;
            best_rate = rate;
            match_ = m;
            copy_from_ = from;
        }
    };
    if (ngram_) consider(DraftSource::kNgram, copy_, ngram_->match(seq_), cap);
    if (ngram_ && parts_.index) {
        const NgramMatch shared = parts_.index->match(seq_);
        const int steady = parts_.index->steady_length(shared, cap);
        consider(DraftSource::kIndex, parts_.index->copy_policy(), shared, steady);
    }
    if (prediction_)
        consider(DraftSource::kPrediction, *parts_.prediction_copy,
                 prediction_->match(seq_, req_.prompt.size()), cap);
    if (best == 0) return false;
    if (parts_.drafter) {
        for (double rate : policy_.expected_rates(model_cap(cap)))
            if (rate >= best_rate) return false;
    }
    k_ = best;
    copying_ = true;
    return true;
}

std::pair<int, double> Generation::best_copy(const CopyPolicy& copy, NgramMatch m, int cap) {
    int best = 0;
    double best_rate = 1.0 / policy_.verify_cost(1);
    if (!m.found()) return {best, best_rate};
    copy.expected_tokens(m.length, cap, copy_expected_);
    for (int k = 1; k <= cap; ++k) {
        const double rate = copy_expected_[static_cast<size_t>(k)] / policy_.verify_cost(k + 1);
        if (rate > best_rate) {
            best = k;
            best_rate = rate;
        }
    }
    return {best, best_rate};
}

void Generation::expected_tokens(int cap, std::vector<double>& out) const {
    if (copying_)
        copy_policy().expected_tokens(match_.length, cap, out);
    else
        policy_.expected_tokens(cap, out);
}

void Generation::drop_drafting(const std::string& why) {
    drafting_dropped_ = true;
    stats().draft_error = why;
}

void Generation::forget_draft() {
    draft_.source = DraftSource::kModel;
    draft_.tokens.clear();
    draft_.q.clear();
    draft_.point_mass = false;
    draft_.forced = 0;
    draft_.certain = 0;
    draft_.caught_up = 0;
    draft_.t_catch_up = 0.0;
    draft_.non_finite = false;
    draft_.below_p_min = false;
    t_draft_step_ = 0.0;
}

// Forced tokens are near-certain drafts that cost no model: under `auto` (and on an engine with
// nothing else to draft with, unless the request asked for K = 0) they fill the step's whole
// room, even where the policy would not draft with the model; a fixed K bounds them.
bool Generation::draft_forced() {
    forget_draft();
    const bool nothing_else = !parts_.drafter && parts_.ngram == NgramUse::kOff;
    const int room = adaptive_ || (nothing_else && req_.n_draft != 0) ? cap_ : k_;
    if (!constraint_ || !parts_.grammar_drafts || room <= 0) return false;
    const auto start = Clock::now();
    constraint_->forced_tokens(draft_.tokens, static_cast<size_t>(room));
    if (draft_.tokens.empty()) return false;
    draft_.source = DraftSource::kGrammar;
    draft_.forced = static_cast<int>(draft_.tokens.size());
    draft_.certain = static_cast<int>(constraint_->sole_prefix(draft_.tokens));
    draft_.q.assign(draft_.tokens.size(), nullptr);
    t_draft_step_ = seconds_since(start);
    return true;
}

bool Generation::draft_by_copy() {
    if (k_ == 0 || (!ngram_ && !prediction_) || (adaptive_ && !copying_)) return false;
    const auto start = Clock::now();
    if (copying_)
        copy_chosen();
    else
        copy_first_found();
    t_draft_step_ = seconds_since(start);
    return !draft_.tokens.empty();
}

void Generation::copy_chosen() {
    switch (copy_from_) {
        case DraftSource::kIndex:  // k_ is within the steady length choose_copy measured
            parts_.index->copy(match_, k_, draft_);
            break;
        case DraftSource::kPrediction:
            prediction_->copy(match_, k_, draft_);
            break;
        default:
            NgramDrafter::propose(seq_, match_, k_, draft_);
    }
}

// A fixed K copies from the prediction first, then from the request's own text, then from
// earlier outputs.
void Generation::copy_first_found() {
    if (prediction_) prediction_->copy(prediction_->match(seq_, req_.prompt.size()), k_, draft_);
    if (draft_.tokens.empty() && ngram_) ngram_->propose(seq_, k_, draft_);
    if (draft_.tokens.empty() && ngram_ && parts_.index)
        parts_.index->propose(parts_.index->match(seq_), k_, draft_);
}

bool Generation::drafts_argmax() const {
    switch (req_.draft_rule) {
        case DraftRule::kSample:
            return false;
        case DraftRule::kArgmax:
            return true;
        case DraftRule::kAuto:
            break;
    }
    return chance_argmax_ > chance_sampled_;
}

int Generation::model_k() const {
    const int forced = draft_.forced;
    if (forced == 0) return k_;
    // K was sized for a copy, which the forced tokens displaced.
    if (copying_) return 0;
    return std::max(0, std::min(k_, (adaptive_ ? cap_ : k_) - forced));
}

ModelDrafter::Job Generation::model_job() {
    ModelDrafter::Job job;
    job.seq = seq_id_;
    job.committed = &seq_;
    job.k = draft_.forced + model_k();
    // Drafts that ignore the grammar (grammar_drafts off) are cut at their first invalid token.
    job.constraint = parts_.grammar_drafts ? constraint_.get() : nullptr;
    job.target = &parts_.target;
    job.p_min = req_.draft_p_min;
    job.sampling = &req_.sampling;
    job.rng = &rng_;
    job.argmax = !greedy() && drafts_argmax();
    job.out = &draft_;
    return job;
}

void Generation::drafted(double seconds) {
    t_draft_step_ += seconds;
    if (constraint_) keep_valid_draft();
    if (draft_.non_finite) drop_drafting("the draft model's logits are not finite (NaN/Inf)");
    stats().count_proposal(static_cast<int>(draft_.tokens.size()));
    stats().n_draft_read += draft_.caught_up;
    draft_read_prompt_ = !draft_knows_prompt_ && draft_.caught_up > 0;
    draft_knows_prompt_ = draft_knows_prompt_ || draft_.caught_up > 0;
    if (draft_.below_p_min) ++stats().n_p_min_stops;
    // A fallback the batch plan overrode (drafting after all, or forced tokens) is not one.
    if (falling_back_ && k_ == 0 && !has_draft()) {
        ++stats().n_fallback_steps;
        if (!fallback_why_.empty()) stats().fallback_reason = fallback_why_;
    }
    falling_back_ = false;
    const int n = static_cast<int>(draft_.tokens.size());
    count_by_source(stats().drafted_by, n);
    if (draft_.point_mass) stats().n_argmax_drafted += n - std::min(n, draft_.forced);
    stats().t_draft += t_draft_step_;
}

void Generation::count_by_source(int (&by)[kDraftSources], int n) const {
    const int forced = std::min(n, draft_.forced);
    by[static_cast<int>(DraftSource::kGrammar)] += forced;
    if (draft_.source != DraftSource::kGrammar) by[static_cast<int>(draft_.source)] += n - forced;
}

void Generation::count_verdict(llama_token token) {
    if (!penalized()) return;
    if (token_counts_[static_cast<size_t>(token)]++ == 0) counted_.push_back(token);
}

void Generation::apply_penalties(float* logits) {
    if (repeat_penalized()) apply_repeat_penalty(logits);
    for (llama_token t : counted_) {
        int n = token_counts_[static_cast<size_t>(t)];
#ifdef SPECDEC_TEST_HOOKS
        if (stale_penalties_for_tests.load())
            n -= static_cast<int>(std::count(step_tokens_.begin(), step_tokens_.end(), t));
#endif
        if (n > 0)
            logits[t] -= req_.presence_penalty + req_.frequency_penalty * static_cast<float>(n);
    }
}

// The row's window is the sequence before it: the committed tokens and this step's verdicts so
// far (the drafted tokens the rows before it accepted).
void Generation::apply_repeat_penalty(float* logits) {
    size_t verdicts = step_tokens_.size();
#ifdef SPECDEC_TEST_HOOKS
    if (stale_penalties_for_tests.load()) verdicts = 0;
#endif
    const size_t length = seq_.size() + verdicts;
    const size_t window =
        req_.repeat_last_n < 0 ? length : std::min(length, static_cast<size_t>(req_.repeat_last_n));
    const uint32_t call = ++repeat_call_;
    for (size_t i = length - window; i < length; ++i) {
        const llama_token t = i < seq_.size() ? seq_[i] : step_tokens_[i - seq_.size()];
        auto& stamp = repeat_stamp_[static_cast<size_t>(t)];
        if (stamp == call) continue;
        stamp = call;
        // Clamped: an extreme penalty must leave finite logits (an infinite one would make the
        // row's distribution NaN).
        float& logit = logits[t];
        logit = logit > 0.0f ? std::min(logit / req_.repeat_penalty, FLT_MAX)
                             : std::max(logit * req_.repeat_penalty, -FLT_MAX);
    }
}

void Generation::advance_constraint(llama_token token) {
    // An end-of-generation token ends the request: a finished grammar allows it, and has no
    // state after it to move to.
    if (constraint_ && !parts_.target.is_eog(token)) constraint_->consume(token);
}

void Generation::keep_valid_draft() {
    size_t keep = constraint_->valid_prefix(draft_.tokens);
    // A token drafted from q that the grammar forbids is rejected for certain, and the residual
    // drawn there, norm(max(0, p - q)), depends on q: it stays, so that the draw is the one
    // exactness needs. A forbidden point mass (an n-gram token, q's argmax) is rejected with
    // p(x) = 0 and the draw is from p: that is the next position's own, so it goes.
    const bool sampled_from_q = keep < draft_.tokens.size() && keep < draft_.q.size() &&
                                draft_.q[keep] != nullptr && !draft_.point_mass && !greedy();
    if (sampled_from_q) ++keep;
    draft_.tokens.resize(keep);
    if (draft_.q.size() > keep) draft_.q.resize(keep);
}

// Row i scores draft token i + 1: a certain one needs no logits unless logprobs are asked for.
void Generation::add_verify_rows(Batch& batch) {
    base_ = seq_.size();
    first_row_ = batch.size();
    const size_t k = draft_.tokens.size();
    const size_t certain = req_.logprobs < 0 ? certain_drafted() : 0;
    batch.add(seq_.back(), static_cast<llama_pos>(base_ - 1), certain == 0, seq_id_);
    for (size_t i = 0; i < k; ++i)
        batch.add(draft_.tokens[i], static_cast<llama_pos>(base_ + i), i + 1 >= certain, seq_id_);
}

size_t Generation::certain_drafted() const {
    return std::min(static_cast<size_t>(draft_.certain), draft_.tokens.size());
}

// Row i of this sequence's rows scores the token after [.., last, d1..di]. Non-finite logits
// have no right answer to give, so they end the request with an error.
const float* Generation::target_logits(size_t row) {
    float* logits =
        llama_get_logits_ith(parts_.target.ctx(), first_row_ + static_cast<int32_t>(row));
    if (!all_finite(logits, parts_.target.n_vocab()))
        throw NonFiniteLogitsError(
            "the target model " + parts_.target.path() +
            " produced non-finite logits (NaN or Inf) for the token at position " +
            std::to_string(base_ + row) + ": the model file or the backend is broken");
    for (const auto& [token, bias] : req_.logit_bias) logits[token] += bias;
    if (req_.ignore_eos)
        for (llama_token t : parts_.target.eog_tokens())
            logits[t] = -std::numeric_limits<float>::infinity();
    // Penalties and the grammar's place are after the verdicts of the rows before this one
    // (accept() reads the rows in order and hands each verdict to both).
    apply_penalties(logits);
    if (constraint_) constraint_->mask(logits);
    return logits;
}

const Distribution& Generation::target_distribution(size_t row) {
    make_distribution(target_logits(row), parts_.target.n_vocab(), req_.sampling, workspace_, p_);
    return p_;
}

void Generation::accept(double t_verify, bool shared, bool with_prompt) {
    const auto start = Clock::now();
    const size_t k = draft_.tokens.size();
    step_tokens_.clear();
    step_margins_.clear();
    accept_chances_.clear();
    const size_t certain = certain_drafted();
    size_t i = 0;
    for (; i < k; ++i) {
        const llama_token x = draft_.tokens[i];
        const llama_token verdict = i < certain ? certain_verdict(i, x)
                                    : greedy()  ? greedy_verdict(i)
                                                : sampled_verdict(i, x);
        step_tokens_.push_back(verdict);
        record_logprob(i, verdict);
        advance_constraint(verdict);
        count_verdict(verdict);
        if (verdict != x) break;
    }
    if (i == k) {
        step_tokens_.push_back(target_token(k));
        record_logprob(k, step_tokens_.back());
        advance_constraint(step_tokens_.back());
        count_verdict(step_tokens_.back());
    }
    const auto n_accepted = static_cast<int>(i);
    stats().count_acceptance(n_accepted);
    count_by_source(stats().accepted_by, n_accepted);
    const double t_step_verify = t_verify + seconds_since(start);
    if (with_prompt) {
        stats().first_from_prompt = true;
        stats().t_prompt += t_step_verify;
    } else {
        ++stats().n_target_passes;
        if (shared) ++stats().n_shared_steps;
        stats().t_verify += t_step_verify;
    }

    int committed = 0;
    for (size_t j = 0; j < step_tokens_.size(); ++j) committed += commit(j);
    stats().n_cut += static_cast<int>(step_tokens_.size()) - committed;
    hand_over_text();
    // The first token from the prompt's last chunk: no K was chosen, nothing to learn; forced
    // tokens say nothing of the draft model or of copies, and a step that holds them measures
    // no model draft alone.
    if (adaptive_ && !with_prompt && draft_.forced == 0) {
        StepOutcome outcome{static_cast<int>(k), n_accepted,       t_draft_step_,
                            t_step_verify,       draft_.caught_up, draft_.t_catch_up};
        outcome.shared = shared;
        outcome.t_decode = t_verify;
        outcome.context = static_cast<int>(base_);
        if (!greedy()) outcome.accept_chance = &accept_chances_;
        if (copying_) {
            copy_policy().observe(match_.length, outcome.k, n_accepted, outcome.accept_chance);
            policy_.observe_verify_cost(outcome);
        } else {
            policy_.observe(outcome);
        }
    }
    // Both caches roll back to the accepted prefix: positions at or past the first rejected
    // draft token hold keys/values of tokens that were not committed (the draft's cache holds
    // its draft but the last token, which it never decoded).
    const auto accepted_end = static_cast<llama_pos>(base_ + i);
    parts_.target.forget_from(seq_id_, accepted_end);
    if (draft_.source == DraftSource::kModel && k > 1)
        parts_.draft->forget_from(seq_id_, accepted_end);
}

// The only token the grammar allows: the target's masked law is a point mass on it, whatever
// its logits (read only for logprobs), and no draw is taken.
llama_token Generation::certain_verdict(size_t row, llama_token x) {
    if (req_.logprobs >= 0) target_logits(row);  // masked in place for record_logprob
#ifdef SPECDEC_TEST_HOOKS
    else
        ++verdicts_without_logits_for_tests;
#endif
    if (greedy()) step_margins_.push_back(std::numeric_limits<float>::infinity());
    return x;
}

// Greedy: the target's argmax at row i (the draft token when they agree).
llama_token Generation::greedy_verdict(size_t row) {
    const Top2 t = top2(target_logits(row), parts_.target.n_vocab());
    step_margins_.push_back(t.margin);
    return t.best;
}

// Sampling: x when accepted (prob min(1, p/q)), else a draw from the residual.
llama_token Generation::sampled_verdict(size_t row, llama_token x) {
    const Distribution& p = target_distribution(row);
    const Distribution* q = draft_.q[row];
    // A point mass: an n-gram draft, or the draft model's argmax (x is then q's argmax).
    const bool point = !q || draft_.point_mass;
    // Each a pass over q's support per position: only when the policy or the rule reads them.
    double sampled = 0.0;
    if (q && (adaptive_ || req_.draft_rule == DraftRule::kAuto)) {
        sampled = acceptance_chance(p, *q);
        chance_sampled_ += sampled;
        chance_argmax_ += p[point ? x : most_likely(*q)];
    }
    if (adaptive_) accept_chances_.push_back(point ? double(p[x]) : sampled);
    const bool ok = point ? accept_point_draft(p, x, rng_) : accept_draft(p, *q, x, rng_);
    if (ok) return x;
#ifdef SPECDEC_TEST_HOOKS
    if (wrong_residual_for_tests.load()) return sample(p, rng_);
#endif
    return point ? sample_residual_point(p, x, rng_) : sample_residual(p, *q, rng_);
}

// The token after an all-accepted draft (the bonus), or the only token of a K=0 step.
llama_token Generation::target_token(size_t row) {
    if (greedy()) return greedy_verdict(row);
    return sample(target_distribution(row), rng_);
}

// The verdict's row as the verdict read it (target_logits masked it in place already).
void Generation::record_logprob(size_t row, llama_token verdict) {
    if (req_.logprobs < 0) return;
    const size_t j = step_tokens_.size() - 1;
    if (step_logprobs_.size() <= j) step_logprobs_.resize(j + 1);
    const float* logits =
        llama_get_logits_ith(parts_.target.ctx(), first_row_ + static_cast<int32_t>(row));
    token_logprob(logits, parts_.target.n_vocab(), verdict, req_.logprobs, workspace_,
                  step_logprobs_[j]);
}

// Appends the step's j-th verdict to the output unless generation already finished; returns 1
// if it did.
int Generation::commit(size_t j) {
    const llama_token token = step_tokens_[j];
    if (finished()) return 0;
    if (parts_.target.is_eog(token)) {
        if (greedy()) result_.stop_margin = step_margins_[j];
        if (req_.logprobs >= 0) result_.stop_logprob.assign(1, step_logprobs_[j]);
        finish(FinishReason::kStop);
        return 0;
    }
    if (result_.tokens.empty()) stats().t_first_token = seconds_since(channel_->called);
    seq_.push_back(token);
    result_.tokens.push_back(token);
    if (greedy()) result_.margins.push_back(step_margins_[j]);
    const std::string piece = parts_.target.token_piece(token);
    if (req_.logprobs >= 0) held_logprobs_.emplace_back(bytes_in_, step_logprobs_[j]);
    bytes_in_ += piece.size();
    emit(text_.push(piece));
    if (text_.stopped()) {
        finish(FinishReason::kStop);
    } else if (static_cast<int>(result_.tokens.size()) >= req_.max_tokens) {
        finish(FinishReason::kLength);
    }
    return 1;
}

// The caller is woken once per step (hand_over_text), not per token: each wake-up is a thread
// switch (and, from Python, a GIL hand-over) on cores the decode needs.
// A token's logprob goes out with the first of its text (at the `last` text, every one left,
// unless a stop string dropped their text).
void Generation::emit(const std::string& text, bool last) {
    const bool all = last && !text_.stopped();
    if (last && text_.stopped() && !held_logprobs_.empty())
        result_.stop_logprob.assign(1, held_logprobs_.front().second);
    if (text.empty() && !all) return;
    result_.text += text;
    const bool listens = channel_->listens;
    std::unique_lock<std::mutex> lock(channel_->mutex, std::defer_lock);
    if (listens) {
        lock.lock();
        channel_->text += text;
    }
    while (!held_logprobs_.empty() && (all || held_logprobs_.front().first < result_.text.size())) {
        if (listens) channel_->logprobs.push_back(held_logprobs_.front().second);
        result_.logprobs.push_back(std::move(held_logprobs_.front().second));
        held_logprobs_.pop_front();
    }
    if (!text.empty() && listens) text_waiting_ = true;
}

void Generation::hand_over_text() {
    if (!std::exchange(text_waiting_, false)) return;
    channel_->changed.notify_all();
}

void Generation::publish(std::exception_ptr error) {
    if (!error) emit(text_.flush(), true);
    result_.stats.n_generated = static_cast<int>(result_.tokens.size());
    // About n_prediction / 64 word operations per output token: nothing beside its decode.
    if (prediction_)
        result_.stats.n_prediction_in_output =
            static_cast<int>(prediction_->tokens_in(result_.tokens));
    result_.stats.t_total = seconds_since(admitted_);
    {
        std::lock_guard<std::mutex> lock(channel_->mutex);
        channel_->result = std::move(result_);
        channel_->error = error;
        channel_->done = true;
    }
    channel_->changed.notify_all();
}

}  // namespace specdec
