// Decodes, and the measurements and calibration that time them.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "engine.h"
#include "errors.h"

namespace specdec {
#ifdef SPECDEC_TEST_HOOKS
std::atomic<bool> gpu_timing_for_tests{false};
std::atomic<long> decodes_for_tests{0};
#endif
namespace {

// Calibration: at least, at most this many sweeps over the batch sizes; more are taken while
// one more still moves an estimate by over kCostsSettled, within the time budget.
constexpr size_t kMinCostSweeps = 3, kMaxCostSweeps = 6;
constexpr double kCostsSettled = 0.05;
constexpr double kCalibrationBudgetSeconds = 5.0;
// Untimed decodes of a shape before it is timed, on a GPU (see time_decode_locked).
constexpr int kGraphWarmupDecodes = 2;

}  // namespace

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
    if (job_deadline_ && Clock::now() >= *job_deadline_)
        throw TimedOut("the request's deadline passed");
    // llama.cpp aborts the process on a decode larger than its n_batch: an engine error instead.
    if (batch.size() > model.n_batch())
        throw std::logic_error("a decode of " + std::to_string(batch.size()) +
                               " rows exceeds n_batch " + std::to_string(model.n_batch()));
#ifdef SPECDEC_TEST_HOOKS
    ++decodes_for_tests;
#endif
    const int32_t rc = llama_decode(model.ctx(), batch.get());
    if (rc == 0) {
        // On a GPU llama_decode returns once the work is queued; every timing of a decode (the
        // calibration's, a step's, the batch costs learned) must include the work itself.
        llama_synchronize(model.ctx());
        model.note_decoded(batch.get());
        return;
    }
    model.clear_memory();  // a failed decode may leave part of the batch in the cache
    if (rc == 2) throw Cancelled("generation cancelled");
    if (rc == 1)
        throw ContextOverflowError("no room in the KV cache of " + model.path() +
                                   " for a batch of " + std::to_string(batch.size()) + " tokens");
    throw std::runtime_error("llama_decode failed with code " + std::to_string(rc));
}

