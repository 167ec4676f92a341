// One request in the engine: what its caller and the scheduler share (RequestChannel), and its
// state while it holds a slot (Generation): the tokens, the sampler, the policy's evidence, the
// stats. The scheduler runs the phases of a step for every slot together; each phase here is
// one sequence's part in it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "batch.h"
#include "constraint.h"
#include "copy_policy.h"
#include "drafter.h"
#include "model.h"
#include "model_drafter.h"
#include "ngram_drafter.h"
#include "ngram_index.h"
#include "policy.h"
#include "prediction.h"
#include "sampling.h"
#include "stats.h"
#include "text_stream.h"

namespace specdec {

using Clock = std::chrono::steady_clock;
using Deadline = std::optional<Clock::time_point>;

inline double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

// Set from any thread to stop one request ("cancelled"), whether it runs or still waits.
struct CancelFlag {
    std::atomic<bool> requested{false};
    // A call's own flag (what its failing callback or Ctrl-C sets) stops it when the caller's
    // flag, `outer`, is set too; setting it leaves the caller's flag, shared perhaps, as it is.
    std::shared_ptr<const CancelFlag> outer;
    bool is_set() const { return requested.load() || (outer && outer->is_set()); }
};

// Sampling with a draft model: drafts sampled from q and accepted with min(1, p/q) accept
// sum min(p, q) per position; q's argmax as a point mass accepted with p(x) accepts
// p(argmax q). Both are exact, and which accepts more depends on the pair and the text. kAuto
// drafts each step by the rule this request's verified positions so far favour (both chances
// are known at every position verified); before any, by sampling.
enum class DraftRule { kAuto = 0, kSample = 1, kArgmax = 2 };

struct GenerateRequest {
    std::vector<llama_token> prompt;
    int max_tokens = 128;
    SamplingParams sampling;
    uint64_t seed = 0;
    std::vector<std::string> stop;
    int n_draft = -1;          // -1: the engine's default
    bool adaptive = false;     // choose K each step from measured costs (n_draft is then ignored)
    float draft_p_min = 0.0f;  // stop drafting when the draft's probability falls below this
    DraftRule draft_rule = DraftRule::kAuto;
    double timeout = 0.0;  // seconds from the call after which it ends ("timeout"); 0: never
    std::shared_ptr<CancelFlag> cancel;  // may be null
    // A grammar the output must match (csrc/constraint.h): its kind ("" for none) and text.
    std::string constraint_kind;
    std::string constraint;
    // -1: none; n >= 0: each emitted token's log-probability under the target (temperature 1,
    // after logit_bias and penalties, masked by the grammar) and its n most likely
    // alternatives', n <= kMaxTopLogprobs.
    int logprobs = -1;
    // Added to the target's logits before anything else (OpenAI's logit_bias).
    std::vector<std::pair<llama_token, float>> logit_bias;
    // OpenAI's penalties: each token's logit lowers by presence_penalty once it has been
    // generated, and by frequency_penalty times how often (the prompt does not count).
    float presence_penalty = 0.0f;
    float frequency_penalty = 0.0f;
    // llama.cpp's repetition penalty: each token among the last repeat_last_n of the sequence
    // (prompt included; -1: all of it, 0: none) has its logit divided by repeat_penalty where
    // positive and multiplied by it where negative. 1: off.
    float repeat_penalty = 1.0f;
    int repeat_last_n = 64;
    // false: the request neither drafts from the engine's shared n-gram index nor adds its
    // output to it (its own text's n-gram drafts stay).
    bool ngram_index = true;
    // The output the caller expects (OpenAI's predicted outputs), drafted by copying it where
    // the output keeps to it; empty: none.
    std::vector<llama_token> prediction;
    // true: the target's end-of-generation tokens are masked out (llama.cpp's ignore_eos), so
    // the request runs to max_tokens, a stop string or a full context. Not with a grammar,
    // whose only way to end is such a token.
    bool ignore_eos = false;
    // -1: none; n >= 0: each prompt token's log-probability (all but the first, which nothing
    // predicts) under the target's own distribution (temperature 1, before logit_bias,
    // penalties and grammar: the model's, as a scorer wants it) and its n most likely
    // alternatives'. The prompt is then read afresh (no cached prefix: its logits are needed).
    int prompt_logprobs = -1;
};

constexpr int kMaxTopLogprobs = 20;

#ifdef SPECDEC_TEST_HOOKS
// Test builds only: on rejection resample from p instead of norm(max(0, p - q)). A deliberately
// wrong rule, so the distribution tests can show that they catch it.
extern std::atomic<bool> wrong_residual_for_tests;
// Test builds only: penalties count committed tokens alone, not the verdicts of the step so far
// (the bug the penalty distribution test must catch).
extern std::atomic<bool> stale_penalties_for_tests;
// Test builds only: verdicts taken without reading the target's logits (certain forced tokens).
extern std::atomic<long> verdicts_without_logits_for_tests;
// Test builds only: treat decodes as a GPU's (each shape timed after two untimed decodes of it;
// no recalibration after a request), and count the decodes made so far, so that a CPU test can
// run and count what only a GPU would.
extern std::atomic<bool> gpu_timing_for_tests;
extern std::atomic<long> decodes_for_tests;
#endif

// Why a generation ended. kNone: it has not.
enum class FinishReason { kNone, kStop, kLength, kContext, kCancelled, kTimeout };
// "stop", "length", "context", "cancelled", "timeout" ("" for kNone).
const char* finish_reason_name(FinishReason reason);

struct GenerationResult {
    std::vector<llama_token> tokens;
    std::string text;
    FinishReason finish_reason = FinishReason::kNone;
    // Greedy only: for each token, the target's top-1 minus top-2 logit where it was chosen.
    std::vector<float> margins;
    // Greedy, ended by an end-of-generation token: the same margin where it was chosen (NaN
    // otherwise), so that an output that stops where another goes on can be judged a near-tie.
    float stop_margin = std::numeric_limits<float>::quiet_NaN();
    std::vector<TokenLogprob> logprobs;  // per token, when the request asked for them
    // With logprobs asked for, ended by an end-of-generation token: that token's; by a stop
    // string: that of the first token whose text it cut whole (one entry; a scorer reading the
    // prompt's logprobs and the next token's wants it).
    std::vector<TokenLogprob> stop_logprob;
    // Per prompt token after the first, when the request asked for them (prompt_logprobs).
    std::vector<TokenLogprob> prompt_logprobs;
    Stats stats;
};

// A request between its caller's thread and the scheduler's. The scheduler appends committed
// text and finally sets the result (or the error); the caller hands the text to its callback
// on its own thread, so a slow callback never holds up the batch.
struct RequestChannel {
    // A request without a cancel flag gets one: a callback that throws stops it with it.
    RequestChannel(GenerateRequest r, Clock::time_point called_at, Deadline until, bool listening)
        : request(with_cancel_flag(std::move(r))),
          called(called_at),
          deadline(until),
          listens(listening) {}
    static GenerateRequest with_cancel_flag(GenerateRequest r) {
        if (!r.cancel) r.cancel = std::make_shared<CancelFlag>();
        return r;
    }
    bool cancel_requested() const { return request.cancel->is_set(); }
    bool past_deadline() const { return deadline && Clock::now() >= *deadline; }

