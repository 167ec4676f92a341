#include "policy.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace specdec {

namespace {
// Before any observation, assume the draft is right this often: optimistic enough to try
// speculating, and corrected by the first few steps.
constexpr double kPriorAcceptance = 0.7;
// The prior counts as this many tries: enough that one unlucky first step does not talk the
// policy out of a K it has barely tried (positions it stops trying are not re-tested).
constexpr double kPriorWeight = 5.0;
// Old evidence fades, but never below this many tries' worth: one new observation (after a
// long fallback, say) moves an estimate a third of the way, not all of it.
constexpr double kEvidenceFloor = 2.0;
// How many tries' worth each position's estimate borrows from all positions pooled.
constexpr double kPoolWeight = 4.0;
// Costs move slowly (context length) but single decodes jitter (a shared machine): a slower
// average than acceptance's, and no single sample beyond these multiples of the estimate.
constexpr double kCostDecay = 0.97;
constexpr double kCostSampleMin = 0.5, kCostSampleMax = 1.5;

void track_cost(double& estimate, double sample) {
    if (estimate <= 0.0) {
        estimate = sample;
        return;
    }
    sample = std::clamp(sample, kCostSampleMin * estimate, kCostSampleMax * estimate);
    estimate = kCostDecay * estimate + (1.0 - kCostDecay) * sample;
}

// A request judges the calibration on its first kHealSteps..kHealStepsMax steps: when their
// median verify cost is off from the calibrated one by more than kHealFactor either way (this
// 2-core machine's noise between runs is 4-15 %), the costs are measured again. The window is
// wide so that a short slow spell (another process, or another decoder's idle threads still
// spinning as a request opens) does not set off a measurement taking far longer than the spell.
constexpr size_t kHealSteps = 12;
constexpr size_t kHealStepsMax = 48;
constexpr double kHealFactor = 1.5;
constexpr int kHealContext = 512;

// Probing backs off only while the best K is expected to be this much slower than target-only.
constexpr double kClearlyWorse = 0.1;
// After n requests in a row whose drafting lost time, the next 2^(n-1) - 1 open without a probe
// (n at most this): a request's opening probe makes the draft read its whole prompt. One losing
// request alone does not start it: where a draft pays, a request now and then still loses
// (docs/adaptive.md).
constexpr int kMaxOpeningBackOff = 4;

// Expected tokens of a K-token draft whose positions are each accepted with probability
// accept(i) given the ones before: one target token always, plus position j when 1..j pass.
template <typename Accept>
double expected_tokens_with(int k, Accept accept) {
    double total = 1.0;
    double all_accepted = 1.0;
    for (int i = 0; i < k; ++i) {
        all_accepted *= accept(i);
        total += all_accepted;
    }
    return total;
}
}  // namespace

AdaptivePolicy::AdaptivePolicy() : AdaptivePolicy(Config{}) {}

AdaptivePolicy::AdaptivePolicy(Config config)
    : config_(config),
      tries_(static_cast<size_t>(config.max_k), kPriorWeight),
      accepts_(static_cast<size_t>(config.max_k), kPriorWeight * kPriorAcceptance),
      tried_(static_cast<size_t>(config.max_k), 0),
      probe_interval_(config.probe_interval) {
    if (config.max_k < 1) throw std::invalid_argument("max_k must be >= 1");
}

double AdaptivePolicy::pooled_acceptance() const {
    double accepts = 0.0, tries = 0.0;
    for (size_t i = 0; i < tries_.size(); ++i) {
        if (tried_[i] == 0) continue;
        accepts += accepts_[i];
        tries += tries_[i];
    }
    return tries > 0.0 ? accepts / tries : kPriorAcceptance;
}

double AdaptivePolicy::acceptance_at(int i, double lean) const {
    // A position never tried is assumed no better than the last one that was.
    while (i > 0 && tried_[static_cast<size_t>(i)] == 0) --i;
    const auto at = static_cast<size_t>(i);
    return (accepts_[at] + kPoolWeight * lean) / (tries_[at] + kPoolWeight);
}

