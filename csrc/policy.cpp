#include "policy.h"

#include <algorithm>
#include <utility>

namespace specdec {

namespace {
// Before any observation, assume the draft is right this often: optimistic enough to try
// speculating, and corrected by the first few steps.
constexpr double kPriorAcceptance = 0.7;
}  // namespace

AdaptivePolicy::AdaptivePolicy() : AdaptivePolicy(Config{}) {}

AdaptivePolicy::AdaptivePolicy(Config config)
    : config_(config),
      accept_(static_cast<size_t>(config.max_k), kPriorAcceptance),
      tried_(static_cast<size_t>(config.max_k), 0),
      probe_interval_(config.probe_interval) {}

double AdaptivePolicy::acceptance_at(int i) const {
    // A position never tried is assumed no better than the last one that was.
    while (i > 0 && tried_[static_cast<size_t>(i)] == 0) --i;
    return accept_[static_cast<size_t>(i)];
}

void AdaptivePolicy::calibrate(std::vector<double> verify_costs, double draft_cost,
                               double seconds_taken) {
    verify_cost_ = std::move(verify_costs);
    draft_cost_ = draft_cost;
    calibration_seconds_ = seconds_taken;
}

double AdaptivePolicy::expected_tokens(int k) const {
    // One target token always, plus draft position j when positions 1..j are all accepted.
    double total = 1.0;
    double all_accepted = 1.0;
    for (int i = 0; i < k; ++i) {
        all_accepted *= acceptance_at(i);
        total += all_accepted;
    }
    return total;
}

bool AdaptivePolicy::can_ever_pay() const {
    const double target_only = 1.0 / verify_cost_[0];
    for (size_t k = 1; k < verify_cost_.size(); ++k) {
        const double best_case = static_cast<double>(k + 1) / (k * draft_cost_ + verify_cost_[k]);
        if (best_case > target_only * (1.0 + config_.hysteresis)) return true;
    }
    return false;
}

double AdaptivePolicy::expected_rate(int k) const {
    const double step = k * draft_cost_ + verify_cost_[static_cast<size_t>(k)];
    return step > 0.0 ? expected_tokens(k) / step : 0.0;
}

int AdaptivePolicy::choose(int cap, std::string* why) {
    cap = std::min({cap, config_.max_k, static_cast<int>(verify_cost_.size()) - 1});
    if (cap <= 0) return 0;
    if (!can_ever_pay()) {
        if (why) *why = "draft too slow for this target";
        return 0;
    }
    int best = 0;
    for (int k = 1; k <= cap; ++k)
        if (expected_rate(k) > expected_rate(best)) best = k;
    // Hysteresis: keep the current K unless the best is clearly better.
    if (current_k_ >= 0 && current_k_ <= cap &&
        expected_rate(best) < expected_rate(current_k_) * (1.0 + config_.hysteresis))
        best = current_k_;
    current_k_ = best;
    if (best > 0) {
        steps_since_probe_ = 0;
        probe_interval_ = config_.probe_interval;
        probing_ = false;
        return best;
    }
    // Speculation does not pay at the current acceptance; probe now and then, since the text
    // (and so the acceptance) changes, but less often each time a probe does not pay.
    if (probing_) probe_interval_ = std::min(probe_interval_ * 2, config_.max_probe_interval);
    probing_ = false;
    if (++steps_since_probe_ >= probe_interval_) {
        steps_since_probe_ = 0;
        probing_ = true;
        return 1;
    }
    if (why) *why = "low acceptance";
    return 0;
}

void AdaptivePolicy::observe(int k, int n_accepted, double t_draft, double t_verify) {
    const double d = config_.decay;
    // Position i was tried only if every position before it was accepted.
    for (int i = 0; i < std::min(k, n_accepted + 1); ++i) {
        double& a = accept_[static_cast<size_t>(i)];
        ++tried_[static_cast<size_t>(i)];
        a = d * a + (1.0 - d) * (i < n_accepted ? 1.0 : 0.0);
    }
    if (k > 0) draft_cost_ = d * draft_cost_ + (1.0 - d) * (t_draft / k);
    if (static_cast<size_t>(k) < verify_cost_.size()) {
        double& t = verify_cost_[static_cast<size_t>(k)];
        t = d * t + (1.0 - d) * t_verify;
    }
}

}  // namespace specdec
