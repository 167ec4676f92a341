#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "errors.h"
#include "logging.h"

namespace specdec {
namespace {

// Calibration: at least, at most this many sweeps over the batch sizes; more are taken while
// one more still moves an estimate by over kCostsSettled, within the time budget.
constexpr size_t kMinCostSweeps = 3, kMaxCostSweeps = 6;
constexpr double kCostsSettled = 0.05;
constexpr double kCalibrationBudgetSeconds = 5.0;
// How often a waiting caller looks at its own cancel flag and deadline.
constexpr auto kPollInterval = std::chrono::milliseconds(10);
// How long the scheduler thread waits for work before it ends (a new request starts another).
constexpr auto kSchedulerLinger = std::chrono::milliseconds(100);

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

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

// The engine whose callback this thread is running, if any.
thread_local const Engine* t_in_callback_of = nullptr;

class CallbackScope {
  public:
    explicit CallbackScope(const Engine* e) : previous_(t_in_callback_of) { t_in_callback_of = e; }
    ~CallbackScope() { t_in_callback_of = previous_; }
    CallbackScope(const CallbackScope&) = delete;
    CallbackScope& operator=(const CallbackScope&) = delete;

  private:
    const Engine* previous_;
};

// Ends a request that never reached a slot.
void end_unstarted(RequestChannel& channel, FinishReason reason) {
    {
        std::lock_guard<std::mutex> lock(channel.mutex);
        channel.result.finish_reason = reason;
        channel.result.stats.n_prompt = static_cast<int>(channel.request.prompt.size());
        channel.result.stats.t_queue = seconds_since(channel.called);
        channel.done = true;
    }
    channel.changed.notify_all();
}

// Ends a request that never reached a slot with `error`.
void fail_unstarted(RequestChannel& channel, std::exception_ptr error) {
    {
        std::lock_guard<std::mutex> lock(channel.mutex);
        channel.error = std::move(error);
        channel.done = true;
    }
    channel.changed.notify_all();
}

// Takes `item` out of `queue` if it is still there (the scheduler has not taken it).
template <typename T>
bool remove_queued(std::deque<std::shared_ptr<T>>& queue, const T* item) {
    const auto it = std::find_if(queue.begin(), queue.end(),
                                 [&](const auto& queued) { return queued.get() == item; });
    if (it == queue.end()) return false;
    queue.erase(it);
    return true;
}

}  // namespace

// Work that needs both contexts to itself (measurements, calibration), run by the scheduler
// between steps while no request generates.
struct Engine::Job {
    std::function<void()> work;
    std::shared_ptr<CancelFlag> cancel;
    std::mutex mutex;
    std::condition_variable changed;
    bool started = false, done = false;
    std::exception_ptr error;
};

Engine::Engine(const EngineConfig& config)
    : config_(config), target_batch_(std::max(config.target.n_batch, kMaxDraft + 1)) {
    install_log_handler(config.verbose);
    // First, so that its first look at the machine covers the models' loading.
    const bool threads_given = config.target.n_threads > 0;
    governor_ = std::make_unique<ThreadGovernor>(
        threads_given ? config.target.n_threads : default_threads(), !threads_given);
    if (config.n_draft < 0 || config.n_draft > kMaxDraft)
        throw std::invalid_argument("n_draft must be in [0, " + std::to_string(kMaxDraft) + "]");
    if (config.ngram_min < 1 || config.ngram_max < config.ngram_min || config.ngram_max > 16)
        throw std::invalid_argument("need 1 <= ngram_min <= ngram_max <= 16, got " +
                                    std::to_string(config.ngram_min) + " and " +
                                    std::to_string(config.ngram_max));
    if (config.n_parallel < 1 || config.n_parallel > kMaxParallel)
        throw std::invalid_argument("n_parallel must be in [1, " + std::to_string(kMaxParallel) +
                                    "]");
    // Every decoding slot has a row in each step's decode (and llama.cpp aborts on a context
    // whose batch is smaller than its number of sequences).
    const int n_batch =
        std::min(config.target.n_batch, config.draft ? config.draft->n_batch : INT32_MAX);
    if (config.n_parallel > n_batch)
        throw std::invalid_argument("n_parallel (" + std::to_string(config.n_parallel) +
                                    ") must not exceed n_batch (" + std::to_string(n_batch) +
                                    "): each slot needs a row in every step's decode");
    config_.target.n_seq = config.n_parallel;
    target_ = std::make_unique<Model>(config_.target);
    check_supported(*target_);
    llama_set_abort_callback(target_->ctx(), abort_requested, this);
    if (config.draft) {
        config_.draft->n_seq = config.n_parallel;
        draft_ = std::make_unique<Model>(*config_.draft);
        check_supported(*draft_);
        const std::string why = vocab_mismatch(*target_, *draft_);
        if (!why.empty())
            throw VocabMismatchError("target " + target_->path() + " and draft " + draft_->path() +
                                     " cannot be paired: " + why);
        llama_set_abort_callback(draft_->ctx(), abort_requested, this);
        drafter_ = std::make_unique<ModelDrafter>(
            *draft_, kMaxDraft, [this](Model& m, const Batch& b) { decode(m, b); });
    }
    slots_.resize(static_cast<size_t>(config.n_parallel));
    last_used_.assign(static_cast<size_t>(config.n_parallel), 0);
    threads_now_.store(governor_->current());
}

Engine::~Engine() { stop_scheduler(); }

void Engine::start_scheduler_locked() {
    if (scheduler_running_) return;
    if (scheduler_.joinable()) scheduler_.join();  // it has left its loop: only exiting remains
    scheduler_ = std::thread([this] { schedule(); });
    scheduler_running_ = true;
}

void Engine::stop_scheduler() {
    {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        closing_.store(true);
    }
    wake_.notify_all();
    std::lock_guard<std::mutex> lock(join_mutex_);
    if (scheduler_.joinable()) scheduler_.join();
    stop_everything();
}

EngineParts Engine::parts() {
    return EngineParts{*target_,          draft_.get(),      drafter_.get(),  config_.ngram,
                       config_.ngram_min, config_.ngram_max, config_.n_draft, kMaxDraft};
}

bool Engine::running_on_this_thread() const {
    return t_in_callback_of == this || std::this_thread::get_id() == scheduler_id_.load();
}

void Engine::check_not_in_callback(const char* what) const {
    if (running_on_this_thread())
        throw ReentrantCallError(std::string("the engine is already running on this thread: a "
                                             "callback cannot ") +
                                 what + " on the decoder that is calling it");
}

void Engine::check_tokens(const std::vector<llama_token>& tokens) const {
    for (llama_token t : tokens)
        if (t < 0 || t >= target_->n_vocab())
            throw std::invalid_argument("token " + std::to_string(t) +
                                        " is outside the vocabulary (0.." +
                                        std::to_string(target_->n_vocab() - 1) + ")");
}

void Engine::check_request(const GenerateRequest& request) const {
    validate(request.sampling);
    if (request.prompt.empty()) throw std::invalid_argument("the prompt has no tokens");
    if (request.max_tokens < 1)
        throw std::invalid_argument("max_tokens must be >= 1, got " +
                                    std::to_string(request.max_tokens));
    // -1 is the engine's K; a request's own is 0..kMaxDraft.
    if (request.n_draft < -1 || request.n_draft > kMaxDraft)
        throw std::invalid_argument("n_draft must be in [0, " + std::to_string(kMaxDraft) +
                                    "], got " + std::to_string(request.n_draft));
    if (!(request.draft_p_min >= 0.0f && request.draft_p_min <= 1.0f))
        throw std::invalid_argument("draft_p_min must be in [0, 1], got " +
                                    std::to_string(request.draft_p_min));
    if (!(request.timeout >= 0.0) || std::isinf(request.timeout))
        throw std::invalid_argument("timeout must be a finite number of seconds >= 0 (0: none)");
    for (const auto& s : request.stop)
        if (s.empty()) throw std::invalid_argument("stop strings must not be empty");
    check_tokens(request.prompt);
    const int n_ctx = std::min(target_->n_ctx(), draft_ ? draft_->n_ctx() : target_->n_ctx());
    if (static_cast<int>(request.prompt.size()) >= n_ctx)
        throw ContextOverflowError("the prompt has " + std::to_string(request.prompt.size()) +
                                   " tokens but the context holds " + std::to_string(n_ctx) +
                                   "; raise n_ctx or shorten the prompt");
}

// ---------------------------------------------------------------- callers' side

GenerationResult Engine::generate(const GenerateRequest& request, const TextCallback& on_text,
                                  const StartCallback& on_start) {
    check_not_in_callback("call generate, calibrate or measure_decode_cost");
    check_request(request);
    const auto called = Clock::now();
    auto channel =
        std::make_shared<RequestChannel>(request, called, deadline_after(called, request.timeout));
    {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        if (closing_.load()) {
            end_unstarted(*channel, FinishReason::kCancelled);
            return std::move(channel->result);
        }
        waiting_.push_back(channel);
        try {
            start_scheduler_locked();
        } catch (...) {
            waiting_.pop_back();  // no thread to run it (the system is out of threads)
            throw;
        }
    }
    wake_.notify_all();
    return serve_caller(*channel, on_text, on_start);
}

GenerationResult Engine::serve_caller(RequestChannel& channel, const TextCallback& on_text,
                                      const StartCallback& on_start) {
    std::exception_ptr callback_error;
    // Runs a callback without the channel's lock; its exception is what the caller gets, once
    // generation stops.
    const auto call_back = [&](const std::function<void()>& callback) {
        if (callback_error) return;
        try {
            CallbackScope scope(this);
            callback();
        } catch (...) {
            callback_error = std::current_exception();
            channel.request.cancel->requested.store(true);
        }
    };
    bool start_told = !on_start;
    std::unique_lock<std::mutex> lock(channel.mutex);
    const auto has_news = [&] {
        return channel.done || !channel.text.empty() || (channel.admitted && !start_told);
    };
    while (true) {
        // Once admitted, the scheduler watches the request's flag and deadline: no need to
        // wake up for them (a wake-up takes a core from the decode's threads).
        if (channel.admitted)
            channel.changed.wait(lock, has_news);
        else
            channel.changed.wait_for(lock, kPollInterval, has_news);
        if (channel.admitted && !start_told) {
            start_told = true;
            lock.unlock();
            call_back(on_start);
            lock.lock();
            continue;
        }
        if (!channel.text.empty()) {
            std::string piece;
            piece.swap(channel.text);
            lock.unlock();
            if (on_text) call_back([&] { on_text(piece); });
            lock.lock();
            continue;
        }
        if (channel.done) break;
        const bool cancelled = channel.cancel_requested() || closing_.load();
        if (!channel.admitted && (cancelled || channel.past_deadline())) {
            lock.unlock();
            if (withdraw(&channel))
                end_unstarted(channel,
                              cancelled ? FinishReason::kCancelled : FinishReason::kTimeout);
            lock.lock();
        }
    }
    lock.unlock();
    if (callback_error) std::rethrow_exception(callback_error);
    if (channel.error) std::rethrow_exception(channel.error);
    return std::move(channel.result);
}

bool Engine::withdraw(const RequestChannel* channel) {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    return remove_queued(waiting_, channel);
}

void Engine::run_exclusive(std::function<void()> work, std::shared_ptr<CancelFlag> cancel) {
    auto job = std::make_shared<Job>();
    job->work = std::move(work);
    job->cancel = cancel ? std::move(cancel) : std::make_shared<CancelFlag>();
    {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        if (closing_.load()) throw Cancelled("the engine is shutting down");
        jobs_.push_back(job);
        try {
            start_scheduler_locked();
        } catch (...) {
            jobs_.pop_back();
            throw;
        }
    }
    wake_.notify_all();
    std::unique_lock<std::mutex> lock(job->mutex);
    while (!job->changed.wait_for(lock, kPollInterval, [&] { return job->done; })) {
        if (job->started || !(job->cancel->requested.load() || closing_.load())) continue;
        lock.unlock();
        bool withdrawn = false;
        {
            std::lock_guard<std::mutex> queue_lock(queue_mutex_);
            withdrawn = remove_queued(jobs_, job.get());
        }
        if (withdrawn) throw Cancelled("cancelled while waiting");
        lock.lock();
    }
    if (job->error) std::rethrow_exception(job->error);
}

void Engine::shutdown() {
    check_not_in_callback("close the decoder");
    stop_scheduler();
}

AdaptivePolicy Engine::policy() const {
    std::lock_guard<std::mutex> lock(policy_mutex_);
    return policy_;
}

BatchCosts Engine::batch_costs() const {
    std::lock_guard<std::mutex> lock(policy_mutex_);
    return batch_costs_;
}

// ---------------------------------------------------------------- the scheduler

void Engine::schedule() {
    scheduler_id_.store(std::this_thread::get_id());
    while (true) {
        std::shared_ptr<Job> job;
        {
            std::unique_lock<std::mutex> lock(queue_mutex_);
            const bool work = wake_.wait_for(lock, kSchedulerLinger, [&] {
                return closing_.load() || !waiting_.empty() || !jobs_.empty() || any_active();
            });
            if (!work) {
                // Idle: the thread ends, and llama.cpp's OpenMP team with it. Idle teams of
                // other decoders in the process make an active one's barriers sleep instead of
                // spin (libgomp throttles spinning once it manages more threads than cores):
                // three idle decoders made a fourth 3x slower.
                scheduler_running_ = false;
                scheduler_id_.store(std::thread::id());
                return;
            }
            if (closing_.load()) break;
            if (!jobs_.empty() && !any_active()) {
                job = jobs_.front();
                jobs_.pop_front();
                std::lock_guard<std::mutex> job_lock(job->mutex);
                job->started = true;
            }
        }
        if (job) {
            govern_threads();  // a calibration measures the threads the steps will use
            job_cancel_.store(job->cancel.get());
            try {
                job->work();
            } catch (...) {
                job->error = std::current_exception();
            }
            job_cancel_.store(nullptr);
            {
                std::lock_guard<std::mutex> job_lock(job->mutex);
                job->done = true;
            }
            job->changed.notify_all();
            continue;
        }
        try {
            admit_waiting();
            if (any_active()) step();
        } catch (const Cancelled&) {
            if (closing_.load()) break;
            fail_all(std::current_exception());
        } catch (...) {
            // A shared decode failed: every request in it fails with its error.
            fail_all(std::current_exception());
        }
    }
    stop_everything();
    scheduler_id_.store(std::thread::id());
}

void Engine::fail_all(std::exception_ptr error) {
    for (size_t s = 0; s < slots_.size(); ++s)
        if (slots_[s]) retire(static_cast<int>(s), error);
}

void Engine::stop_everything() {
    for (size_t s = 0; s < slots_.size(); ++s) {
        if (!slots_[s]) continue;
        slots_[s]->finish(FinishReason::kCancelled);
        retire(static_cast<int>(s));
    }
    std::deque<std::shared_ptr<RequestChannel>> waiting;
    std::deque<std::shared_ptr<Job>> jobs;
    {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        waiting.swap(waiting_);
        jobs.swap(jobs_);
    }
    for (auto& channel : waiting) end_unstarted(*channel, FinishReason::kCancelled);
    for (auto& job : jobs) {
        {
            std::lock_guard<std::mutex> lock(job->mutex);
            job->error = std::make_exception_ptr(Cancelled("the engine is shutting down"));
            job->done = true;
        }
        job->changed.notify_all();
    }
}

bool Engine::any_active() const {
    return std::any_of(slots_.begin(), slots_.end(), [](const auto& g) { return g != nullptr; });
}

bool Engine::needs_calibration(const GenerateRequest& request) const {
    if (!Generation::speculates_adaptively(request, drafter_ != nullptr || config_.ngram))
        return false;
    std::lock_guard<std::mutex> lock(policy_mutex_);
    return !policy_.calibrated();
}

int Engine::pick_slot(const std::vector<llama_token>& prompt) const {
    int best = -1;
    size_t best_common = 0;
    for (size_t s = 0; s < slots_.size(); ++s) {
        if (slots_[s]) continue;
        const auto seq = static_cast<llama_seq_id>(s);
        const size_t common = target_->common_prefix(seq, prompt);
        // The longest shared prefix; among equals, the slot unused the longest.
        if (best < 0 || common > best_common ||
            (common == best_common && last_used_[s] < last_used_[static_cast<size_t>(best)])) {
            best = static_cast<int>(s);
            best_common = common;
        }
    }
    return best;
}

void Engine::admit_waiting() {
    while (true) {
        std::shared_ptr<RequestChannel> channel;
        int seq = -1;
        {
            std::lock_guard<std::mutex> lock(queue_mutex_);
            // Exclusive work goes first once the running requests are done.
            if (waiting_.empty() || !jobs_.empty()) return;
            const auto& front = waiting_.front();
            // Calibration needs the contexts to itself: the request waits for the others.
            if (needs_calibration(front->request) && any_active()) return;
            seq = pick_slot(front->request.prompt);
            if (seq < 0) return;
            channel = front;
            waiting_.pop_front();
            std::lock_guard<std::mutex> channel_lock(channel->mutex);
            channel->admitted = true;
        }
        channel->changed.notify_all();  // its caller may be waiting to hear that it started
        start(channel, seq);
    }
}

void Engine::start(const std::shared_ptr<RequestChannel>& channel, int seq) {
    const GenerateRequest& request = channel->request;
    if (needs_calibration(request)) {
        // Calibration is a one-time cost of the engine, under this request's stop conditions.
        job_cancel_.store(request.cancel.get());
        job_deadline_ = channel->deadline;
        try {
            calibrate_locked(request.prompt);
        } catch (const Cancelled&) {
            end_unstarted(*channel, FinishReason::kCancelled);
        } catch (const TimedOut&) {
            end_unstarted(*channel, FinishReason::kTimeout);
        } catch (...) {
            fail_unstarted(*channel, std::current_exception());
        }
        job_cancel_.store(nullptr);
        job_deadline_.reset();
        std::lock_guard<std::mutex> lock(channel->mutex);
        if (channel->done) return;
    }
    const auto s = static_cast<size_t>(seq);
    try {
        slots_[s] = std::make_unique<Generation>(parts(), channel, seq, policy());
    } catch (...) {
        fail_unstarted(*channel, std::current_exception());
        return;
    }
    try {
        slots_[s]->begin();
    } catch (...) {
        retire(seq, std::current_exception());
    }
}

void Engine::retire(int seq, std::exception_ptr error) {
    const auto s = static_cast<size_t>(seq);
    std::unique_ptr<Generation> g = std::move(slots_[s]);
    last_used_[s] = ++clock_;
    if (error) {
        // Its cache may hold rows that were never verified.
        try {
            target_->forget_from(seq, 0);
            if (draft_) draft_->forget_from(seq, 0);
        } catch (...) {
            target_->clear_memory();
            if (draft_) draft_->clear_memory();
        }
    } else if (g->adaptive()) {
        // What it learnt (acceptance, costs) is where the next request starts from.
        {
            std::lock_guard<std::mutex> lock(policy_mutex_);
            policy_ = g->policy();
        }
        if (g->ended_normally() && g->policy().costs_disagree() && !any_active())
            recalibrate_after(*g);
    }
    g->publish(error);
}

void Engine::recalibrate_after(Generation& g) {
    // Before its result goes out, so that what the caller stores is the new measurement.
    job_cancel_.store(g.cancel_flag());
    try {
        calibrate_locked(g.prompt());
        g.note_recalibrated();
    } catch (const std::exception&) {
        // Cancelled, or a failed decode: the old costs stay.
    }
    job_cancel_.store(nullptr);
}

void Engine::govern_threads() {
    const int threads = governor_->threads();
    if (threads == threads_now_.load()) return;
    target_->set_threads(threads);
    if (draft_) draft_->set_threads(threads);
    threads_now_.store(threads);
}

void Engine::step() {
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
    choose_ks(row_cap);
    if (decoding_.size() > 1) plan_ks(decoding_, prompt_rows(prefill_budget));
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
    for (Generation* g : prefilled_) g->prefill_decoded(t_verify);
    // After the decode: their rows in it had to be decoded in place.
    for (const auto& [seq, error] : failed_) retire(seq, error);
    if (!decoding_.empty()) size_prefill_chunk(t_verify, !prefilled_.empty());
    const bool shared = decoding_.size() + prefilled_.size() > 1;
    accept_all(decoding_, t_verify, shared);
    // Their decode is the prompt's (its time in stats.t_prompt), no step shared with others.
    accept_all(starting_, 0.0, /*shared=*/false, /*with_prompt=*/true);
}

void Engine::choose_ks(int row_cap) {
    // A failure while choosing (an n-gram index out of memory, say) is that request's alone.
    for (Generation*& g : decoding_) {
        try {
            g->choose_k(row_cap);
        } catch (...) {
            retire(g->seq(), std::current_exception());
            g = nullptr;
        }
    }
    decoding_.erase(std::remove(decoding_.begin(), decoding_.end(), nullptr), decoding_.end());
}

void Engine::draft_all() {
    // N-gram matches first, then the draft model, for every sequence in one go.
    draft_jobs_.clear();
    by_model_.assign(decoding_.size(), false);
    for (size_t i = 0; i < decoding_.size(); ++i) {
        Generation* g = decoding_[i];
        if (!g->draft_by_ngram() && g->k() > 0 && drafter_) {
            draft_jobs_.push_back(g->model_job());
            by_model_[i] = true;
        }
    }
    const auto start = Clock::now();
    if (!draft_jobs_.empty()) drafter_->propose(draft_jobs_);
    const double seconds = seconds_since(start);
    for (size_t i = 0; i < decoding_.size(); ++i) decoding_[i]->drafted(by_model_[i] ? seconds : 0);
}

namespace {
// A waiting prompt's part in this step, at most `room` rows: a short one whole (its stall on
// the running streams is one step's either way, and chunks would only put off its first
// token), a longer one as much as the step's chunk `budget` has left (lowered here).
struct PromptShare {
    int rows = 0;
    // The chunk ends a greedy prompt and brings its first token's row: the time to the first
    // token is one decode, not that and a speculative step. A sampled prompt's first token
    // comes from a step, as when the prompt is cached: decoded in another batch shape its
    // logits would differ by float noise, and a seed would not repeat a call.
    bool first_row = false;
};
PromptShare prompt_share(const Generation& g, int& budget, int room) {
    const int left = g.prompt_left();
    const bool chunked = left > Engine::kPrefillChunk;
    const int rows = std::min({left, chunked ? budget : left, room});
    if (chunked) budget -= rows;
    return {rows, rows == left && rows < room && g.greedy()};
}
}  // namespace

void Engine::add_prompt_chunks(int budget, int room) {
    prefilled_.clear();
    starting_.clear();
    failed_.clear();
    for (Generation* g : prefilling_) {
        const PromptShare share = prompt_share(*g, budget, room);
        if (share.rows <= 0) continue;
        try {
            room -= g->add_prefill(target_batch_, share.rows);
            prefilled_.push_back(g);
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

void Engine::accept_all(const std::vector<Generation*>& gens, double t_verify, bool shared,
                        bool with_prompt) {
    for (Generation* g : gens) {
        try {
            g->accept(t_verify, shared, with_prompt);
        } catch (...) {
            retire(g->seq(), std::current_exception());
            continue;
        }
        if (g->finished()) retire(g->seq());
    }
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
    for (const Generation* g : prefilling_) {
        const PromptShare share = prompt_share(*g, budget, target_->n_batch());
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

// ---------------------------------------------------------------- decodes and measurements

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

double Engine::time_decode_locked(Model& model, Batch& batch,
                                  const std::vector<llama_token>& context, int n) {
    const auto pos = static_cast<llama_pos>(context.size());
    batch.clear();
    for (int i = 0; i < n; ++i)
        batch.add(context[static_cast<size_t>(i) % context.size()], pos + i, true);
    const auto start = Clock::now();
    decode(model, batch);
    const double seconds = seconds_since(start);
    model.forget_from(0, pos);
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
    if (!drafter_ && !config_.ngram)
        throw std::invalid_argument("calibration needs a drafter (model or n-gram)");
    if (context.empty()) throw std::invalid_argument("the context has no tokens");
    check_tokens(context);
    run_exclusive([&] { calibrate_locked(context); }, std::move(cancel));
}

void Engine::set_calibration(std::vector<double> verify_costs, std::vector<double> draft_costs) {
    if (!drafter_ && !config_.ngram)
        throw std::invalid_argument("calibration needs a drafter (model or n-gram)");
    std::lock_guard<std::mutex> lock(policy_mutex_);
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
            const double t = time_decode_locked(model, batch, context, n);
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
