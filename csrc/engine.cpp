#include "engine.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "errors.h"
#include "logging.h"
#include "model_drafter.h"
#include "ngram_drafter.h"
#include "text_stream.h"

namespace specdec {
namespace {

using Clock = std::chrono::steady_clock;

// Calibration: at least, at most this many sweeps over the batch sizes; more are taken while
// one more still moves an estimate by over kCostsSettled, within the time budget.
constexpr size_t kMinCostSweeps = 3, kMaxCostSweeps = 6;
constexpr double kCostsSettled = 0.05;
constexpr double kCalibrationBudgetSeconds = 5.0;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

using Deadline = std::optional<Clock::time_point>;

Deadline deadline_after(Clock::time_point start, double seconds) {
    if (seconds <= 0) return std::nullopt;
    return start +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void check_supported(const Model& m) {
    if (llama_model_is_recurrent(m.model()) || llama_model_is_hybrid(m.model()))
        throw UnsupportedModelError(
            m.path() +
            " is a recurrent or hybrid model: its state cannot be rolled back past "
            "rejected draft tokens, so it cannot be used for speculative decoding");
}

}  // namespace

// Holds the engine for one call, with that call's stop conditions. A second call from the
// thread already inside one (a callback calling back in) would wait for itself forever, so it
// is refused at once. While it waits, a cancel throws Cancelled and the deadline TimedOut.
class Engine::Hold {
  public:
    explicit Hold(Engine& e, std::shared_ptr<CancelFlag> cancel = nullptr, Deadline deadline = {})
        : e_(e) {
        if (e.running_on_this_thread())
            throw ReentrantCallError(
                "the engine is already running on this thread: a callback cannot call generate, "
                "calibrate or measure_decode_cost on the decoder that is calling it");
        while (!e.busy_.try_lock_for(std::chrono::milliseconds(10))) {
            if (e.closing_.load() || (cancel && cancel->requested.load()))
                throw Cancelled("cancelled while waiting");
            if (deadline && Clock::now() >= *deadline)
                throw TimedOut("timed out waiting for the engine");
        }
        if (e.closing_.load()) {
            e.busy_.unlock();
            throw Cancelled("the engine is shutting down");
        }
        e.owner_.store(std::this_thread::get_id());
        e.request_cancel_ = std::move(cancel);
        e.deadline_ = deadline;
    }
    ~Hold() {
        e_.request_cancel_.reset();
        e_.deadline_.reset();
        e_.owner_.store(std::thread::id());
        e_.busy_.unlock();
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

  private:
    Engine& e_;
};

// The state of one generate() call. The step reads top to bottom like the algorithm.
class Generation {
  public:
    Generation(Engine& engine, const GenerateRequest& request, const TextCallback& on_text,
               Clock::time_point called)
        : e_(engine),
          called_(called),
          req_(request),
          on_text_(on_text),
          rng_(request.seed),
          text_(request.stop),
          n_draft_(request.n_draft >= 0 ? request.n_draft : engine.config_.n_draft) {
        if (!e_.drafter_) n_draft_ = 0;
        adaptive_ = request.adaptive && e_.drafter_ != nullptr;
        if (adaptive_ && request.max_tokens < Engine::kMinTokensToSpeculate) {
            adaptive_ = false;
            n_draft_ = 0;
            stats().fallback_reason = "short request";
        }
    }

    GenerationResult run() {
        stats().t_queue = seconds_since(called_);
        stats().n_prompt = static_cast<int>(req_.prompt.size());
        try {
            // Calibration is a one-time cost of the engine, not of this generation.
            if (adaptive_ && !e_.policy_.calibrated()) e_.calibrate_locked(req_.prompt);
            if (adaptive_) e_.policy_.begin_generation(looks_back(), !req_.sampling.greedy());
        } catch (const Cancelled&) {
            result_.finish_reason = "cancelled";
            return std::move(result_);
        } catch (const TimedOut&) {
            result_.finish_reason = "timeout";
            return std::move(result_);
        }
        const auto start = Clock::now();
        try {
            prefill();
            while (result_.finish_reason.empty()) step();
        } catch (const Cancelled&) {
            result_.finish_reason = "cancelled";
        } catch (const TimedOut&) {
            result_.finish_reason = "timeout";
        }
        emit(text_.flush());
        result_.stats.n_generated = static_cast<int>(result_.tokens.size());
        result_.stats.t_total = seconds_since(start);
        return std::move(result_);
    }

