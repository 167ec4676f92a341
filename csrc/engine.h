// The serving engine: requests from any thread share slots (sequences) of one target and one
// draft context, and a scheduler thread runs one batched step for all of them at a time:
// prompt chunks -> [draft -> verify -> accept -> roll back]* -> stop, per slot.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "batch.h"
#include "constraint.h"
#include "cost_curve.h"
#include "cpu_share.h"
#include "generation.h"
#include "model.h"
#include "model_drafter.h"
#include "policy.h"
#include "rate_check.h"

namespace specdec {

struct EngineConfig {
    ModelParams target;
    std::optional<ModelParams> draft;
    int n_draft = 4;                  // K: tokens drafted per step (0: target only)
    NgramUse ngram = NgramUse::kOff;  // which requests draft from n-gram matches in the context
    int ngram_min = 1;
    int ngram_max = 4;
    // With ngram kAlways: bytes of one index over every request's output that later requests copy
    // from (0: each request copies its own text only).
    size_t ngram_index_bytes = 0;
    int n_parallel = 1;  // requests generating at once, each in its own slot
    bool verbose = false;
};

// Receives text as it is committed, in order, on the calling thread, with the logprobs of the
// tokens committed since the last call (when the request asked for them; the tokens of text
// held back come with the text). May throw to stop generation.
using TextCallback = std::function<void(const std::string&, const std::vector<TokenLogprob>&)>;
using StartCallback = std::function<void()>;

class Engine {
  public:
    static constexpr int kMaxDraft = 64;
    static constexpr int kMaxParallel = 64;
    // While other slots generate, a prompt longer than this is read in chunks that ride in
    // their steps' target decodes, sized so that the streams go on (size_prefill_chunk):
    // starting at this many tokens, never fewer than kMinPrefillChunk. Shorter ones are read
    // whole.
    static constexpr int kPrefillChunk = 32;
    static constexpr int kMinPrefillChunk = 8;
    // Throws std::invalid_argument for a request's values that no model could accept (its prompt
    // and token ids are the engine's to check): what a caller can check before loading one.
    static void check_request_values(const GenerateRequest& request);

    explicit Engine(const EngineConfig& config);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // From any thread: up to n_parallel calls generate together, later ones wait for a slot.
    // `on_text` runs on the calling thread, and so does `on_start`, once, when the request takes
    // a slot (before any text; never for a request that ends while it waits). A call from inside
    // a callback of this engine throws ReentrantCallError.
    GenerationResult generate(const GenerateRequest& request, const TextCallback& on_text,
                              const StartCallback& on_start = {});
    // The target's logits for the token after `context`, read afresh (the cache is cleared):
    // in n_batch chunks, or one token per decode as target-only generation reads it.
    std::vector<float> next_token_logits(const std::vector<llama_token>& context, bool batched,
                                         std::shared_ptr<CancelFlag> cancel = nullptr);
    // Seconds one decode of n tokens costs after `context`, for n = 1..max_n (median of
    // `repeats`), on the target or on the draft. The cache is cleared.
    std::vector<double> measure_decode_cost(const std::vector<llama_token>& context, int max_n,
                                            int repeats, bool on_draft,
                                            std::shared_ptr<CancelFlag> cancel = nullptr);
    // Measures the cost curve the adaptive policy needs (a few seconds); done on first use.
    void calibrate(const std::vector<llama_token>& context,
                   std::shared_ptr<CancelFlag> cancel = nullptr);
    // Uses costs measured earlier (t_verify(n) for n = 1..; a draft decode of 1 and of 2
    // tokens; with several slots, the batch costs as (rows, seconds)) instead of measuring them.
    void set_calibration(std::vector<double> verify_costs, std::vector<double> draft_costs,
                         std::vector<std::pair<int, double>> batch_verify = {},
                         std::vector<std::pair<int, double>> batch_draft = {});
    // The policy as the last adaptive request left it (a copy: requests run on).
    AdaptivePolicy policy() const;
    // The policy and the batch costs at one moment (what is stored is one measurement's).
    std::pair<AdaptivePolicy, BatchCosts> costs() const;
    RateCheck rate_check() const;
    // Whether `auto`'s steps are checked against measured target-only steps: `on` for steps of
    // one sequence (off by default: it did not win outside the noise on held-out zoo pairs),
    // `under_load` for steps of several (on by default: it won there; docs/zoo.md).
    void set_rate_check(bool on, bool under_load = true) {
        rate_check_on_.store(on);
        rate_check_under_load_.store(under_load);
    }
    // Whether drafts know a request's grammar (on by default): its forced tokens are drafted
    // and the draft model's q is masked to the tokens it allows. Off, to measure what that
    // brings, drafts ignore it and are cut at their first invalid token. Requests admitted
    // later see the change.
    void set_grammar_drafts(bool on) { grammar_drafts_.store(on); }
    // Stops every request (they end "cancelled"), refuses every later one, and returns once the
    // scheduler has stopped: after it the engine can be destroyed. Throws ReentrantCallError
    // from a callback.
    void shutdown();
    // Whether the calling thread is inside a callback of this engine.
    bool running_on_this_thread() const;