std::vector<double> AdaptivePolicy::acceptance() const {
    // Each position's own record, leaning on all positions' together while its own is thin:
    // later positions are tried less often, and a few unlucky tries there would otherwise
    // decide K. A deeper position leans on no more than the estimate of the one before it:
    // the pool is mostly position 1's record, and where the draft is right at position 1 and
    // wrong after (a two-word loop, docs/adaptive.md) it would make the positions after look
    // as good, and K swing between 1 and 3.
    std::vector<double> out;
    const double pooled = pooled_acceptance();
    for (int i = 0; i < config_.max_k; ++i) {
        const double lean = i == 0 ? pooled : std::min(pooled, out.back());
        out.push_back(acceptance_at(i, lean));
    }
    return out;
}

void AdaptivePolicy::begin_generation() {
    cost_ratios_.clear();
    cost_ratios_.reserve(kHealStepsMax);  // before the steps: they allocate nothing
    // What the last request taught keeps its direction but counts as little as evidence can:
    // this text's own first steps decide.
    for (size_t i = 0; i < tries_.size(); ++i) fade_to(i, kEvidenceFloor);
    // If this text starts in fallback, probe it now (unless drafting kept losing time in the
    // last requests: end_generation), and then not again soon: that fallback comes from a whole
    // request's evidence, not from a few unlucky steps. A wait that has grown longer than that
    // (probes failing request after request) is kept: each probe after a long fallback makes
    // the draft catch up on every token it skipped, whether the probe pays or not.
    probe_interval_ = std::max(probe_interval_, config_.close_call_probe_interval);
    const bool open_with_probe = openings_to_skip_ == 0;
    if (!open_with_probe) --openings_to_skip_;
    steps_since_probe_ = open_with_probe ? probe_interval_ - 1 : 0;
    phase_ = Phase::kSteady;
}

void AdaptivePolicy::end_generation(bool counts) {
    // An opening probe costs its draft a read of the whole prompt, and on a short request that
    // read alone can outweigh what a probe would find. Requests whose drafting lost time, one
    // after another, say the probes find nothing on this kind of text: the next ones open
    // without (their own later probes still come, at the kept interval). Any request whose
    // drafting saved time resets the back-off.
    if (counts && request_drafted_) {
        if (request_gain_ < 0.0) {
            losing_requests_ = std::min(losing_requests_ + 1, kMaxOpeningBackOff);
            openings_to_skip_ = (1 << (losing_requests_ - 1)) - 1;
        } else {
            losing_requests_ = 0;
            openings_to_skip_ = 0;
        }
    }
    request_gain_ = 0.0;
    request_drafted_ = false;
}

void AdaptivePolicy::calibrate(std::vector<double> verify_costs, std::vector<double> draft_costs,
                               double seconds_taken) {
    const auto size = static_cast<int>(verify_costs.size());
    if (size < 2 || size > config_.max_k + 1)
        throw std::invalid_argument("need verify costs for n = 1..m with 2 <= m <= " +
                                    std::to_string(config_.max_k + 1));
    for (double t : verify_costs)
        if (!std::isfinite(t) || t <= 0.0)
            throw std::invalid_argument("verify costs must be finite and > 0");
    if (draft_costs.size() != 2)
        throw std::invalid_argument("need the draft's costs for a decode of 1 and of 2 tokens");
    for (double t : draft_costs)
        if (!std::isfinite(t) || t < 0.0)
            throw std::invalid_argument("draft costs must be finite and >= 0");
    verify_cost_ = std::move(verify_costs);
    calibrated_verify_ = verify_cost_;
    cost_ratios_.clear();
    draft_cost_ = std::move(draft_costs);
    calibration_seconds_ = seconds_taken;
    ever_pays_ = pays_at_best();
}

void AdaptivePolicy::fade_to(size_t i, double weight) {
    if (tries_[i] <= weight) return;
    accepts_[i] *= weight / tries_[i];
    tries_[i] = weight;
}

void AdaptivePolicy::learn_at(size_t i, double tried, double accepted) {
    fade_to(i, std::max(kEvidenceFloor, std::pow(config_.decay, tried) * tries_[i]));
    if (tried > 0.0) ++tried_[i];
    tries_[i] += tried;
    accepts_[i] += accepted;
}