  private:
    Stats& stats() { return result_.stats; }
    Model& target() const { return *e_.target_; }

    void prefill() {
        const auto start = Clock::now();
        seq_ = req_.prompt;
        // The target's cache holds all committed tokens but the last, which each step decodes
        // together with the draft. What it already holds of them (the previous request's
        // prefix: a chat's earlier turns) is kept.
        const size_t cached = target().keep_common_prefix(seq_, seq_.size() - 1);
        stats().n_prompt_cached = static_cast<int>(cached);
        e_.decode_sequence(target(), e_.target_batch_, seq_, cached, seq_.size() - 1, false, 0);
        if (e_.drafter_) e_.drafter_->begin(seq_);
        unseen_from_ = seq_.size();
        stats().t_prompt = seconds_since(start);
    }

    // The most tokens this step may draft: bounded by the context, by one decode's batch (the
    // verify pass holds the draft and the last token) and by what may still be emitted.
    int draft_cap() const {
        if (drafting_dropped_) return 0;
        const int room_in_context = target().n_ctx() - static_cast<int>(seq_.size());
        const int room_in_batch = target().n_batch() - 1;
        const int still_wanted = req_.max_tokens - static_cast<int>(result_.tokens.size()) - 1;
        int cap = std::min({Engine::kMaxDraft, room_in_context, room_in_batch, still_wanted});
        if (e_.draft_) cap = std::min(cap, e_.draft_->n_ctx() - static_cast<int>(seq_.size()) + 1);
        return std::max(cap, 0);
    }

    int draft_length() {
        const int cap = draft_cap();
        if (!adaptive_) return std::min(n_draft_, cap);
        std::string why;
        int k = e_.policy_.choose(cap, &why);
        if (k == AdaptivePolicy::kLookBack) {
            look_back();
            k = e_.policy_.choose(cap, &why);
        }
        if (k == 0 && cap > 0) {
            ++stats().n_fallback_steps;
            if (!why.empty()) stats().fallback_reason = why;
        }
        return k;
    }

    void step() {
        if (static_cast<int>(seq_.size()) > target().n_ctx()) {
            result_.finish_reason = "context";
            return;
        }
        const int k = draft_length();
        const double t_draft = stats().t_draft;
        const double t_verify = stats().t_verify;
        draft(k);
        verify();
        const int n_accepted = accept_and_commit();
        // A look back scores the tokens committed since the draft last drafted.
        if (!draft_.tokens.empty()) unseen_from_ = seq_.size();
        if (adaptive_) {
            StepOutcome outcome{static_cast<int>(draft_.tokens.size()),
                                n_accepted,
                                stats().t_draft - t_draft,
                                stats().t_verify - t_verify,
                                draft_.caught_up,
                                draft_.t_catch_up};
            if (!req_.sampling.greedy()) outcome.accept_chance = &accept_chances_;
            e_.policy_.observe(outcome);
        }
        // Positions at or past the first rejected draft hold keys/values of tokens that were
        // not committed.
        target().forget_from(static_cast<llama_pos>(base_ + n_accepted));
    }

    // Decodes with the target alone for the rest of this request.
    void drop_drafting(const std::string& why) {
        drafting_dropped_ = true;
        stats().draft_error = why;
    }

    // Greedy requests only: a look back at sampled text (unbiased estimates of each token's
    // chance of acceptance) made `auto` draft more where drafting loses (docs/adaptive.md).
    bool looks_back() const { return e_.drafter_->can_look_back() && req_.sampling.greedy(); }

    // Asks the drafter, for each token committed since it last drafted, whether it would have
    // drafted that token there (greedy: the draft's argmax), and tells the policy.
    void look_back() {
        const auto start = Clock::now();
        hindsight_.clear();
        const int n_vocab = e_.draft_->n_vocab();
        e_.drafter_->look_back(seq_, unseen_from_, [&](size_t t, const float* logits) {
            const bool hit = all_finite(logits, n_vocab) && argmax(logits, n_vocab) == seq_[t];
            hindsight_.push_back(hit ? 1.0 : 0.0);
        });
        e_.policy_.observe_hindsight(hindsight_);
        unseen_from_ = seq_.size();
        ++stats().n_look_backs;
        stats().t_draft += seconds_since(start);
    }