    const GenerateRequest request;
    const Clock::time_point called;
    const Deadline deadline;
    // Its caller takes the text as it comes; else the text and logprobs go to the result alone,
    // and the caller is not woken for them (a wake-up takes a core from the decode's threads).
    const bool listens;
    // The request's grammar, compiled on the caller's thread; the generation takes it.
    std::unique_ptr<Constraint> constraint;

    std::mutex mutex;
    std::condition_variable changed;
    std::string text;  // committed, not yet handed to the caller
    // The logprobs of the tokens committed since text was last handed over (when asked for):
    // they go with the next text, so a token held back (a stop string's prefix) waits too.
    std::vector<TokenLogprob> logprobs;
    bool admitted = false;  // holds a slot (the caller can no longer withdraw it)
    bool done = false;
    GenerationResult result;
    std::exception_ptr error;
};

// What a generation uses of the engine: shared by every slot.
struct EngineParts {
    Model& target;
    Model* draft;           // null: no draft model
    ModelDrafter* drafter;  // null: no draft model
    NgramUse ngram;         // which requests draft from n-gram matches
    int ngram_min, ngram_max;
    SharedNgramIndex* index;      // earlier requests' outputs (null: each request's own text only)
    CopyPolicy* prediction_copy;  // how far predictions' copies are accepted, over all requests
    int default_n_draft;
    int max_draft;
    bool grammar_drafts;  // drafts know the grammar: its forced tokens, q masked by it
};

class Generation {
  public:
    // Requests shorter than this are not worth drafting for in adaptive mode.
    static constexpr int kMinTokensToSpeculate = 4;
    // Whether the request has something to draft with: the engine's draft model or n-gram
    // copies (`engine_drafts`), or its own prediction.
    static bool can_draft(const GenerateRequest& r, bool engine_drafts) {
        return engine_drafts || !r.prediction.empty();
    }
    // Whether `auto` chooses this request's K (it asks for it, something can draft, and it is
    // long enough to be worth it).
    static bool speculates_adaptively(const GenerateRequest& r, bool engine_drafts) {
        return r.adaptive && can_draft(r, engine_drafts) && r.max_tokens >= kMinTokensToSpeculate;
    }