double AdaptivePolicy::step_cost(int k, double all_accepted) const {
    const double verify = verify_cost_[static_cast<size_t>(k)];
    if (k == 0) return verify;
    const double d1 = draft_cost_[0], d2 = draft_cost_[1];
    return k * d1 + all_accepted * (d2 - d1) + verify;
}

bool AdaptivePolicy::probe_paid(int k, Yield yield) const {
    // Costs as modelled rather than as measured: a probe's draft first catches up on every
    // token committed while falling back, a cost of having fallen back, not of drafting.
    return (yield.accepted + 1.0) / step_cost(k, yield.all_accepted) > 1.0 / verify_cost_[0];
}

int AdaptivePolicy::probe_k(int cap) const {
    // The K that would pay best at the prior's acceptance: a probe that long tests as many
    // positions as speculating would use.
    int best = 1;
    double best_rate = 0.0;
    for (int k = 1; k <= cap; ++k) {
        const double rate = expected_tokens_with(k, [](int) { return kPriorAcceptance; }) /
                            step_cost(k, std::pow(kPriorAcceptance, k));
        if (rate > best_rate) {
            best = k;
            best_rate = rate;
        }
    }
    return best;
}

bool AdaptivePolicy::pays_at_best() const {
    const double target_only = 1.0 / verify_cost_[0];
    for (int k = 1; k < static_cast<int>(verify_cost_.size()); ++k) {
        const double best_case = (k + 1) / step_cost(k, 1.0);
        if (best_case > target_only * (1.0 + config_.hysteresis)) return true;
    }
    return false;
}

std::vector<double> AdaptivePolicy::expected_rates(int cap) const {
    // One pass: the pooled estimate once, E[tokens] built up position by position.
    const std::vector<double> a = acceptance();
    std::vector<double> rates;
    double tokens = 1.0, all_accepted = 1.0;
    for (int k = 0; k <= cap; ++k) {
        if (k > 0) {
            all_accepted *= a[static_cast<size_t>(k - 1)];
            tokens += all_accepted;
        }
        const double step = step_cost(k, all_accepted);
        rates.push_back(step > 0.0 ? tokens / step : 0.0);
    }
    return rates;
}

AdaptivePolicy::CostVerdict AdaptivePolicy::cost_verdict() const {
    if (cost_ratios_.size() < kHealSteps) return CostVerdict::kUnjudged;
    std::vector<double> ratios = cost_ratios_;
    std::nth_element(ratios.begin(), ratios.begin() + static_cast<long>(ratios.size() / 2),
                     ratios.end());
    const double typical = ratios[ratios.size() / 2];
    const bool off = typical > kHealFactor || typical < 1.0 / kHealFactor;
    return off ? CostVerdict::kDisagree : CostVerdict::kAgree;
}

void AdaptivePolicy::expected_tokens(int cap, std::vector<double>& out) const {
    const std::vector<double> a = acceptance();
    out.assign(1, 1.0);
    double all_accepted = 1.0;
    for (int k = 1; k <= cap && k <= static_cast<int>(a.size()); ++k) {
        all_accepted *= a[static_cast<size_t>(k - 1)];
        out.push_back(out.back() + all_accepted);
    }
}

