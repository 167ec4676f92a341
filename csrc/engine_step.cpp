// The batched step: what each slot drafts, one target decode for all of them, what each keeps.
#include <algorithm>
#include <chrono>
#include <cmath>

#include "engine.h"
#include "errors.h"

namespace specdec {

void Engine::govern_threads() {
    const int threads = governor_->threads();
    if (threads == threads_now_.load()) return;
    target_->set_threads(threads);
    if (draft_) draft_->set_threads(threads);
    threads_now_.store(threads);
}

void Engine::step() {
    const auto start = Clock::now();
    govern_threads();
    decoding_.clear();
    prefilling_.clear();
    for (size_t s = 0; s < slots_.size(); ++s) {
        Generation* g = slots_[s].get();
        if (!g) continue;
        g->check_stop();
        if (g->finished()) {
            retire(static_cast<int>(s));
            continue;
        }
        (g->prefilling() ? prefilling_ : decoding_).push_back(g);
    }
    if (decoding_.empty() && prefilling_.empty()) return;
    const int n_batch = target_->n_batch();
    // What a prompt may add to this step: a whole batch while nothing else generates.
    int prefill_budget = decoding_.empty() ? n_batch : std::min(prefill_chunk_, n_batch / 2);

    // How many tokens each sequence drafts: together their rows fill at most one decode.
    const int row_cap = std::max(1, (n_batch - (prefilling_.empty() ? 0 : prefill_budget)) /
                                        std::max<int>(1, static_cast<int>(decoding_.size())));
    if (held_to_target_only()) {
        for (Generation* g : decoding_) g->hold_target_only(row_cap);
    } else {
        choose_ks(row_cap);
        if (decoding_.size() > 1) plan_ks(decoding_, prompt_rows(prefill_budget));
    }
    draft_all();

    // One target decode: every sequence's [last, d1..dK], and a chunk of a waiting prompt.
    target_batch_.clear();
    for (Generation* g : decoding_) g->add_verify_rows(target_batch_);
    add_prompt_chunks(prefill_budget, n_batch - target_batch_.size());
    if (target_batch_.size() == 0) return;
    const auto verify_start = Clock::now();
    decode(*target_, target_batch_);
    const double t_verify = seconds_since(verify_start);
    learn_batch_cost(target_batch_.size(), t_verify);
    for (Generation* g : prefilled_) {
        try {
            g->prefill_decoded(t_verify);
        } catch (...) {  // its scored prompt's logits were not finite
            failed_.emplace_back(g->seq(), std::current_exception());
            starting_.erase(std::remove(starting_.begin(), starting_.end(), g), starting_.end());
        }
    }
    // After the decode: their rows in it had to be decoded in place.
    for (const auto& [seq, error] : failed_) retire(seq, error);
    if (!decoding_.empty()) size_prefill_chunk(t_verify, !prefilled_.empty());
    const bool shared = decoding_.size() + prefilled_.size() > 1;
    // A draft's first catch-up reads its prompt: a prompt's cost, as a prompt chunk's is.
    const bool measured =
        step_measured_ && prefilled_.empty() && failed_.empty() && !step_read_prompt_;
    const int n = static_cast<int>(decoding_.size());
    const int tokens = accept_all(decoding_, t_verify, shared);
    if (measured) {
        std::lock_guard<std::mutex> lock(policy_mutex_);
        rate_check_.observe(n, tokens, seconds_since(start), step_drafted_);
    }
    // Their decode is the prompt's (its time in stats.t_prompt), no step shared with others.
    accept_all(starting_, 0.0, /*shared=*/false, /*with_prompt=*/true);
}

bool Engine::held_to_target_only() {
    // A step that also reads a prompt (a request arriving) is a step under load whose time is
    // mostly the prompt's: the rate check does not measure it, so it is no place to try
    // drafting either. It drafts only where drafting has already won for as many sequences.
    const bool reads_prompt = !prefilling_.empty();
    const bool loaded = decoding_.size() > 1 || reads_prompt;
    // A fixed K is the caller's choice, and a step with one is no measure of `auto`'s.
    bool checked = loaded ? rate_check_under_load_.load() : rate_check_on_.load();
    for (const Generation* g : decoding_) checked = checked && g->adaptive();
    step_measured_ = checked && !reads_prompt;
    if (!checked || decoding_.empty()) return false;
    const int n = static_cast<int>(decoding_.size());
    double modelled = 0.0;
    if (n == 1) {
        modelled = decoding_[0]->modelled_target_only_rate();
    } else if (!batch_costs_.empty()) {  // written only on this thread: read without the lock
        const double seconds = batch_costs_.verify(n);
        modelled = seconds > 0.0 ? n / seconds : 0.0;
    }
    std::lock_guard<std::mutex> lock(policy_mutex_);
    if (reads_prompt) return !rate_check_.drafting_won(n, modelled);
    return rate_check_.hold_plain(n, modelled);
}

template <typename F>
void Engine::or_retire(Generation*& g, F&& f) {
    try {
        f(*g);
    } catch (...) {
        retire(g->seq(), std::current_exception());
        g = nullptr;
    }
}

void Engine::choose_ks(int row_cap) {
    // A failure while choosing (an n-gram index out of memory, say) is that request's alone.
    for (Generation*& g : decoding_) or_retire(g, [&](Generation& gen) { gen.choose_k(row_cap); });
    decoding_.erase(std::remove(decoding_.begin(), decoding_.end(), nullptr), decoding_.end());
}

void Engine::draft_all() {
    // Forced tokens and copies first, then the draft model, for every sequence in one go.
    draft_jobs_.clear();
    by_model_.assign(decoding_.size(), false);
    for (size_t i = 0; i < decoding_.size(); ++i) {
        or_retire(decoding_[i], [&](Generation& g) {
            // Forced tokens first; the draft model may go on after them, an n-gram copy does not.
            const bool forced = g.draft_forced();
            if (!forced && g.draft_by_copy()) return;
            if (drafter_ && g.model_k() > 0) {
                draft_jobs_.push_back(g.model_job());
                by_model_[i] = true;
            }
        });
    }
    const auto start = Clock::now();
    if (!draft_jobs_.empty()) drafter_->propose(draft_jobs_);
    const double seconds = seconds_since(start);
    step_drafted_ = false;
    step_read_prompt_ = false;
    for (size_t i = 0; i < decoding_.size(); ++i) {
        if (!decoding_[i]) continue;
        or_retire(decoding_[i], [&](Generation& g) {
            g.drafted(by_model_[i] ? seconds : 0);
            step_drafted_ = step_drafted_ || g.has_draft();
            step_read_prompt_ = step_read_prompt_ || g.draft_read_prompt();
        });
    }
    decoding_.erase(std::remove(decoding_.begin(), decoding_.end(), nullptr), decoding_.end());
}

namespace {
// A waiting prompt's part in this step, at most `room` rows: a short one whole (its stall on
// the running streams is one step's either way, and chunks would only put off its first
// token), a longer one as much as the step's chunk `budget` has left (lowered here); a scored
// one no more than the decode's `scored_room` has left (lowered here).
struct PromptShare {
    int rows = 0;
    // The chunk ends a greedy prompt and brings its first token's row: the time to the first
    // token is one decode, not that and a speculative step. A sampled prompt's first token
    // comes from a step, as when the prompt is cached: decoded in another batch shape its
    // logits would differ by float noise, and a seed would not repeat a call.
    bool first_row = false;
};
PromptShare prompt_share(const Generation& g, int& budget, int room, int& scored_room) {
    if (g.scores_prompt()) room = std::min(room, scored_room);
    const int left = g.prompt_left();
    const bool chunked = left > Engine::kPrefillChunk;
    const int rows = std::min({left, chunked ? budget : left, room});
    if (chunked) budget -= rows;
    if (g.scores_prompt()) scored_room -= rows;
    return {rows, rows == left && rows < room && g.greedy()};
}
}  // namespace

void Engine::add_prompt_chunks(int budget, int room) {
    prefilled_.clear();
    starting_.clear();
    failed_.clear();
    int scored_room = Generation::kScoredPromptRows;
    for (Generation* g : prefilling_) {
        const PromptShare share = prompt_share(*g, budget, room, scored_room);
        if (share.rows <= 0) continue;
        try {
            room -= g->add_prefill(target_batch_, share.rows);
            prefilled_.push_back(g);
        } catch (const Cancelled&) {  // the engine is closing: every request ends "cancelled"
            throw;
        } catch (...) {  // its draft's decode failed
            failed_.emplace_back(g->seq(), std::current_exception());
            continue;
        }
        if (share.first_row) {
            g->add_first_row(target_batch_);
            --room;
            starting_.push_back(g);
        }
    }
}

int Engine::accept_all(const std::vector<Generation*>& gens, double t_verify, bool shared,
                       bool with_prompt) {
    int tokens = 0;
    for (Generation* g : gens) {
        try {
            g->accept(t_verify, shared, with_prompt);
        } catch (...) {
            retire(g->seq(), std::current_exception());
            continue;
        }
        tokens += g->step_tokens();
        if (g->finished()) retire(g->seq());
    }
    return tokens;
}

void Engine::size_prefill_chunk(double t_decode, bool with_prefill) {
    // A prompt read alongside running streams may make their step at most kPrefillSlowdown
    // times as long as a step without it: a chunk that costs more is cut down in proportion,
    // one that costs much less doubles. On a CPU a decode's cost grows with its rows, so small
    // chunks read a prompt about as fast as large ones; on a GPU it barely does, and chunks grow.
    constexpr double kPrefillSlowdown = 2.0;
    if (!with_prefill) {
        plain_step_ = t_decode;
        return;
    }
    if (plain_step_ <= 0.0) return;
    const double slowdown = t_decode / plain_step_;
    if (slowdown > kPrefillSlowdown)
        prefill_chunk_ = std::max(kMinPrefillChunk,
                                  static_cast<int>(prefill_chunk_ * kPrefillSlowdown / slowdown));
    else if (slowdown < 0.75 * kPrefillSlowdown)
        prefill_chunk_ = std::min(target_->n_batch(), 2 * prefill_chunk_);
}

int Engine::prompt_rows(int budget) const {
    int rows = 0;
    int scored_room = Generation::kScoredPromptRows;
    for (const Generation* g : prefilling_) {
        const PromptShare share = prompt_share(*g, budget, target_->n_batch(), scored_room);
        rows += share.rows + (share.first_row ? 1 : 0);
    }
    return rows;
}

void Engine::learn_batch_cost(int rows, double seconds) {
    if (batch_costs_.empty()) return;
    std::lock_guard<std::mutex> lock(policy_mutex_);
    batch_costs_.observe_verify(rows, seconds);
}

void Engine::plan_ks(const std::vector<Generation*>& decoding, int prefill_rows) {
    // batch_costs_ is written only on this thread: read without a copy.
    if (batch_costs_.empty()) return;
    plan_gens_.clear();
    plan_caps_.clear();
    int other_rows = prefill_rows;
    for (Generation* g : decoding) {
        if (!g->adaptive()) {
            other_rows += g->k() + 1;
            continue;
        }
        plan_gens_.push_back(g);
        plan_caps_.push_back(g->plan_cap());
    }
    if (plan_gens_.empty()) return;
    plan_expected_.resize(plan_gens_.size());
    for (size_t i = 0; i < plan_gens_.size(); ++i)
        plan_gens_[i]->expected_tokens(plan_caps_[i], plan_expected_[i]);
    plan_batch(plan_expected_, plan_caps_, other_rows, batch_costs_, plan_k_, plan_trial_);
    // A request learns its acceptance only from the drafts it makes: cut to K = 0 step after
    // step, its estimates would never move, however well its draft would do now. So every
    // kBatchProbeInterval-th step the plan cuts keeps each request's own K instead.
    bool cut = false;
    for (size_t i = 0; i < plan_gens_.size(); ++i) cut = cut || plan_k_[i] < plan_gens_[i]->k();
    if (cut && ++steps_since_batch_probe_ >= kBatchProbeInterval) {
        steps_since_batch_probe_ = 0;
        return;
    }
    for (size_t i = 0; i < plan_gens_.size(); ++i) plan_gens_[i]->set_k(plan_k_[i]);
}

}  // namespace specdec