    const Model& target() const { return *target_; }
    const Model* draft() const { return draft_.get(); }
    int n_draft() const { return config_.n_draft; }
    int n_parallel() const { return config_.n_parallel; }
    // Threads the decodes use now: fewer than configured while other processes keep cores busy
    // (unless the thread count was given).
    int n_threads_now() const { return threads_now_.load(); }
    // The shared n-gram index's size now: its tokens and its estimated bytes (0 without one).
    size_t ngram_index_tokens() const { return index_tokens_.load(); }
    size_t ngram_index_bytes() const { return index_bytes_.load(); }
    // Saves the shared n-gram index to a file, or replaces it with one saved earlier (on the
    // scheduler thread, between requests). Throws std::invalid_argument without an index.
    void save_ngram_index(const std::string& path);
    void load_ngram_index(const std::string& path);

    // Throws std::invalid_argument for a token outside the vocabulary.
    void check_tokens(const std::vector<llama_token>& tokens) const;

  private:
    struct Job;
    // Whether the decode running must stop: shutdown(), or the exclusive job's own flag.
    bool stop_requested() const {
        const CancelFlag* job = job_cancel_.load();
        return closing_.load() || (job && job->is_set());
    }
    // llama.cpp's abort callback: lets a long decode stop part-way.
    static bool abort_requested(void* engine) {
        return static_cast<const Engine*>(engine)->stop_requested();
    }
    void check_not_in_callback(const char* what) const;
    void require_ngram_index() const;  // std::invalid_argument without one
    VocabKey vocab_key() const;        // the target's, for index files
    void check_request(const GenerateRequest& request) const;
    // The target's vocabulary for llguidance: built by the first constrained request.
    const ConstraintVocab& constraint_vocab();
    // Hands committed text to `on_text` until the request is done; returns its result.
    GenerationResult serve_caller(RequestChannel& channel, const TextCallback& on_text,
                                  const StartCallback& on_start);
    // Removes a request that still waits for a slot; false when the scheduler has taken it.
    bool withdraw(const RequestChannel* channel);
    // Runs `work` on the scheduler thread while no request generates, and waits for it.
    void run_exclusive(std::function<void()> work, std::shared_ptr<CancelFlag> cancel);

    // The scheduler thread: started for work, ending when idle.
    void schedule();
    void start_scheduler_locked();  // queue_mutex_ held
    void stop_scheduler();
    bool any_active() const;
    // Moves waiting requests into free slots (the one whose cache shares the longest prefix
    // with the prompt).
    void admit_waiting();
    // Takes up batch costs set_calibration read from a store (the scheduler's to write).
    void adopt_stored_batch_costs();
    int pick_slot(const std::vector<llama_token>& prompt) const;
    void start(const std::shared_ptr<RequestChannel>& channel, int seq);
    bool needs_calibration(const GenerateRequest& request) const;
    // One step of every slot: prompt chunks, drafts, one target decode, acceptance.
    void step();
    // The phases of a step, over decoding_ and prefilling_.
    void choose_ks(int row_cap);
    // Whether this step must decode the target alone, as the rate check measured (all
    // decoding sequences adaptive; csrc/rate_check.h).
    bool held_to_target_only();
    // A failure of one request's own (its grammar's, say) ends that request alone.
    void draft_all();
    // Runs f(g); an exception from it retires g's request with it and nulls g (the caller
    // erases the nulls from decoding_).
    template <typename F>
    void or_retire(Generation*& g, F&& f);
    // Into target_batch_, at most `room` rows: short prompts whole, longer ones in chunks of at
    // most `budget` rows in all.
    void add_prompt_chunks(int budget, int room);
    // Returns the tokens the steps committed.
    int accept_all(const std::vector<Generation*>& gens, double t_verify, bool shared,
                   bool with_prompt = false);
    // Sets each adaptive sequence's K for the batch as a whole (several decoding at once).
    void plan_ks(const std::vector<Generation*>& decoding, int prefill_rows);
    // The rows waiting prompts add to this step (add_prompt_chunks', room allowing).
    int prompt_rows(int budget) const;
    // The batch cost table learns from each target decode.
    void learn_batch_cost(int rows, double seconds);
    // Learns the next prompt chunk's size from this step's decode time.
    void size_prefill_chunk(double t_decode, bool with_prefill);
    void retire(int seq, std::exception_ptr error = nullptr);
    void fail_all(std::exception_ptr error);
    // Measures the costs again after a request whose steps found them off (idle engine only,
    // and backing off while they stay off).
    void recalibrate_after(Generation& g);
    // Counts a finished request's verdict on the costs toward the back-off; true when the costs
    // are to be measured again now.
    bool recalibration_due(const Generation& g);
    void stop_everything();
    EngineParts parts();