int AdaptivePolicy::choose(int cap, std::string* why) {
    cap = std::min({cap, config_.max_k, static_cast<int>(verify_cost_.size()) - 1});
    if (cap <= 0) return 0;
    if (!can_ever_pay()) {
        if (why) *why = "draft too slow for this target";
        return 0;
    }
    const std::vector<double> rate = expected_rates(cap);
    int best = 0;
    int best_drafting = 1;
    for (int k = 1; k <= cap; ++k) {
        if (rate[k] > rate[best]) best = k;
        if (rate[k] > rate[best_drafting]) best_drafting = k;
    }
    // Hysteresis: keep the current K unless the best is clearly better.
    if (current_k_ >= 0 && current_k_ <= cap &&
        rate[best] < rate[current_k_] * (1.0 + config_.hysteresis))
        best = current_k_;
    current_k_ = best;
    if (best > 0) {
        steps_since_probe_ = 0;
        probe_interval_ = config_.probe_interval;
        phase_ = Phase::kSteady;
        return best;
    }
    // Speculation does not pay at the current acceptance; probe now and then, since the text
    // (and so the acceptance) changes: soon after falling back (a few unlucky steps are a common
    // reason to), then less often after each probe that finds nothing. Where it is a close call
    // a probe costs little, so probing never becomes rare there.
    // Whether a probe calls for another at once is decided when it is observed
    // (decide_on_probe). When a run of probes ends, the next waits probe_interval steps if a probe
    // has paid since the last run that found nothing (the text has easier stretches: on the code
    // prompt of the layer-skip pair, doubling after `33 30` left it at target-only for 30 steps
    // where K = 3 gives 1.3x), and twice as long as the last wait otherwise.
    if (phase_ == Phase::kProbing) {
        const bool clearly_worse = rate[best_drafting] < rate[0] * (1.0 - kClearlyWorse);
        const int limit = clearly_worse
                              ? config_.max_probe_interval
                              : std::max(config_.close_call_probe_interval, probe_interval_);
        probe_interval_ =
            probes_paid_ ? config_.probe_interval : std::min(probe_interval_ * 2, limit);
        probes_paid_ = false;
    }
    if (phase_ == Phase::kProbeAgain) {
        steps_since_probe_ = 0;
        phase_ = Phase::kProbing;
        return probe_again_k_ > 0 ? std::min(probe_again_k_, cap) : best_drafting;
    }
    phase_ = Phase::kSteady;
    if (++steps_since_probe_ >= probe_interval_) {
        steps_since_probe_ = 0;
        phase_ = Phase::kProbing;
        return probe_k(cap);
    }
    if (why) *why = "low acceptance on earlier text";  // the running estimate, not this step's
    return 0;
}

AdaptivePolicy::Yield AdaptivePolicy::yield_of(const StepOutcome& step, int m) {
    if (!step.accept_chance) {
        const int accepted = std::min(step.n_accepted, m);
        return {static_cast<double>(accepted), accepted == m ? 1.0 : 0.0};
    }
    // When sampling, a probe is judged by what it could expect at this spot of the text, not by
    // its one draw: where each position is accepted with chance 0.6 (T = 0.8 on the layer-skip
    // pair, where drafting loses), a K = 3 probe still accepts two or more tokens one time in
    // three, and each such probe would keep the probes coming. Positions past the first
    // rejection have no chance measured; they count as no tokens.
    const auto& chance = *step.accept_chance;
    double all_accepted = 1.0, accepted = 0.0;
    for (size_t i = 0; i < std::min(chance.size(), static_cast<size_t>(m)); ++i) {
        all_accepted *= chance[i];
        accepted += all_accepted;
    }
    return {accepted, all_accepted};
}

void AdaptivePolicy::decide_on_probe(const StepOutcome& step) {
    probe_again_k_ = 0;
    const int k = step.k, n_accepted = step.n_accepted;
    // A probe's step has been taken: the run of probes ends here unless it calls for another.
    if (phase_ == Phase::kProbeAgain) phase_ = Phase::kProbing;
    if (phase_ != Phase::kProbing || k == 0) return;
    // A probe that paid (committed tokens faster than the target alone would have) is followed
    // by another, of the K the estimates now favour: the text may have turned easier, and one
    // probe's evidence is too little to bring drafting back on its own.
    if (probe_paid(k, yield_of(step, k))) {
        phase_ = Phase::kProbeAgain;
        probes_paid_ = true;
    } else if (n_accepted > 0 && n_accepted < k &&
               probe_paid(n_accepted, yield_of(step, n_accepted))) {
        // Its accepted prefix alone, as a whole accepted draft, would have paid: probe that
        // length. Where the draft is right at position 1 and wrong at 2, probes of the prior's
        // K never pay, and ones of K = 1 do.
        phase_ = Phase::kProbeAgain;
        probe_again_k_ = n_accepted;
    }
}

