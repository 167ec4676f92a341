// How many tokens to draft each step: fixed, or chosen from this machine's measured costs.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace specdec {

// What one step did, for the policy to learn from.
struct StepOutcome {
    int k = 0;                // tokens drafted (0: target only)
    int n_accepted = 0;       // of those, accepted
    double t_draft = 0.0;     // seconds: all drafting, catching up included
    double t_verify = 0.0;    // seconds: the target's decode of k + 1 tokens
    int caught_up = 0;        // tokens the draft decoded to catch up before drafting
    double t_catch_up = 0.0;  // seconds that took
    // When sampling: for each position the step reached (min(k, n_accepted + 1) of them), the
    // chance it had of being accepted. Null: learn from the outcomes (greedy, where the chance is
    // the outcome).
    const std::vector<double>* accept_chance = nullptr;
    // The target's decode held other sequences' rows too: its time is not the cost of k + 1
    // rows, and the draft's decodes were shared likewise, so only the acceptance is learnt.
    bool shared = false;
    double t_decode = 0.0;  // seconds: the target's decode alone (t_verify less acceptance)
    int context = 0;        // tokens the sequence held before the step
};

// What one step of a batch of sequences costs on this machine: the target's decode of all their
// rows, and one draft decode per draft position holding a row of each sequence still drafting.
// Measured at a few batch sizes; between them, linear.
class BatchCosts {
  public:
    // (rows, seconds) pairs, rows increasing from 1.
    BatchCosts(std::vector<std::pair<int, double>> verify,
               std::vector<std::pair<int, double>> draft);
    BatchCosts() = default;
    bool empty() const { return verify_.empty(); }
    double verify(int rows) const { return at(verify_, rows); }
    double draft(int rows) const { return at(draft_, rows); }
    // Seconds for a step where sequence i drafts k[i] tokens, plus `other_rows` rows (prompt
    // chunks, fixed-K sequences' drafts) in the target's decode.
    double step(const std::vector<int>& k, int other_rows) const;
    const std::vector<std::pair<int, double>>& verify_points() const { return verify_; }
    const std::vector<std::pair<int, double>>& draft_points() const { return draft_; }
    // A target decode of `rows` rows took `seconds`: that size's cost moves to what decodes of
    // it take, and a size never measured gets its own point. Calibration measures only some
    // sizes, and the ones between are not in proportion (on this CPU 13 to 15 rows cost more
    // than 16): a size the plan picks because its interpolated cost looked cheap is corrected
    // by the first decodes of it.
    void observe_verify(int rows, double seconds);

  private:
    static double at(const std::vector<std::pair<int, double>>& points, int rows);
    std::vector<std::pair<int, double>> verify_, draft_;
    std::vector<int> verify_seen_;  // decodes behind each verify point (calibration's: 1)
};

// K for each sequence of a batch, k[i] <= caps[i], maximising the batch's expected committed
// tokens per second, sum_i expected[i][k[i]] / costs.step(k, other_rows): where a larger batch
// makes the target's decode dearer per row, K comes down, to 0 for all when speculating no
// longer pays. expected[i][k] (k = 0..caps[i]) is sequence i's expected tokens from a step
// drafting k.
// Writes the K's into `k`; `trial` is the caller's scratch (kept between steps, so that a step
// allocates nothing).
void plan_batch(const std::vector<std::vector<double>>& expected, const std::vector<int>& caps,
                int other_rows, const BatchCosts& costs, std::vector<int>& k,
                std::vector<int>& trial);