std::vector<double> Engine::measure_decode_cost(const std::vector<llama_token>& context, int max_n,
                                                int repeats, bool on_draft,
                                                std::shared_ptr<CancelFlag> cancel) {
    check_not_in_callback("call generate, calibrate or measure_decode_cost");
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
    std::vector<double> costs;
    run_exclusive([&] { costs = measure_decode_cost_locked(context, max_n, repeats, *model); },
                  std::move(cancel));
    return costs;
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

bool Engine::times_as_on_a_gpu(const Model& model) {
#ifdef SPECDEC_TEST_HOOKS
    if (gpu_timing_for_tests.load()) return true;
#endif
    return model.offloaded();
}

double Engine::time_decode_locked(Model& model, Batch& batch,
                                  const std::vector<llama_token>& context, int n, bool warm) {
    const auto pos = static_cast<llama_pos>(context.size());
    batch.clear();
    for (int i = 0; i < n; ++i)
        batch.add(context[static_cast<size_t>(i) % context.size()], pos + i, true);
    // llama.cpp's CUDA backend replays a decode as a captured graph only from the third decode
    // of the same shape in a row, and a small batch runs much faster so; a step repeats its
    // shapes, so on a GPU each is timed as the steps will see it, after two decodes of it.
    const int untimed = times_as_on_a_gpu(model) && !warm ? kGraphWarmupDecodes : 0;
    double seconds = 0.0;
    for (int i = 0; i <= untimed; ++i) {
        const auto start = Clock::now();
        decode(model, batch);
        seconds = seconds_since(start);
        model.forget_from(0, pos);
    }
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
    check_not_in_callback("call generate, calibrate or measure_decode_cost");
    if (context.empty()) throw std::invalid_argument("the context has no tokens");
    check_tokens(context);
    run_exclusive([&] { calibrate_locked(context); }, std::move(cancel));
}

void Engine::set_calibration(std::vector<double> verify_costs, std::vector<double> draft_costs,
                             std::vector<std::pair<int, double>> batch_verify,
                             std::vector<std::pair<int, double>> batch_draft) {
    // All checked before anything changes: costs that do not fit are measured instead.
    BatchCosts batch;
    if (config_.n_parallel > 1) {
        if (batch_verify.empty())
            throw std::invalid_argument("an engine of several slots needs its batch costs too");
        batch = BatchCosts(std::move(batch_verify), std::move(batch_draft));
    } else if (!batch_verify.empty() || !batch_draft.empty()) {
        throw std::invalid_argument("batch costs apply to an engine of several slots");
    }
    AdaptivePolicy checked;
    checked.calibrate(verify_costs, draft_costs, 0.0);
    std::lock_guard<std::mutex> lock(policy_mutex_);
    policy_.calibrate(std::move(verify_costs), std::move(draft_costs), 0.0);
    if (config_.n_parallel > 1) {
        stored_batch_costs_ = std::move(batch);
        stored_batch_costs_pending_.store(true);
    }
}

void Engine::adopt_stored_batch_costs() {
    if (!stored_batch_costs_pending_.exchange(false)) return;
    std::lock_guard<std::mutex> lock(policy_mutex_);
    if (stored_batch_costs_) batch_costs_ = std::move(*stored_batch_costs_);
    stored_batch_costs_.reset();
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
    Batch batch(std::max(
        {static_cast<int>(ctx.size()), max_n, std::min(config_.n_parallel * max_n, n_batch)}));
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
    BatchCosts batch_costs;
    if (config_.n_parallel > 1) batch_costs = measure_batch_costs(ctx, curve, batch);
    AdaptivePolicy policy = this->policy();
    policy.calibrate(std::move(curve.verify), std::move(curve.draft), seconds_since(start));
    std::lock_guard<std::mutex> lock(policy_mutex_);
    policy_ = std::move(policy);
    batch_costs_ = std::move(batch_costs);
    stored_batch_costs_.reset();  // measured now: a stored set waiting to be taken up is older
    stored_batch_costs_pending_.store(false);
}

BatchCosts Engine::measure_batch_costs(const std::vector<llama_token>& context,
                                       const CostCurve& curve, Batch& batch) {
    // Past one sequence's largest step, at doubling sizes up to every slot drafting max_k (and
    // the draft up to two rows per slot), the fastest of a few decodes each.
    constexpr int kRepeats = 3;
    const int room = target_->n_ctx() - static_cast<int>(context.size());
    const auto fastest = [&](Model& model, int n) {
        double best = 0.0;
        for (int r = 0; r < kRepeats; ++r) {
            const double t = time_decode_locked(model, batch, context, n, r > 0);
            best = r == 0 ? t : std::min(best, t);
        }
        return best;
    };
    std::vector<std::pair<int, double>> verify, draft;
    for (size_t n = 1; n <= curve.verify.size(); ++n)
        verify.emplace_back(static_cast<int>(n), curve.verify[n - 1]);
    const int n_seq = config_.n_parallel;
    const int most_rows = std::min({n_seq * static_cast<int>(curve.verify.size()),
                                    target_->n_batch(), batch.capacity(), room});
    // A full batch of n sequences drafting K each decodes n(K + 1) rows, and kernels differ by
    // size (on this CPU multiples of 4 rows run much faster than the sizes between), so those
    // sizes are measured, for K up to kPlannedK, rather than interpolated; past them, doubling.
    constexpr int kPlannedK = 7;
    const int last_full = std::min(most_rows, n_seq * (kPlannedK + 1));
    for (int n = (verify.back().first / n_seq + 1) * n_seq; n <= last_full; n += n_seq)
        verify.emplace_back(n, fastest(*target_, n));
    for (int n = 2 * verify.back().first; verify.back().first < most_rows; n *= 2)
        verify.emplace_back(std::min(n, most_rows), fastest(*target_, std::min(n, most_rows)));
    if (draft_) {
        for (size_t n = 1; n <= curve.draft.size(); ++n)
            draft.emplace_back(static_cast<int>(n), curve.draft[n - 1]);
        const int most_draft_rows =
            std::min({2 * config_.n_parallel, draft_->n_batch(), batch.capacity(),
                      draft_->n_ctx() - static_cast<int>(context.size())});
        for (int n = 2 * draft.back().first; draft.back().first < most_draft_rows; n *= 2)
            draft.emplace_back(std::min(n, most_draft_rows),
                               fastest(*draft_, std::min(n, most_draft_rows)));
    }
    return BatchCosts(std::move(verify), std::move(draft));
}

std::vector<float> Engine::next_token_logits(const std::vector<llama_token>& context, bool batched,
                                             std::shared_ptr<CancelFlag> cancel) {
    check_not_in_callback("call generate, calibrate or measure_decode_cost");
    if (context.empty()) throw std::invalid_argument("the context has no tokens");
    if (static_cast<int>(context.size()) > target_->n_ctx())
        throw ContextOverflowError("the context is longer than n_ctx");
    check_tokens(context);
    std::vector<float> out;
    run_exclusive(
        [&] {
            target_->clear_memory();
            decode_sequence(*target_, target_batch_, context, 0, context.size(), true,
                            batched ? 0 : 1);
            const float* logits = llama_get_logits_ith(target_->ctx(), -1);
            out.assign(logits, logits + target_->n_vocab());
        },
        std::move(cancel));
    return out;
}

}  // namespace specdec