    Generation(const EngineParts& parts, std::shared_ptr<RequestChannel> channel, llama_seq_id seq,
               const AdaptivePolicy& policy);

    llama_seq_id seq() const { return seq_id_; }
    // The engine's shared n-gram index this request reads and feeds (null: none).
    SharedNgramIndex* ngram_index() const { return parts_.index; }
    bool adaptive() const { return adaptive_; }
    bool greedy() const { return req_.sampling.greedy(); }
    const AdaptivePolicy& policy() const { return policy_; }
    bool finished() const { return result_.finish_reason != FinishReason::kNone; }

    // Admission: keeps what the target's cache already holds of the prompt (a chat's earlier
    // turns) and starts the clocks.
    void begin();
    // Whether the target's cache still lacks part of the prompt (all of it but the last token,
    // which the first step decodes).
    bool prefilling() const { return prefilled_ + 1 < req_.prompt.size(); }
    // The prompt's tokens not yet in the target's cache (the last is decoded with the first step).
    int prompt_left() const { return static_cast<int>(req_.prompt.size() - 1 - prefilled_); }
    // Rows of scored prompts (prompt_logprobs) one decode holds at most, all requests together:
    // each asks for logits, a vocabulary's floats (12 MB for 64 rows on a 49k vocabulary, 67 MB
    // on a 262k one), where a prompt's rows otherwise ask for none; llama.cpp keeps the
    // largest output buffer it was asked for.
    static constexpr int kScoredPromptRows = 64;
    bool scores_prompt() const { return req_.prompt_logprobs >= 0; }
    // Adds up to `budget` of the prompt's missing tokens to the target's batch (logits only
    // where the prompt is scored) and decodes as many into the draft's cache. Returns how many
    // it added.
    int add_prefill(Batch& batch, int budget);
    // After the decode holding the prefill rows: scores them where asked.
    void prefill_decoded(double seconds);
    // With the prompt's last chunk: appends its last token's row, with logits, so that the
    // first token comes from the same decode (accept() reads it, `with_prompt`).
    void add_first_row(Batch& batch);