// Picks K to maximise expected committed tokens per second,
//     E[tokens](K) / (t_draft(K) + t_verify(K + 1)),
// from decaying averages of the acceptance at each draft position and of the costs, where
// t_verify(n) is this machine's measured cost of a target decode of n tokens (not assumed flat:
// on CPUs it rises with n, and unevenly). K = 0 (target only) competes like any other K.
//
// Drafting K tokens costs the draft K decodes: first the token(s) the last step committed, then
// K - 1 of its own. The first is a two-token decode when the last draft was accepted whole (its
// last token and the bonus) and a one-token decode otherwise, so
//     t_draft(K) = K * d1 + P(all K accepted) * (d2 - d1)
// with d1 and d2 the costs of a one- and a two-token draft decode. (A single cost per draft
// token, K * d, tracked from whole steps, reads high at K = 1 and low at large K.)
//
// When sampling, each position's evidence is its chance of acceptance rather than the one
// accept/reject draw: at T = 0.8 a draw is nearly a coin flip, and the estimates, and so K, would
// follow its noise.
//
// Acceptance evidence fades (down to a floor) with every drafting step that reaches its
// position, and all of it with every step without a draft: while the policy falls back to the
// target alone, what it learnt grows stale, so the next probe speaks with a louder voice.
class AdaptivePolicy {
  public:
    struct Config {
        int max_k = 10;
        double decay = 0.9;        // weight of the past in the acceptance averages
        double hysteresis = 0.03;  // switch K only for a predicted gain above this
        // While falling back, draft once after this many steps, then after twice as many, and so
        // on: up to `close_call_probe_interval` steps while speculating is nearly as fast as
        // not, up to `max_probe_interval` while it is clearly slower.
        int probe_interval = 4;
        int close_call_probe_interval = 16;
        int max_probe_interval = 256;
    };
    AdaptivePolicy();
    explicit AdaptivePolicy(Config config);

    // t_verify[n-1] for n = 1..m (2 <= m <= max_k + 1), and the costs of a one- and a two-token
    // draft decode, from a calibration. Throws std::invalid_argument for costs that are not
    // finite, verify costs that are not positive and draft costs that are negative.
    void calibrate(std::vector<double> verify_costs, std::vector<double> draft_costs,
                   double seconds_taken);
    double calibration_seconds() const { return calibration_seconds_; }
    // Whether this request's steps found the calibrated verify costs wrong by more than a busy
    // machine's noise (a calibration taken while something else ran, and then stored and
    // reused, is off for good until measured again), right, or were too few to judge.
    enum class CostVerdict { kUnjudged, kAgree, kDisagree };
    CostVerdict cost_verdict() const;
    bool calibrated() const { return !verify_cost_.empty(); }

    // A new request is new text: whatever the last one taught, look at this one soon (unless
    // drafting lost time in the last requests: see end_generation).
    void begin_generation();
    // A request ended: its drafting's account decides how the next ones open. `counts`: it
    // ended normally (one cut short had no time to pay for its draft's prompt read).
    void end_generation(bool counts);
    // K for the next step, at most `cap`; 0 means target only. `why` explains a fallback.
    int choose(int cap, std::string* why);
    // Learns from what a step did. A catch-up of more than two tokens (after steps without
    // drafting) is not a cost drafting has, and is left out of the cost estimates.
    void observe(const StepOutcome& step);
    // Learns the target's cost from a step whose draft this policy did not choose (an n-gram
    // copy): its verify cost, and whether the calibration looks wrong. No acceptance.
    void observe_verify_cost(const StepOutcome& step);

    // Whether any K could beat target-only even if every draft token were accepted. When not
    // (a draft nearly as slow as the target), the policy stops drafting for good: keeping the
    // draft's cache in step for occasional probes would itself cost more than it could gain.
    // Decided on the calibration, where every cost was measured together: afterwards only the
    // costs of the steps taken are re-measured, and while not drafting that is target-only's
    // alone, so a slow spell would make drafting look cheaper than it is (on the cannot-pay
    // pair in benchmarks.md it drafted, and ran at 0.90x of target-only at T = 0.8).
    bool can_ever_pay() const { return ever_pays_; }

