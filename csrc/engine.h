// The speculative loop: prompt -> [draft -> verify -> accept -> roll back]* -> stop.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "batch.h"
#include "cost_curve.h"
#include "drafter.h"
#include "model.h"
#include "policy.h"
#include "sampling.h"
#include "stats.h"

namespace specdec {

struct EngineConfig {
    ModelParams target;
    std::optional<ModelParams> draft;
    int n_draft = 4;     // K: tokens drafted per step (0: target only)
    bool ngram = false;  // draft from n-gram matches in the context (before the draft model)
    int ngram_min = 1;
    int ngram_max = 4;
    bool verbose = false;
};

// Set from any thread to stop one request ("cancelled"), whether it runs or still waits.
struct CancelFlag {
    std::atomic<bool> requested{false};
};

struct GenerateRequest {
    std::vector<llama_token> prompt;
    int max_tokens = 128;
    SamplingParams sampling;
    uint64_t seed = 0;
    std::vector<std::string> stop;
    int n_draft = -1;          // -1: the engine's default
    bool adaptive = false;     // choose K each step from measured costs (n_draft is then ignored)
    float draft_p_min = 0.0f;  // stop drafting when the draft's probability falls below this
    double timeout = 0.0;      // seconds from the call after which it ends ("timeout"); 0: never
    std::shared_ptr<CancelFlag> cancel;  // may be null
    // Test-only: on rejection resample from p instead of norm(max(0, p - q)). A deliberately
    // wrong rule, so the distribution tests can show that they catch it.
    bool wrong_residual_for_tests = false;
};

struct GenerationResult {
    std::vector<llama_token> tokens;
    std::string text;
    std::string finish_reason;  // "stop", "length", "context", "cancelled", "timeout"
    // Greedy only: for each token, the target's top-1 minus top-2 logit where it was chosen.
    std::vector<float> margins;
    Stats stats;
};

// Receives text as it is committed, in order. May throw to stop generation.
using TextCallback = std::function<void(const std::string&)>;

class Engine {
  public:
    static constexpr int kMaxDraft = 64;
    // Requests shorter than this are not worth drafting for in adaptive mode.
    static constexpr int kMinTokensToSpeculate = 4;

    explicit Engine(const EngineConfig& config);
    ~Engine();

    // One call at a time: a second caller waits for the first to finish. A call from the
    // thread the engine is already running on (a callback) throws ReentrantCallError.
    GenerationResult generate(const GenerateRequest& request, const TextCallback& on_text);
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
    // tokens) instead of measuring them now.
    void set_calibration(std::vector<double> verify_costs, std::vector<double> draft_costs);
    const AdaptivePolicy& policy() const { return policy_; }
    // Stops the running call, refuses every later one, and returns once none runs: after it the
    // engine can be destroyed. Throws ReentrantCallError from inside a call (a callback).
    void shutdown();
    // Whether the calling thread is inside one of this engine's calls (a callback is).
    bool running_on_this_thread() const { return owner_.load() == std::this_thread::get_id(); }

    const Model& target() const { return *target_; }
    const Model* draft() const { return draft_.get(); }
    int n_draft() const { return config_.n_draft; }
    bool has_drafter() const { return drafter_ != nullptr; }

  private:
    friend class Generation;
    class Hold;
    // Whether the running call must stop: shutdown(), or its own request's flag.
    bool stop_requested() const {
        return closing_.load() || (request_cancel_ && request_cancel_->requested.load());
    }
    // Throws std::invalid_argument for a token outside the vocabulary.
    void check_tokens(const std::vector<llama_token>& tokens) const;
    // llama.cpp's abort callback: lets a long decode stop part-way.
    static bool abort_requested(void* engine) {
        return static_cast<const Engine*>(engine)->stop_requested();
    }
    std::vector<double> measure_decode_cost_locked(const std::vector<llama_token>& context,
                                                   int max_n, int repeats, Model& model);
    void calibrate_locked(const std::vector<llama_token>& context);
    // Seconds for one decode of n tokens after `context`, which `model` holds; forgotten after.
    double time_decode_locked(Model& model, Batch& batch, const std::vector<llama_token>& context,
                              int n);
    // Target decodes of 1..max_n tokens, each of 1 and 2 followed by the draft's of that size.
    CostSweep cost_sweep_locked(const std::vector<llama_token>& context, int max_n, Batch& batch);
    void decode(Model& model, const Batch& batch);
    // Decodes tokens[from, end) at positions from.. (the cache holds tokens[0, from)), at most
    // `chunk` tokens per decode (0: as many as the model's n_batch).
    void decode_sequence(Model& model, Batch& batch, const std::vector<llama_token>& tokens,
                         size_t from, size_t end, bool logits_on_last, size_t chunk);

    EngineConfig config_;
    std::unique_ptr<Model> target_;
    std::unique_ptr<Model> draft_;
    std::unique_ptr<Drafter> drafter_;
    Batch target_batch_;
    std::timed_mutex busy_;
    std::atomic<std::thread::id> owner_{};  // the thread holding busy_
    std::atomic<bool> closing_{false};
    // The running request's own stop conditions, read by every decode.
    std::shared_ptr<CancelFlag> request_cancel_;
    std::optional<std::chrono::steady_clock::time_point> deadline_;
    AdaptivePolicy policy_;
};

}  // namespace specdec