void AdaptivePolicy::observe(const StepOutcome& step) {
    const int k = step.k, n_accepted = step.n_accepted;
    // Position i was tried only if every position before it was accepted.
    const int reached = std::min(k, n_accepted + 1);
    // While drafting, a position the step did not reach keeps its evidence: fading it would
    // let it drift back towards the pooled estimate and be tried again and again (on the chat
    // prompt of the layer-skip pair, K = 3 for a few steps out of every eight where position
    // 2 is never right). While not drafting, all of it grows stale.
    if (k == 0)
        for (size_t i = 0; i < tries_.size(); ++i)
            fade_to(i, std::max(kEvidenceFloor, config_.decay * tries_[i]));
    for (int i = 0; i < reached; ++i) {
        const auto at = static_cast<size_t>(i);
        const double accepted =
            step.accept_chance ? (*step.accept_chance)[at] : (i < n_accepted ? 1.0 : 0.0);
        learn_at(at, 1.0, accepted);
    }
    if (!calibrated()) return;
    decide_on_probe(step);
    if (step.shared) return;
    if (k > 0) {
        request_drafted_ = true;
        request_gain_ += (n_accepted + 1) * verify_cost_[0] - (step.t_draft + step.t_verify);
    }
    if (step.caught_up == 1 || step.caught_up == 2)
        track_cost(draft_cost_[static_cast<size_t>(step.caught_up - 1)], step.t_catch_up);
    // After catching up, each draft token but the last is decoded on its own.
    if (k >= 2) track_cost(draft_cost_[0], (step.t_draft - step.t_catch_up) / (k - 1));
    observe_verify_cost(step);
}

void AdaptivePolicy::observe_verify_cost(const StepOutcome& step) {
    if (!calibrated() || step.shared) return;
    const auto k = static_cast<size_t>(step.k);
    // The calibration decodes after a short context; a long one makes decodes dearer.
    if (k < calibrated_verify_.size() && cost_ratios_.size() < kHealStepsMax &&
        step.context <= kHealContext && step.t_decode > 0.0)
        cost_ratios_.push_back(step.t_decode / calibrated_verify_[k]);
    if (k < verify_cost_.size()) track_cost(verify_cost_[k], step.t_verify);
}

double AdaptivePolicy::verify_cost(int rows) const {
    const auto m = static_cast<int>(verify_cost_.size());
    if (rows <= m) return verify_cost_[static_cast<size_t>(std::max(rows, 1) - 1)];
    // Past the curve each row costs what the rows of its upper half did: on a CPU a decode's
    // cost grows about linearly with its rows once they are more than a few.
    const int mid = m / 2;
    const double per_row =
        (verify_cost_[static_cast<size_t>(m - 1)] - verify_cost_[static_cast<size_t>(mid - 1)]) /
        (m - mid);
    return verify_cost_.back() + std::max(per_row, 0.0) * (rows - m);
}

BatchCosts::BatchCosts(std::vector<std::pair<int, double>> verify,
                       std::vector<std::pair<int, double>> draft)
    : verify_(std::move(verify)), draft_(std::move(draft)) {
    for (const auto* points : {&verify_, &draft_})
        for (size_t i = 0; i < points->size(); ++i)
            if ((*points)[i].first < 1 || (i > 0 && (*points)[i].first <= (*points)[i - 1].first) ||
                !std::isfinite((*points)[i].second) || (*points)[i].second < 0.0)
                throw std::invalid_argument(
                    "batch costs need rows increasing from 1 and finite seconds >= 0");
    if (verify_.empty()) throw std::invalid_argument("batch costs need the target's");
    verify_seen_.assign(verify_.size(), 1);
}

void BatchCosts::observe_verify(int rows, double seconds) {
    // The mean of a size's decodes, and past kBatchCostWeight of them a moving average: costs
    // drift with the context's length, and one decode may be slow (a shared machine).
    constexpr int kBatchCostWeight = 8;
    if (rows < 1 || verify_.empty() || !std::isfinite(seconds) || seconds <= 0.0) return;
    const double estimate = verify(rows);
    const double sample = std::clamp(seconds, kCostSampleMin * estimate, kCostSampleMax * estimate);
    const auto it = std::lower_bound(verify_.begin(), verify_.end(), rows,
                                     [](const auto& point, int n) { return point.first < n; });
    const auto i = static_cast<size_t>(it - verify_.begin());
    if (it == verify_.end() || it->first != rows) {
        verify_.insert(it, {rows, sample});
        verify_seen_.insert(verify_seen_.begin() + static_cast<std::ptrdiff_t>(i), 1);
        return;
    }
    const int seen = std::min(verify_seen_[i] + 1, kBatchCostWeight);
    verify_seen_[i] = seen;
    it->second += (sample - it->second) / seen;
}