    void draft(int k) {
        draft_.tokens.clear();
        draft_.q.clear();
        draft_.caught_up = 0;
        draft_.t_catch_up = 0.0;
        if (k == 0) {
            stats().count_proposal(0);
            return;
        }
        const auto start = Clock::now();
        e_.drafter_->propose(seq_, k, req_.draft_p_min, req_.sampling, rng_, draft_);
        if (draft_.non_finite) drop_drafting("the draft model's logits are not finite (NaN/Inf)");
        stats().count_proposal(static_cast<int>(draft_.tokens.size()));
        stats().drafted_by[static_cast<int>(draft_.source)] +=
            static_cast<int>(draft_.tokens.size());
        stats().t_draft += seconds_since(start);
    }

    // One target decode of [last, d1..dK], logits on every row.
    void verify() {
        const auto start = Clock::now();
        base_ = seq_.size();  // position of the first draft token
        Batch& batch = e_.target_batch_;
        batch.clear();
        batch.add(seq_.back(), static_cast<llama_pos>(base_ - 1), true);
        for (size_t i = 0; i < draft_.tokens.size(); ++i)
            batch.add(draft_.tokens[i], static_cast<llama_pos>(base_ + i), true);
        e_.decode(target(), batch);
        ++stats().n_target_passes;
        stats().t_verify += seconds_since(start);
    }

    // Row i of the last target decode scores the token after [.., last, d1..di]. Non-finite
    // logits have no right answer to give, so they end the request with an error.
    const float* target_logits(size_t row) {
        const float* logits = llama_get_logits_ith(target().ctx(), static_cast<int32_t>(row));
        if (!all_finite(logits, target().n_vocab()))
            throw NonFiniteLogitsError(
                "the target model " + target().path() +
                " produced non-finite logits (NaN or Inf) for the token at position " +
                std::to_string(base_ + row) + ": the model file or the backend is broken");
        return logits;
    }

    const Distribution& target_distribution(size_t row) {
        make_distribution(target_logits(row), target().n_vocab(), req_.sampling, workspace_, p_);
        return p_;
    }

    // Walks the draft: accepted prefix, then one token from the target (the correction at the
    // first rejection, or a bonus when all pass). Returns the number of draft tokens accepted.
    int accept_and_commit() {
        const auto start = Clock::now();
        const size_t k = draft_.tokens.size();
        step_tokens_.clear();
        step_margins_.clear();
        accept_chances_.clear();
        size_t i = 0;
        for (; i < k; ++i) {
            const llama_token x = draft_.tokens[i];
            const llama_token verdict =
                req_.sampling.greedy() ? greedy_verdict(i) : sampled_verdict(i, x);
            step_tokens_.push_back(verdict);
            if (verdict != x) break;
        }
        if (i == k) step_tokens_.push_back(target_token(k));
        stats().count_acceptance(static_cast<int>(i));
        stats().accepted_by[static_cast<int>(draft_.source)] += static_cast<int>(i);
        stats().t_verify += seconds_since(start);

        int committed = 0;
        for (size_t j = 0; j < step_tokens_.size(); ++j)
            committed += commit(step_tokens_[j], step_margins_.empty() ? 0.0f : step_margins_[j]);
        stats().n_cut += static_cast<int>(step_tokens_.size()) - committed;
        return static_cast<int>(i);
    }

    // Greedy: the target's argmax at row i (the draft token when they agree).
    llama_token greedy_verdict(size_t row) {
        const Top2 t = top2(target_logits(row), target().n_vocab());
        step_margins_.push_back(t.margin);
        return t.best;
    }

    // Sampling: x when accepted (prob min(1, p/q)), else a draw from the residual.
    llama_token sampled_verdict(size_t row, llama_token x) {
        const Distribution& p = target_distribution(row);
        const Distribution* q = draft_.q[row];
        // Only the adaptive policy reads it, and it is a pass over q's support per position.
        if (adaptive_) accept_chances_.push_back(q ? acceptance_chance(p, *q) : double(p[x]));
        const bool ok = q ? accept_draft(p, *q, x, rng_) : accept_point_draft(p, x, rng_);
        if (ok) return x;
        if (req_.wrong_residual_for_tests) return sample(p, rng_);
        return q ? sample_residual(p, *q, rng_) : sample_residual_point(p, x, rng_);
    }

    // The token after an all-accepted draft (the bonus), or the only token of a K=0 step.
    llama_token target_token(size_t row) {
        if (req_.sampling.greedy()) return greedy_verdict(row);
        return sample(target_distribution(row), rng_);
    }

