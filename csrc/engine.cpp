#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "errors.h"
#include "logging.h"

namespace specdec {
namespace {

// How often a waiting caller looks at its own cancel flag and deadline.
constexpr auto kPollInterval = std::chrono::milliseconds(10);
// How long the scheduler thread waits for work before it ends (a new request starts another).
constexpr auto kSchedulerLinger = std::chrono::milliseconds(100);

// Past this, a deadline is none: a clock's nanoseconds would overflow (at about 9e9 s).
constexpr double kLongestDeadlineSeconds = 1e9;

Deadline deadline_after(Clock::time_point start, double seconds) {
    if (seconds <= 0 || !(seconds < kLongestDeadlineSeconds)) return std::nullopt;
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
    : config_(config),
      target_batch_(std::max(config.target.n_batch, kMaxDraft + 1)),
      rate_check_(config.n_parallel) {
    install_log_handler(config.verbose);
    // First, so that its first look at the machine covers the models' loading.
    const bool threads_given = config.target.n_threads > 0;
    const int threads = threads_given ? config.target.n_threads : usable_cores();
    governor_ = std::make_unique<ThreadGovernor>(threads, !threads_given);
    threads_now_.store(threads);
    if (config.n_draft < 0 || config.n_draft > kMaxDraft)
        throw std::invalid_argument("n_draft must be in [0, " + std::to_string(kMaxDraft) + "]");
    if (config.ngram_min < 1 || config.ngram_max < config.ngram_min || config.ngram_max > 16)
        throw std::invalid_argument("need 1 <= ngram_min <= ngram_max <= 16, got " +
                                    std::to_string(config.ngram_min) + " and " +
                                    std::to_string(config.ngram_max));
    // Copies weighed against a draft model need one: without it fixed-K requests would count
    // as drafting with nothing to draft.
    if (config.ngram == NgramUse::kUnderAuto && !config.draft)
        throw std::invalid_argument("ngram 'auto' weighs copies against a draft model: give one");
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
    if (config.ngram == NgramUse::kAlways && config.ngram_index_bytes > 0)
        ngram_index_ = std::make_unique<SharedNgramIndex>(config.ngram_min, config.ngram_max,
                                                          config.ngram_index_bytes);
    slots_.resize(static_cast<size_t>(config.n_parallel));
    last_used_.assign(static_cast<size_t>(config.n_parallel), 0);
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
    return EngineParts{*target_,           draft_.get(),          drafter_.get(),
                       config_.ngram,      config_.ngram_min,     config_.ngram_max,
                       ngram_index_.get(), &prediction_copy_,     config_.n_draft,
                       kMaxDraft,          grammar_drafts_.load()};
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

void Engine::check_request_values(const GenerateRequest& request) {
    validate(request.sampling);
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
    for (const auto& entry : request.logit_bias)
        if (!(entry.second >= -100.0f && entry.second <= 100.0f))
            throw std::invalid_argument("logit_bias values must be in [-100, 100]");
    for (float penalty : {request.presence_penalty, request.frequency_penalty})
        if (!(penalty >= -2.0f && penalty <= 2.0f))
            throw std::invalid_argument(
                "presence_penalty and frequency_penalty must be in [-2, 2]");
    if (!(request.repeat_penalty > 0.0f) || std::isinf(request.repeat_penalty))
        throw std::invalid_argument("repeat_penalty must be a finite number > 0 (1: off)");
    if (request.repeat_last_n < -1)
        throw std::invalid_argument("repeat_last_n must be >= -1 (-1: the whole sequence)");
    if (request.ignore_eos && !request.constraint_kind.empty())
        throw std::invalid_argument(
            "ignore_eos cannot be combined with structured output (a JSON schema, grammar, "
            "regex or tools): the output could never end");
    if (request.logprobs < -1 || request.logprobs > kMaxTopLogprobs)
        throw std::invalid_argument("logprobs must be -1 (none) or in [0, " +
                                    std::to_string(kMaxTopLogprobs) + "], got " +
                                    std::to_string(request.logprobs));
    if (request.prompt_logprobs < -1 || request.prompt_logprobs > kMaxTopLogprobs)
        throw std::invalid_argument("prompt_logprobs must be -1 (none) or in [0, " +
                                    std::to_string(kMaxTopLogprobs) + "], got " +
                                    std::to_string(request.prompt_logprobs));
}

void Engine::check_request(const GenerateRequest& request) const {
    check_request_values(request);
    if (request.prompt.empty()) throw std::invalid_argument("the prompt has no tokens");
    for (const auto& entry : request.logit_bias) check_tokens({entry.first});
    check_tokens(request.prompt);
    check_tokens(request.prediction);
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
    auto channel = std::make_shared<RequestChannel>(
        request, called, deadline_after(called, request.timeout), static_cast<bool>(on_text));
    if (!request.constraint_kind.empty())
        channel->constraint =
            constraint_vocab().compile(request.constraint_kind, request.constraint);
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
        // At the end, logprobs without text too (a last token with an empty piece).
        if (!channel.text.empty() || (channel.done && !channel.logprobs.empty())) {
            std::string piece;
            std::vector<TokenLogprob> logprobs;
            piece.swap(channel.text);
            logprobs.swap(channel.logprobs);
            lock.unlock();
            if (on_text) call_back([&] { on_text(piece, logprobs); });
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
        if (job->started || !(job->cancel->is_set() || closing_.load())) continue;
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

void Engine::require_ngram_index() const {
    if (!ngram_index_)
        throw std::invalid_argument(
            "this decoder has no shared n-gram index (n-gram drafting "
            "with an index budget > 0)");
}

VocabKey Engine::vocab_key() const {
    return VocabKey{target_->n_vocab(), vocab_fingerprint(*target_)};
}

void Engine::save_ngram_index(const std::string& path) {
    check_not_in_callback("save the n-gram index");
    require_ngram_index();
    run_exclusive([&] { ngram_index_->save(path, vocab_key()); }, nullptr);
}

void Engine::load_ngram_index(const std::string& path) {
    check_not_in_callback("load an n-gram index");
    require_ngram_index();
    run_exclusive(
        [&] {
            std::exception_ptr failed;
            try {
                ngram_index_->load(path, vocab_key());
            } catch (...) {
                failed = std::current_exception();  // the index is as it was, or empty
            }
            index_tokens_.store(ngram_index_->n_tokens());
            index_bytes_.store(ngram_index_->bytes());
            if (failed) std::rethrow_exception(failed);
        },
        nullptr);
}

void Engine::shutdown() {
    check_not_in_callback("close the decoder");
    stop_scheduler();
}

AdaptivePolicy Engine::policy() const {
    std::lock_guard<std::mutex> lock(policy_mutex_);
    return policy_;
}

std::pair<AdaptivePolicy, BatchCosts> Engine::costs() const {
    std::lock_guard<std::mutex> lock(policy_mutex_);
    return {policy_, stored_batch_costs_ ? *stored_batch_costs_ : batch_costs_};
}

const ConstraintVocab& Engine::constraint_vocab() {
    std::lock_guard<std::mutex> lock(constraint_mutex_);
    if (!constraint_vocab_) constraint_vocab_ = std::make_unique<ConstraintVocab>(*target_);
    return *constraint_vocab_;
}

RateCheck Engine::rate_check() const {
    std::lock_guard<std::mutex> lock(policy_mutex_);
    return rate_check_;
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
            adopt_stored_batch_costs();
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
    if (!Generation::speculates_adaptively(request,
                                           drafter_ != nullptr || config_.ngram != NgramUse::kOff))
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
        const size_t common = target_->servable_prefix(seq, target_->common_prefix(seq, prompt));
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
    // A request alone on the engine is new text: a hold that judged the last one ends.
    if (!any_active()) {
        std::lock_guard<std::mutex> lock(policy_mutex_);
        rate_check_.new_text(1);
    }
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
        AdaptivePolicy learnt = g->policy();
        learnt.end_generation(g->ended_normally());
        {
            std::lock_guard<std::mutex> lock(policy_mutex_);
            policy_ = std::move(learnt);
        }
        if (recalibration_due(*g)) recalibrate_after(*g);
    }
    if (SharedNgramIndex* index = g->ngram_index(); index && !error) {
        // The index is an optimisation: its failure (out of memory) must not touch a request.
        try {
            index->add(g->prompt(), g->output());
        } catch (...) {
            index->clear();
        }
        index_tokens_.store(index->n_tokens());
        index_bytes_.store(index->bytes());
    }
    g->publish(error);
}

bool Engine::recalibration_due(const Generation& g) {
    if (!g.ended_normally()) return false;
    // On a GPU a step's decode and a calibration's differ by design, not because the costs went
    // stale: a step whose K changed runs without a CUDA graph. Measuring again would disagree as
    // much, and takes seconds; the steps' own timings move the costs there (AdaptivePolicy).
    if (times_as_on_a_gpu(*target_)) return false;
    const auto verdict = g.policy().cost_verdict();
    if (verdict == AdaptivePolicy::CostVerdict::kAgree) recalibrations_in_a_row_ = 0;
    if (verdict != AdaptivePolicy::CostVerdict::kDisagree) return false;
    ++requests_since_recalibration_;
    const int wait = 1 << std::min(recalibrations_in_a_row_, 16);
    return requests_since_recalibration_ >= wait && !any_active();
}

void Engine::recalibrate_after(Generation& g) {
    // Before its result goes out, so that what the caller stores is the new measurement.
    job_cancel_.store(g.cancel_flag());
    try {
        calibrate_locked(g.prompt());
        g.note_recalibrated();
        ++recalibrations_in_a_row_;
        requests_since_recalibration_ = 0;
    } catch (const std::exception&) {
        // Cancelled, or a failed decode: the old costs stay.
    }
    job_cancel_.store(nullptr);
}

}  // namespace specdec
