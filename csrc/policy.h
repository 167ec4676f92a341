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
class AdaptivePolicy {
  public:
    struct Config {
        int max_k = 10;
        double decay = 0.9;            // weight of the past in every average
        double hysteresis = 0.03;      // switch K only for a predicted gain above this
        int probe_interval = 16;       // while falling back, draft once every this many steps...
        int max_probe_interval = 256;  // ...doubling after each probe that does not pay
    };

    AdaptivePolicy();
    explicit AdaptivePolicy(Config config);

    // t_verify[n-1] for n = 1..max_k+1, and the draft's cost per token, from a calibration.
    void calibrate(std::vector<double> verify_costs, double draft_cost, double seconds_taken);
    double calibration_seconds() const { return calibration_seconds_; }
    bool calibrated() const { return !verify_cost_.empty(); }

    // K for the next step, at most `cap`; 0 means target only. `why` explains a fallback.
    int choose(int cap, std::string* why);
    // What a step did: K drafted, n accepted, and what drafting and verifying cost.
    void observe(int k, int n_accepted, double t_draft, double t_verify);

    // Whether any K could beat target-only even if every draft token were accepted. When not
    // (a draft nearly as slow as the target), the policy stops drafting for good: keeping the
    // draft's cache in step for occasional probes would itself cost more than it could gain.
    bool can_ever_pay() const;

    double expected_tokens(int k) const;
    double expected_rate(int k) const;  // tokens per second
    const std::vector<double>& acceptance() const { return accept_; }

  private:
    Config config_;
    double acceptance_at(int i) const;

    std::vector<double> accept_;       // [i]: P(position i+1 accepted | positions before were)
    std::vector<int> tried_;           // [i]: how often position i+1 was tried
    std::vector<double> verify_cost_;  // [n-1]: seconds for a target decode of n tokens
    double draft_cost_ = 0.0;          // seconds per drafted token
    double calibration_seconds_ = 0.0;
    int current_k_ = -1;
    int steps_since_probe_ = 0;
    int probe_interval_ = 0;
    bool probing_ = false;
};

}  // namespace specdec