    // Ends the request if it was cancelled, ran past its deadline or filled its context.
    void check_stop();
    // The K this step wants, at most `row_cap` - 1 (the batch's room for this sequence): fixed,
    // a copy's length, or the policy's choice.
    int choose_k(int row_cap);
    // This step decodes the target alone (and the tokens a grammar forces, at most `row_cap` - 1):
    // the engine measured `auto`'s steps committing tokens more slowly than target-only ones
    // (csrc/rate_check.h).
    void hold_target_only(int row_cap);
    // Tokens per second the cost model expects of a target-only step (0: not calibrated).
    double modelled_target_only_rate() const;
    // The expected tokens of a step drafting k = 0..cap tokens as this step would draft them
    // (a copy or the draft model), for batch planning.
    void expected_tokens(int cap, std::vector<double>& out) const;
    // Lowers this step's K (a batch planner's decision).
    // The most a batch plan may give this request this step: a copy keeps its own length, a
    // model draft anything up to the step's cap. Its own choice comes from one sequence's costs,
    // where its rows in a shared decode may cost nearly nothing (filling 13 rows up to 16).
    int plan_cap() const;
    void set_k(int k) { k_ = k; }
    int k() const { return k_; }
    // Starts this step's draft (the last one forgotten) from the tokens the grammar forces next,
    // when the request has a grammar and drafts at all; false when it forces none.
    bool draft_forced();
    // Starts this step's draft from a copy (of its own text, the shared index or its
    // prediction; after draft_forced found none); false when it found none (or k is 0).
    bool draft_by_copy();
    // How many tokens the draft model adds this step, after any forced ones: k, within the
    // step's room (the cap under `auto`, k with a fixed K) that the forced tokens left.
    int model_k() const;
    // This sequence's part in the batched model draft (model_k() > 0 and no copy drafted).
    ModelDrafter::Job model_job();
    // After drafting: the stats, and whether to stop trusting the draft.
    void drafted(double seconds);
    bool has_draft() const { return !draft_.tokens.empty(); }
    // This step's draft read the prompt first: its time is not a step's.
    bool draft_read_prompt() const { return draft_read_prompt_; }
    // Cuts the draft after the tokens the grammar allows (drafted() does, with a grammar).
    void keep_valid_draft();
    // The grammar moves past a committed token.
    void advance_constraint(llama_token token);
    // The token counts the penalties read move past a verdict.
    void count_verdict(llama_token token);
    // Adds n of this step's draft tokens, from the first, to `by` (per DraftSource): the
    // forced ones to the grammar, the rest to the draft's source.
    void count_by_source(int (&by)[kDraftSources], int n) const;
    // Appends [last, d1..dK] to the target's batch, logits on every row but those scoring a
    // certain forced token.
    void add_verify_rows(Batch& batch);
    // The leading drafted tokens the grammar allows alone (the forced ones it left no choice).
    size_t certain_drafted() const;
    // Reads this sequence's rows of the target decode: accepted prefix plus one token of the
    // target's, committed, the rest rolled back. `shared`: the decode held other sequences' rows
    // too, so its time is not this K's cost. `with_prompt`: the row rode in the prompt's last
    // chunk (add_first_row), a first token that is no step of K's.
    void accept(double t_verify, bool shared, bool with_prompt = false);
    // Tokens the last accept() committed (before any cut by a stop).
    int step_tokens() const { return static_cast<int>(step_tokens_.size()); }

    // Hands the result to the caller (or `error`, if set) and frees nothing else.
    void publish(std::exception_ptr error = nullptr);
    const std::vector<llama_token>& prompt() const { return req_.prompt; }
    const std::vector<llama_token>& output() const { return result_.tokens; }
    CancelFlag* cancel_flag() const { return req_.cancel.get(); }
    void note_recalibrated() { result_.stats.recalibrated = true; }
    bool ended_normally() const {
        return result_.finish_reason == FinishReason::kStop ||
               result_.finish_reason == FinishReason::kLength;
    }
    // Ends the request with `reason` unless it has ended already.
    void finish(FinishReason reason) {
        if (!finished()) result_.finish_reason = reason;
    }

  private:
    Stats& stats() { return result_.stats; }
    int draft_cap() const;
    // Sets cap_, the most this step may draft: draft_cap() within the batch's room for this
    // sequence.
    void size_room(int row_cap);
    bool choose_copy(int cap);
    // Drafts the copy choose_copy chose (under `auto`).
    void copy_chosen();
    // A fixed K's copy: the first source with a match.
    void copy_first_found();
    // The K that commits tokens fastest copying `m` under `copy` (0: target-only is faster), and
    // its expected rate.
    std::pair<int, double> best_copy(const CopyPolicy& copy, NgramMatch m, int cap);
    // The policy of this step's copy: the request's own, the shared index's or the prediction's.
    CopyPolicy& copy_policy() {
        return const_cast<CopyPolicy&>(std::as_const(*this).copy_policy());
    }
    const CopyPolicy& copy_policy() const {
        switch (copy_from_) {
            case DraftSource::kIndex:
                return parts_.index->copy_policy();
            case DraftSource::kPrediction:
                return *parts_.prediction_copy;
            default:
                return copy_;
        }
    }
    int model_cap(int cap) const;
    void drop_drafting(const std::string& why);
    void forget_draft();
    const float* target_logits(size_t row);
    void apply_penalties(float* logits);
    void apply_repeat_penalty(float* logits);
    bool penalized() const {
        return req_.presence_penalty != 0.0f || req_.frequency_penalty != 0.0f;
    }
    bool repeat_penalized() const { return req_.repeat_penalty != 1.0f && req_.repeat_last_n != 0; }
    const Distribution& target_distribution(size_t row);
    llama_token certain_verdict(size_t row, llama_token x);
    llama_token greedy_verdict(size_t row);
    llama_token sampled_verdict(size_t row, llama_token x);
    bool drafts_argmax() const;
    llama_token target_token(size_t row);
    void record_logprob(size_t row, llama_token verdict);
    void score_prompt_rows();
    int commit(size_t j);
    void emit(const std::string& text, bool last = false);
    void hand_over_text();