    // Expected tokens per second for K = 0..cap (cap < the number of verify costs).
    std::vector<double> expected_rates(int cap) const;
    // Expected committed tokens of a step drafting K = 0..cap tokens, into `out`.
    void expected_tokens(int cap, std::vector<double>& out) const;
    std::vector<double> acceptance() const;  // per draft position, as the policy estimates it
    // The running cost estimates: calibrated, then updated by each step that used them.
    const std::vector<double>& verify_costs() const { return verify_cost_; }
    // Seconds for a target decode of `rows` tokens: the running estimate, and past the measured
    // curve its upper half's cost per row. Calibrated policies only.
    double verify_cost(int rows) const;
    const std::vector<double>& draft_costs() const { return draft_cost_; }
    int max_k() const { return config_.max_k; }

  private:
    Config config_;
    // Position i+1's estimate: its own record, leaning on `lean` as much as kPoolWeight tries.
    double acceptance_at(int i, double lean) const;
    double pooled_acceptance() const;
    // Seconds for a step that drafts k tokens and verifies k + 1, where all k are accepted with
    // probability `all_accepted`.
    double step_cost(int k, double all_accepted) const;
    // Scales position i's evidence down to `weight` tries, keeping its acceptance estimate.
    void fade_to(size_t i, double weight);
    // Position i+1 was tried `tried` times (a fraction: a chance of being reached) and accepted
    // `accepted` of them; older evidence there fades as much.
    void learn_at(size_t i, double tried, double accepted);
    int probe_k(int cap) const;
    // Whether any K beats target-only with every draft token accepted, at the current costs.
    bool pays_at_best() const;
    // What a step's first m draft positions yielded: the tokens accepted there and whether all m
    // were (1 or 0); when sampling, what it could expect at that spot of the text instead.
    struct Yield {
        double accepted;
        double all_accepted;
    };
    static Yield yield_of(const StepOutcome& step, int m);
    // Whether a draft of k tokens with this yield commits tokens faster than target-only.
    bool probe_paid(int k, Yield yield) const;
    // After a step: whether it was a probe that calls for another, and of which K.
    void decide_on_probe(const StepOutcome& step);

    // For position i+1: decayed counts of tries and of acceptances (each given that the
    // positions before it were accepted); their ratio is the acceptance estimate.
    std::vector<double> tries_;
    std::vector<double> accepts_;
    std::vector<int> tried_;           // [i]: how often position i+1 was ever tried
    std::vector<double> verify_cost_;  // [n-1]: seconds for a target decode of n tokens
    std::vector<double> draft_cost_;   // [n-1]: seconds for a draft decode of n = 1, 2 tokens
    double calibration_seconds_ = 0.0;
    bool ever_pays_ = false;                 // pays_at_best() at the calibration
    std::vector<double> calibrated_verify_;  // verify_cost_ as calibrated
    // This request's steps (with the decode to themselves): measured / calibrated verify cost.
    std::vector<double> cost_ratios_;
    int current_k_ = -1;
    int steps_since_probe_ = 0;
    int probe_interval_ = 0;
    // Where the policy stands between choose() and observe(): each probe is one step.
    enum class Phase {
        kSteady,   // no probe under way: drafting, or falling back and counting steps
        kProbing,  // a probe: being taken, or taken and calling for no other
        // The last probe paid, or its accepted prefix would have as a shorter draft: probe once
        // more, of probe_again_k_ tokens (0: the K the estimates favour).
        kProbeAgain,
    };
    Phase phase_ = Phase::kSteady;
    int probe_again_k_ = 0;
    // A probe has paid since the last run of probes that found nothing; kept while drafting
    // and across requests: a text with easier stretches is looked at again soon.
    bool probes_paid_ = false;

    // Seconds this request's drafting steps saved against the target alone (the tokens they
    // committed at target-only's step cost, less what they took, the draft's catch-up
    // included); negative where drafting lost time. Steps shared with other sequences are left
    // out: their times are the batch's.
    double request_gain_ = 0.0;
    bool request_drafted_ = false;
    // Requests in a row whose drafting lost time, and how many more are to open without a probe.
    int losing_requests_ = 0;
    int openings_to_skip_ = 0;
};

}  // namespace specdec