double BatchCosts::at(const std::vector<std::pair<int, double>>& points, int rows) {
    if (points.empty() || rows <= 0) return 0.0;
    if (rows <= points.front().first) return points.front().second * rows / points.front().first;
    for (size_t i = 1; i < points.size(); ++i) {
        const auto [n1, t1] = points[i];
        if (rows > n1) continue;
        const auto [n0, t0] = points[i - 1];
        return t0 + (t1 - t0) * (rows - n0) / (n1 - n0);
    }
    // Past the largest batch measured, each row costs what the last stretch's rows did.
    const auto [n1, t1] = points.back();
    if (points.size() == 1) return t1 * rows / n1;
    const auto [n0, t0] = points[points.size() - 2];
    return t1 + (t1 - t0) * (rows - n1) / (n1 - n0);
}

double BatchCosts::step(const std::vector<int>& k, int other_rows) const {
    int rows = other_rows, deepest = 0;
    for (int ki : k) {
        rows += ki + 1;
        deepest = std::max(deepest, ki);
    }
    double seconds = verify(rows);
    // Draft position r: a row for each sequence drafting more than r tokens.
    for (int r = 0; r < deepest; ++r) {
        int drafting = 0;
        for (int ki : k) drafting += ki > r ? 1 : 0;
        seconds += draft(drafting);
    }
    return seconds;
}

void plan_batch(const std::vector<std::vector<double>>& expected, const std::vector<int>& caps,
                int other_rows, const BatchCosts& costs, std::vector<int>& k,
                std::vector<int>& trial) {
    const size_t n = expected.size();
    k.assign(n, 0);
    auto rate = [&](const std::vector<int>& ks) {
        double tokens = 0.0;
        for (size_t i = 0; i < n; ++i) tokens += expected[i][static_cast<size_t>(ks[i])];
        const double seconds = costs.step(ks, other_rows);
        return seconds > 0.0 ? tokens / seconds : 0.0;
    };
    const auto cap_of = [&](size_t i) {
        return std::min(caps[i], static_cast<int>(expected[i].size()) - 1);
    };
    // Start from the best K shared by all (each up to its cap), no drafting included: where the
    // cost of a decode is uneven in its rows (on this CPU multiples of 4 are cheap), one
    // sequence drafting alone may not pay while all drafting together do, and an ascent from
    // no drafting would never get there.
    double best = rate(k);
    int most = 0;
    for (size_t i = 0; i < n; ++i) most = std::max(most, cap_of(i));
    trial.resize(n);
    for (int u = 1; u <= most; ++u) {
        for (size_t i = 0; i < n; ++i) trial[i] = std::min(u, cap_of(i));
        const double r = rate(trial);
        if (r > best * (1.0 + 1e-9)) {
            best = r;
            k = trial;
        }
    }
    // Then ascent: each round takes the one change of one sequence's K, up or down, that raises
    // the batch's rate most. A jump of several tokens is tried too: the first draft position
    // pays for a draft decode the later ones share.
    while (true) {
        size_t best_i = n;
        int best_k = 0;
        for (size_t i = 0; i < n; ++i) {
            const int cap = cap_of(i);
            const int was = k[i];
            for (int ki = 0; ki <= cap; ++ki) {
                if (ki == was) continue;
                k[i] = ki;
                const double r = rate(k);
                if (r > best * (1.0 + 1e-9)) {
                    best = r;
                    best_i = i;
                    best_k = ki;
                }
            }
            k[i] = was;
        }
        if (best_i == n) return;
        k[best_i] = best_k;
    }
}

}  // namespace specdec