    EngineParts parts_;
    std::shared_ptr<RequestChannel> channel_;
    const GenerateRequest& req_;
    llama_seq_id seq_id_;
    AdaptivePolicy policy_;
    Rng rng_;
    TextStream text_;
    std::optional<NgramDrafter> ngram_;
    CopyPolicy copy_;
    std::optional<Prediction> prediction_;
    NgramMatch match_;  // this step's, when copying
    // What match_ indexes: kNgram seq_, kIndex the shared index, kPrediction the prediction.
    DraftSource copy_from_ = DraftSource::kNgram;
    bool copying_ = false;               // this step drafts the copy choose_copy chose
    std::vector<double> copy_expected_;  // a copy policy's expected tokens for K = 0..cap
    int n_draft_;
    bool adaptive_ = false;
    bool drafting_dropped_ = false;
    // A fixed K drafts from the first step, so the draft reads the prompt alongside the target.
    // `auto` may never draft (under load it starts held): its first draft catches up instead.
    bool draft_reads_prompt_ahead_ = false;
    bool draft_knows_prompt_ = false;  // the draft's cache holds the prompt
    bool draft_read_prompt_ = false;   // this step's draft caught up on the prompt
    Clock::time_point admitted_;
    std::vector<llama_token> seq_;            // prompt + committed tokens
    size_t prefilled_ = 0;                    // prompt tokens the target's cache holds
    size_t chunk_from_ = 0;                   // the last prefill chunk's first prompt position
    int chunk_first_row_ = 0;                 // and its first row in the target's batch
    int k_ = 0;                               // this step's K
    int cap_ = 0;                             // the most this step may draft
    bool falling_back_ = false;               // this step's policy chose target-only (and why)
    std::unique_ptr<Constraint> constraint_;  // null: no grammar
    // Penalties: how often each token has been generated (verdicts of this step included), and
    // which tokens have, so that applying them touches those alone.
    std::vector<int> token_counts_;
    std::vector<llama_token> counted_;
    // [token]: the last apply_repeat_penalty() call that penalised it (each token once a row).
    std::vector<uint32_t> repeat_stamp_;
    uint32_t repeat_call_ = 0;
    std::string fallback_why_;
    size_t base_ = 0;    // position of the first draft token
    int first_row_ = 0;  // this sequence's first row in the target's batch
    Draft draft_;
    double t_draft_step_ = 0.0;             // this step's drafting seconds
    std::vector<llama_token> step_tokens_;  // this step's verdicts: accepted drafts + one more
    std::vector<float> step_margins_;
    std::vector<TokenLogprob> step_logprobs_;  // when asked for: each verdict's
    // Committed tokens' logprobs, each with the offset of its token's first byte, until some of
    // its text goes out (text_ holds back a stop string's possible start): those of a stop
    // string's tokens never go out, as their text does not.
    std::deque<std::pair<size_t, TokenLogprob>> held_logprobs_;
    size_t bytes_in_ = 0;                 // bytes of the committed tokens, into text_
    std::vector<double> accept_chances_;  // sampling: each verdict's chance of acceptance
    // Sampling with a draft model: over the positions verified, the summed chances of
    // acceptance of a sampled draft (sum min(p, q)) and of q's argmax (p(argmax q)).
    double chance_sampled_ = 0.0;
    double chance_argmax_ = 0.0;
    Distribution p_;
    SamplingWorkspace workspace_;
    GenerationResult result_;
    bool text_waiting_ = false;  // emitted text the caller has not been woken for
};

}  // namespace specdec
