// How many tokens to draft each step: fixed, or chosen from this machine's measured costs.
#pragma once

#include <string>
#include <vector>

namespace specdec {

// Picks K to maximise expected committed tokens per second,
//     E[tokens](K) / (K * t_draft + t_verify(K + 1)),
// from decaying averages of the acceptance at each draft position and of the costs, where
// t_verify(n) is this machine's measured cost of a target decode of n tokens (not assumed flat:
// on CPUs it rises with n, and unevenly). K = 0 (target only) competes like any other K.
//
// Acceptance evidence fades with every step, drafted or not (down to a floor): while the
// policy falls back to the target alone, what it learnt grows stale, so the next probe speaks
// with a louder voice.
class AdaptivePolicy {
  public:
    struct Config {
        int max_k = 10;
        double decay = 0.9;            // weight of the past in the acceptance averages
        double hysteresis = 0.03;      // switch K only for a predicted gain above this
        int probe_interval = 16;       // while falling back, draft once every this many steps...
        int max_probe_interval = 256;  // ...doubling after each probe that does not pay
    };

    AdaptivePolicy();
    explicit AdaptivePolicy(Config config);

    // t_verify[n-1] for n = 1..m (2 <= m <= max_k + 1), and the draft's cost per token, from a
    // calibration. Throws std::invalid_argument for costs that are not finite and positive.
    void calibrate(std::vector<double> verify_costs, double draft_cost, double seconds_taken);
    double calibration_seconds() const { return calibration_seconds_; }
    bool calibrated() const { return !verify_cost_.empty(); }

    // A new request is new text: whatever the last one taught, look at this one soon.
    void begin_generation();
    // K for the next step, at most `cap`; 0 means target only. `why` explains a fallback.
    int choose(int cap, std::string* why);
    // What a step did: K drafted, n accepted, and what drafting and verifying cost.
    // `t_draft` is left out of the draft's cost estimate when `draft_cost_is_typical` is false
    // (the draft first caught up on many tokens, e.g. after a fallback).
    void observe(int k, int n_accepted, double t_draft, double t_verify,
                 bool draft_cost_is_typical = true);

    // Whether any K could beat target-only even if every draft token were accepted. When not
    // (a draft nearly as slow as the target), the policy stops drafting for good: keeping the
    // draft's cache in step for occasional probes would itself cost more than it could gain.
    bool can_ever_pay() const;

    // Expected tokens per second for K = 0..cap (cap < the number of verify costs).
    std::vector<double> expected_rates(int cap) const;
    std::vector<double> acceptance() const;  // per draft position, as the policy estimates it
    // The running cost estimates: calibrated, then updated by each step that used them.
    const std::vector<double>& verify_costs() const { return verify_cost_; }
    double draft_cost() const { return draft_cost_; }
    int max_k() const { return config_.max_k; }

  private:
    Config config_;
    double acceptance_at(int i, double pooled) const;
    double pooled_acceptance() const;
    double step_cost(int k) const;  // seconds: drafting k tokens and verifying k + 1
    // Scales position i's evidence down to `weight` tries, keeping its acceptance estimate.
    void fade_to(size_t i, double weight);
    int probe_k(int cap) const;

    // For position i+1: decayed counts of tries and of acceptances (each given that the
    // positions before it were accepted); their ratio is the acceptance estimate.
    std::vector<double> tries_;
    std::vector<double> accepts_;
    std::vector<int> tried_;           // [i]: how often position i+1 was ever tried
    std::vector<double> verify_cost_;  // [n-1]: seconds for a target decode of n tokens
    double draft_cost_ = 0.0;          // seconds per drafted token
    double calibration_seconds_ = 0.0;
    int current_k_ = -1;
    int steps_since_probe_ = 0;
    int probe_interval_ = 0;
    bool probing_ = false;
};

}  // namespace specdec