    // Appends one token to the output unless generation already finished; returns 1 if it did.
    int commit(llama_token token, float margin) {
        if (!result_.finish_reason.empty()) return 0;
        if (target().is_eog(token)) {
            result_.finish_reason = "stop";
            return 0;
        }
        if (result_.tokens.empty()) stats().t_first_token = seconds_since(called_);
        seq_.push_back(token);
        result_.tokens.push_back(token);
        if (req_.sampling.greedy()) result_.margins.push_back(margin);
        emit(text_.push(target().token_piece(token)));
        if (text_.stopped()) {
            result_.finish_reason = "stop";
        } else if (static_cast<int>(result_.tokens.size()) >= req_.max_tokens) {
            result_.finish_reason = "length";
        }
        return 1;
    }

    void emit(const std::string& text) {
        if (text.empty()) return;
        result_.text += text;
        if (on_text_) on_text_(text);
    }

    Engine& e_;
    const Clock::time_point called_;
    const GenerateRequest& req_;
    const TextCallback& on_text_;
    Rng rng_;
    TextStream text_;
    int n_draft_;
    bool adaptive_ = false;
    bool drafting_dropped_ = false;
    std::vector<llama_token> seq_;  // prompt + committed tokens
    size_t base_ = 0;
    Draft draft_;
    std::vector<llama_token> step_tokens_;  // this step's verdicts: accepted drafts + one more
    std::vector<float> step_margins_;
    std::vector<double> accept_chances_;  // sampling: each verdict's chance of acceptance
    size_t unseen_from_ = 0;              // seq_[unseen_from_..]: committed without a draft
    std::vector<double> hindsight_;
    Distribution p_;
    SamplingWorkspace workspace_;
    GenerationResult result_;
};

Engine::Engine(const EngineConfig& config)
    : config_(config), target_batch_(std::max(config.target.n_batch, kMaxDraft + 1)) {
    install_log_handler(config.verbose);
    if (config.n_draft < 0 || config.n_draft > kMaxDraft)
        throw std::invalid_argument("n_draft must be in [0, " + std::to_string(kMaxDraft) + "]");
    target_ = std::make_unique<Model>(config.target);
    check_supported(*target_);
    llama_set_abort_callback(target_->ctx(), abort_requested, this);
    if (config.draft) {
        draft_ = std::make_unique<Model>(*config.draft);
        check_supported(*draft_);
        const std::string why = vocab_mismatch(*target_, *draft_);
        if (!why.empty())
            throw VocabMismatchError("target " + target_->path() + " and draft " + draft_->path() +
                                     " cannot be paired: " + why);
        llama_set_abort_callback(draft_->ctx(), abort_requested, this);
        drafter_ = std::make_unique<ModelDrafter>(
            *draft_, kMaxDraft, [this](Model& m, const Batch& b) { decode(m, b); });
    }
    if (config.ngram) {
        auto ngram = std::make_unique<NgramDrafter>(config.ngram_min, config.ngram_max);
        drafter_ = drafter_
                       ? std::make_unique<FallbackDrafter>(std::move(ngram), std::move(drafter_))
                       : std::unique_ptr<Drafter>(std::move(ngram));
    }
}

Engine::~Engine() = default;

void Engine::decode_sequence(Model& model, Batch& batch, const std::vector<llama_token>& tokens,
                             size_t from, size_t end, bool logits_on_last, size_t chunk) {
    // llama.cpp aborts the process on a decode larger than its n_batch.
    const auto n_batch = static_cast<size_t>(model.n_batch());
    chunk = chunk == 0 ? n_batch : std::min(chunk, n_batch);
    decode_in_chunks(batch, tokens, from, end, static_cast<llama_pos>(from),
                     logits_on_last ? end - 1 : end, chunk,
                     [&](const Batch& b) { decode(model, b); });
}

void Engine::decode(Model& model, const Batch& batch) {
    if (stop_requested()) throw Cancelled("generation cancelled");
    if (deadline_ && Clock::now() >= *deadline_) throw TimedOut("the request's deadline passed");
    const int32_t rc = llama_decode(model.ctx(), batch.get());
    if (rc == 0) {
        model.note_decoded(batch.get());
        return;
    }
    model.clear_memory();  // a failed decode may leave part of the batch in the cache
    if (rc == 2) throw Cancelled("generation cancelled");
    if (rc == 1)
        throw ContextOverflowError("no room in the KV cache of " + model.path() +
                                   " for a batch of " + std::to_string(batch.size()) + " tokens");
    if (rc != 0) throw std::runtime_error("llama_decode failed with code " + std::to_string(rc));
}

void Engine::shutdown() {
    if (running_on_this_thread())
        throw ReentrantCallError("a callback cannot close the decoder that is calling it");
    closing_.store(true);
    std::lock_guard<std::timed_mutex> wait_for_the_running_call(busy_);
}

void Engine::check_tokens(const std::vector<llama_token>& tokens) const {
    for (llama_token t : tokens)
        if (t < 0 || t >= target_->n_vocab())
            throw std::invalid_argument("token " + std::to_string(t) +
                                        " is outside the vocabulary (0.." +
                                        std::to_string(target_->n_vocab() - 1) + ")");
}

std::vector<double> Engine::measure_decode_cost(const std::vector<llama_token>& context, int max_n,
                                                int repeats, bool on_draft,
                                                std::shared_ptr<CancelFlag> cancel) {
    Model* model = on_draft ? draft_.get() : target_.get();
    if (!model) throw std::invalid_argument("there is no draft model");
    if (context.empty() || max_n < 1 || repeats < 1)
        throw std::invalid_argument("need a context, max_n >= 1 and repeats >= 1");
    if (max_n > kMaxDraft + 1 || static_cast<int>(context.size()) + max_n > model->n_ctx())
        throw ContextOverflowError("context + max_n does not fit the context window");
    if (static_cast<int>(context.size()) > model->n_batch() || max_n > model->n_batch())
        throw std::invalid_argument("the context and max_n must each fit n_batch (" +
                                    std::to_string(model->n_batch()) + ")");
    check_tokens(context);
    Hold hold(*this, std::move(cancel));
    return measure_decode_cost_locked(context, max_n, repeats, *model);
}

std::vector<double> Engine::measure_decode_cost_locked(const std::vector<llama_token>& context,
                                                       int max_n, int repeats, Model& model) {
    model.clear_memory();
    Batch batch(std::max(static_cast<int>(context.size()), max_n));
    decode_sequence(model, batch, context, 0, context.size(), false, 0);
    // Whole sweeps over n, repeated: a slow spell on a shared machine then lands on every n
    // alike instead of inflating one n's cost (which the policy would never re-measure).
    std::vector<std::vector<double>> samples(static_cast<size_t>(max_n));
    for (int r = 0; r < repeats; ++r)
        for (int n = 1; n <= max_n; ++n)
            samples[static_cast<size_t>(n - 1)].push_back(
                time_decode_locked(model, batch, context, n));
    std::vector<double> costs;
    for (auto& s : samples) costs.push_back(median(std::move(s)));
    return costs;
}

double Engine::time_decode_locked(Model& model, Batch& batch,
                                  const std::vector<llama_token>& context, int n) {
    const auto pos = static_cast<llama_pos>(context.size());
    batch.clear();
    for (int i = 0; i < n; ++i)
        batch.add(context[static_cast<size_t>(i) % context.size()], pos + i, true);
    const auto start = Clock::now();
    decode(model, batch);
    const double seconds = seconds_since(start);
    model.forget_from(pos);
    return seconds;
}

CostSweep Engine::cost_sweep_locked(const std::vector<llama_token>& context, int max_n,
                                    Batch& batch) {
    CostSweep sweep;
    for (int n = 1; n <= max_n; ++n) {
        sweep.verify.push_back(time_decode_locked(*target_, batch, context, n));
        // A step's draft decodes one or two tokens at a time.
        if (draft_ && n <= 2) sweep.draft.push_back(time_decode_locked(*draft_, batch, context, n));
    }
    return sweep;
}

void Engine::calibrate(const std::vector<llama_token>& context,
                       std::shared_ptr<CancelFlag> cancel) {
    if (!drafter_) throw std::invalid_argument("calibration needs a drafter (model or n-gram)");
    if (context.empty()) throw std::invalid_argument("the context has no tokens");
    check_tokens(context);
    Hold hold(*this, std::move(cancel));
    calibrate_locked(context);
}

void Engine::set_calibration(std::vector<double> verify_costs, std::vector<double> draft_costs) {
    if (!drafter_) throw std::invalid_argument("calibration needs a drafter (model or n-gram)");
    Hold hold(*this);
    policy_.calibrate(std::move(verify_costs), std::move(draft_costs), 0.0);
}

void Engine::calibrate_locked(const std::vector<llama_token>& context) {
    // A short context is enough: the cost of a small batch barely depends on its position.
    constexpr size_t kContext = 32;
    std::vector<llama_token> ctx(
        context.begin(), context.begin() + static_cast<long>(std::min(context.size(), kContext)));
    const int n_ctx = draft_ ? std::min(target_->n_ctx(), draft_->n_ctx()) : target_->n_ctx();
    const int n_batch =
        draft_ ? std::min(target_->n_batch(), draft_->n_batch()) : target_->n_batch();
    const int max_n = std::min(
        {AdaptivePolicy::Config{}.max_k + 1, n_ctx - static_cast<int>(ctx.size()), n_batch});
    if (max_n < 2) return;  // no room to speculate; the policy stays uncalibrated
    const auto start = Clock::now();
    Batch batch(std::max(static_cast<int>(ctx.size()), max_n));
    for (Model* model : {target_.get(), draft_.get()}) {
        if (!model) continue;  // an n-gram draft costs a few hash lookups: nothing next to a decode
        model->clear_memory();
        decode_sequence(*model, batch, ctx, 0, ctx.size(), false, 0);
        time_decode_locked(*model, batch, ctx, 1);  // warm-up: first decodes pay for setup
    }
    // Whole sweeps, both models in each, until one more finds no decode faster (a busy machine
    // takes more), within a time budget: the estimates rest on each decode's fastest timing,
    // and a sweep gives every n and both models a chance at the machine's quiet moments.
    std::vector<CostSweep> sweeps;
    while (sweeps.size() < kMinCostSweeps ||
           (sweeps.size() < kMaxCostSweeps && !costs_settled(sweeps, kCostsSettled) &&
            seconds_since(start) < kCalibrationBudgetSeconds))
        sweeps.push_back(cost_sweep_locked(ctx, max_n, batch));
    CostCurve curve = estimate_costs(sweeps);
    policy_.calibrate(std::move(curve.verify), std::move(curve.draft), seconds_since(start));
}

GenerationResult Engine::generate(const GenerateRequest& request, const TextCallback& on_text) {
    validate(request.sampling);
    if (request.prompt.empty()) throw std::invalid_argument("the prompt has no tokens");
    if (request.max_tokens < 1) throw std::invalid_argument("max_tokens must be >= 1");
    if (request.n_draft > kMaxDraft)
        throw std::invalid_argument("n_draft must be in [0, " + std::to_string(kMaxDraft) + "]");
    for (const auto& s : request.stop)
        if (s.empty()) throw std::invalid_argument("stop strings must not be empty");
    check_tokens(request.prompt);
    const int n_ctx = std::min(target_->n_ctx(), draft_ ? draft_->n_ctx() : target_->n_ctx());
    if (static_cast<int>(request.prompt.size()) >= n_ctx)
        throw ContextOverflowError("the prompt has " + std::to_string(request.prompt.size()) +
                                   " tokens but the context holds " + std::to_string(n_ctx) +
                                   "; raise n_ctx or shorten the prompt");

    const auto called = Clock::now();
    std::optional<Hold> hold;
    try {
        hold.emplace(*this, request.cancel, deadline_after(called, request.timeout));
    } catch (const std::runtime_error& e) {
        const bool timed_out = dynamic_cast<const TimedOut*>(&e) != nullptr;
        if (!timed_out && !dynamic_cast<const Cancelled*>(&e)) throw;
        GenerationResult result;
        result.finish_reason = timed_out ? "timeout" : "cancelled";
        result.stats.n_prompt = static_cast<int>(request.prompt.size());
        result.stats.t_queue = seconds_since(called);
        return result;
    }
    return Generation(*this, request, on_text, called).run();
}

std::vector<float> Engine::next_token_logits(const std::vector<llama_token>& context, bool batched,
                                             std::shared_ptr<CancelFlag> cancel) {
    if (context.empty()) throw std::invalid_argument("the context has no tokens");
    if (static_cast<int>(context.size()) > target_->n_ctx())
        throw ContextOverflowError("the context is longer than n_ctx");
    check_tokens(context);
    Hold hold(*this, std::move(cancel));
    target_->clear_memory();
    decode_sequence(*target_, target_batch_, context, 0, context.size(), true, batched ? 0 : 1);
    const float* logits = llama_get_logits_ith(target_->ctx(), -1);
    return std::vector<float>(logits, logits + target_->n_vocab());
}

}  // namespace specdec
