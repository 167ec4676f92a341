#include "rate_check.h"

#include <algorithm>

namespace specdec {

namespace {
// The speculating rate is an average over about the last 1 / (1 - kSpecDecay) steps, judged
// once it holds kJudgeSteps steps' worth: a step commits 1 to K + 1 tokens, and fewer steps
// would judge the luck of a few drafts. Before that, from kEarlyJudgeSteps, only a loss of more
// than kEarlyMargin counts: a request of 48 tokens is over in 20 to 40 steps.
constexpr double kSpecDecay = 0.97;
constexpr double kJudgeSteps = 12.0;
constexpr double kEarlyJudgeSteps = 5.0;
constexpr double kEarlyMargin = 0.15;
// Target-only steps commit one token each at a steady cost: a few samples tell their rate.
constexpr double kPlainDecay = 0.8;
constexpr int kPlainSamples = 2;
// A target-only rate this many steps old is measured again (the machine's load changes).
constexpr int kPlainStale = 256;
// Speculating must lose by more than this to be held back.
constexpr double kMargin = 0.03;
// Target-only is measured only where speculating runs below this multiple of the model's
// target-only rate, by one step in kExploreEvery.
constexpr double kExploreBelow = 1.3;
constexpr int kExploreEvery = 8;
// Under load a try is judged once it holds this many steps' worth, and must win by kMargin.
constexpr double kTrySteps = 6.0;
// Holds of target-only steps: the first this long, doubling while each try after one loses.
constexpr int kHoldMin = 16;
constexpr int kHoldMax = 256;
}  // namespace

RateCheck::RateCheck(int max_sequences) : lanes_(static_cast<size_t>(std::max(max_sequences, 0))) {
    // Under load drafting must show that it pays: it starts held, and each try is judged on
    // all of its steps.
    for (size_t i = 1; i < lanes_.size(); ++i) {
        lanes_[i].under_load = true;
        start_hold(lanes_[i]);
    }
}

double RateCheck::Lane::spec_rate() const {
    return spec_seconds > 0.0 ? spec_tokens / spec_seconds : 0.0;
}

double RateCheck::Lane::plain_rate() const {
    return plain_seconds > 0.0 ? plain_tokens / plain_seconds : 0.0;
}

bool RateCheck::Lane::plain_known() const {
    return plain_samples >= kPlainSamples && steps_since_plain <= kPlainStale;
}

RateCheck::Lane* RateCheck::lane(int n) {
    if (n < 1 || n > static_cast<int>(lanes_.size())) return nullptr;
    return &lanes_[static_cast<size_t>(n - 1)];
}

void RateCheck::start_hold(Lane& l) {
    l.hold = l.retrying ? std::min(2 * l.hold, kHoldMax) : kHoldMin;
    l.hold_left = l.hold;
    l.retrying = false;
    l.spec_tokens = l.spec_seconds = l.spec_weight = 0.0;
}

RateCheck::Standing RateCheck::standing(const Lane& l, double modelled_plain) {
    // Target-only's rate as measured; until it is, as modelled (a hold then measures it).
    const double plain = l.plain_known() ? l.plain_rate() : modelled_plain;
    if (plain <= 0.0 || l.spec_weight < (l.under_load ? kTrySteps : kEarlyJudgeSteps))
        return Standing::kUnjudged;
    // The rate speculating must reach: under load a win, otherwise no loss beyond the noise.
    const double loss = l.spec_weight >= kJudgeSteps ? kMargin : kEarlyMargin;
    const double bar = l.under_load ? 1.0 + kMargin : 1.0 - loss;
    return l.spec_rate() < plain * bar ? Standing::kLosing : Standing::kHolding;
}

void RateCheck::judge(Lane& l, double modelled_plain) {
    const Standing s = standing(l, modelled_plain);
    if (s == Standing::kLosing)
        start_hold(l);
    else if (s == Standing::kHolding && l.retrying && l.spec_weight >= 2 * kJudgeSteps)
        l.retrying = false;  // the try after a hold held its own: the next hold is short
}

bool RateCheck::hold_plain(int n, double modelled_plain) {
    Lane* l = lane(n);
    if (!l) return false;
    l->forced = false;
    if (l->hold_left == 0) judge(*l, modelled_plain);
    if (l->hold_left > 0) {
        if (--l->hold_left == 0) {
            l->skip_next = true;
            l->retrying = true;
        }
        l->forced = true;
        return true;
    }
    const bool explore = l->spec_weight >= kJudgeSteps && !l->plain_known() &&
                         l->steps_since_explore >= kExploreEvery &&
                         (modelled_plain <= 0.0 || l->spec_rate() < kExploreBelow * modelled_plain);
    if (explore) {
        l->steps_since_explore = 0;
        l->forced = true;
    }
    return explore;
}

void RateCheck::observe(int n, int tokens, double seconds, bool drafted) {
    Lane* l = lane(n);
    if (!l || seconds <= 0.0 || tokens < 0) return;
    ++l->steps_since_explore;
    ++l->steps_since_plain;
    if (!drafted) {
        if (l->steps_since_plain > kPlainStale) {
            l->plain_tokens = l->plain_seconds = 0.0;
            l->plain_samples = 0;
        }
        l->plain_tokens = kPlainDecay * l->plain_tokens + tokens;
        l->plain_seconds = kPlainDecay * l->plain_seconds + seconds;
        ++l->plain_samples;
        l->steps_since_plain = 0;
    }
    // Under load every step of `auto`'s counts: its plan often drafts for some sequences, and
    // what the batch commits is the measure.
    if (l->forced || (!drafted && !l->under_load)) return;
    if (l->skip_next) {
        l->skip_next = false;
        return;
    }
    l->spec_tokens = kSpecDecay * l->spec_tokens + tokens;
    l->spec_seconds = kSpecDecay * l->spec_seconds + seconds;
    l->spec_weight = kSpecDecay * l->spec_weight + 1.0;
}

bool RateCheck::drafting_won(int n, double modelled_plain) const {
    if (n < 1 || n > static_cast<int>(lanes_.size())) return false;
    const Lane& l = lanes_[static_cast<size_t>(n - 1)];
    return l.hold_left == 0 && !l.retrying && standing(l, modelled_plain) == Standing::kHolding;
}

void RateCheck::new_text(int n) {
    Lane* l = lane(n);
    if (!l || l->hold_left == 0) return;
    l->hold_left = 0;
    l->skip_next = true;
    l->retrying = true;
}

RateCheck::View RateCheck::view(int n) const {
    if (n < 1 || n > static_cast<int>(lanes_.size())) return {};
    const Lane& l = lanes_[static_cast<size_t>(n - 1)];
    return {l.spec_rate(), l.plain_known() ? l.plain_rate() : 0.0, l.hold_left > 0, l.hold};
}

}  // namespace specdec