    void decode(Model& model, const Batch& batch);
    // Decodes tokens[from, end) of sequence 0 at positions from.. (the cache holds
    // tokens[0, from)), at most `chunk` tokens per decode (0: as many as the model's n_batch).
    void decode_sequence(Model& model, Batch& batch, const std::vector<llama_token>& tokens,
                         size_t from, size_t end, bool logits_on_last, size_t chunk);
    std::vector<double> measure_decode_cost_locked(const std::vector<llama_token>& context,
                                                   int max_n, int repeats, Model& model);
    void calibrate_locked(const std::vector<llama_token>& context);
    // Before a step or exclusive work: the governor's thread count for now, on both models.
    void govern_threads();
    // The costs of batches larger than one sequence's steps, for plan_ks.
    BatchCosts measure_batch_costs(const std::vector<llama_token>& context, const CostCurve& curve,
                                   Batch& batch);
    // Whether `model`'s decodes time as on a GPU: a shape runs much faster from its third decode
    // in a row (llama.cpp's CUDA graphs) than alone.
    static bool times_as_on_a_gpu(const Model& model);
    // Seconds for one decode of n tokens after `context`, which `model` holds; forgotten after.
    // `warm`: the decode just before was of the same shape (a GPU's graph needs no warm-up).
    double time_decode_locked(Model& model, Batch& batch, const std::vector<llama_token>& context,
                              int n, bool warm = false);
    // Target decodes of 1..max_n tokens, each of 1 and 2 followed by the draft's of that size.
    CostSweep cost_sweep_locked(const std::vector<llama_token>& context, int max_n, Batch& batch);

    EngineConfig config_;
    std::unique_ptr<Model> target_;
    std::unique_ptr<Model> draft_;
    std::unique_ptr<ModelDrafter> drafter_;
    std::unique_ptr<SharedNgramIndex> ngram_index_;  // scheduler thread (null: none)
    // How far predictions' copies are accepted, learnt over every request that brought one (a
    // client's predictions are alike, and a request is too short to learn it alone): scheduler
    // thread.
    CopyPolicy prediction_copy_;
    std::atomic<size_t> index_tokens_{0}, index_bytes_{0};
    Batch target_batch_;

    // policy_, batch_costs_ and rate_check_, read from any thread
    mutable std::mutex policy_mutex_;
    AdaptivePolicy policy_;
    BatchCosts batch_costs_;
    // Batch costs from set_calibration, until the scheduler takes them up before its next
    // admission: a caller must not wait for the running requests to set them.
    std::optional<BatchCosts> stored_batch_costs_;
    std::atomic<bool> stored_batch_costs_pending_{false};

    std::mutex queue_mutex_;  // waiting_, jobs_
    std::condition_variable wake_;
    std::deque<std::shared_ptr<RequestChannel>> waiting_;
    std::deque<std::shared_ptr<Job>> jobs_;
    std::atomic<bool> closing_{false};
    std::atomic<CancelFlag*> job_cancel_{nullptr};  // the exclusive job's, while it runs
    Deadline job_deadline_;

    // Scheduler thread only.
    std::vector<std::unique_ptr<Generation>> slots_;  // [seq]; null when free
    std::vector<uint64_t> last_used_;                 // [seq]: when its request ended
    uint64_t clock_ = 0;
    // Recalibration backs off while the costs it measures keep disagreeing with the steps (a
    // machine whose decodes time differently in a calibration than in use): after n in a row the
    // next waits for 2^n disagreeing requests, so a lasting disagreement costs a vanishing share.
    int recalibrations_in_a_row_ = 0;
    int requests_since_recalibration_ = 0;
    std::vector<Generation*> decoding_, prefilling_, prefilled_;
    std::vector<Generation*> starting_;  // this step's first tokens, from the prompt's last chunk
    // [i]: decoding_[i] drafts with the draft model this step
    std::vector<bool> by_model_;
    std::vector<std::pair<int, std::exception_ptr>> failed_;  // (seq, error) of this step
    // plan_ks's: the adaptive sequences, their K caps, expected tokens and planned K
    std::vector<Generation*> plan_gens_;
    std::vector<int> plan_caps_, plan_k_, plan_trial_;
    static constexpr int kBatchProbeInterval = 8;
    int steps_since_batch_probe_ = 0;  // steps the plan cut since requests last drafted freely
    std::vector<std::vector<double>> plan_expected_;
    std::mutex constraint_mutex_;
    std::unique_ptr<ConstraintVocab> constraint_vocab_;  // constraint_mutex_
    RateCheck rate_check_;                               // policy_mutex_
    std::atomic<bool> rate_check_on_{false};
    std::atomic<bool> rate_check_under_load_{true};
    std::atomic<bool> grammar_drafts_{true};
    bool step_measured_ = false;  // this step is one the rate check learns from
    bool step_drafted_ = false;
    bool step_read_prompt_ = false;  // a draft caught up on its prompt this step
    int prefill_chunk_ = kPrefillChunk;
    std::unique_ptr<ThreadGovernor> governor_;
    std::atomic<int> threads_now_{0};
    double plain_step_ = 0.0;  // seconds: the last step's decode without prompt rows
    std::vector<ModelDrafter::Job> draft_jobs_;

    bool scheduler_running_ = false;  // queue_mutex_
    std::mutex join_mutex_;
    std::thread scheduler_;
    std::atomic<std::thread::id> scheduler_id_{};
};

}  // namespace specdec
