#include "cost_curve.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace specdec {

double median(std::vector<double> samples) {
    if (samples.empty()) throw std::invalid_argument("no samples");
    const auto mid = samples.begin() + static_cast<long>(samples.size() / 2);
    std::nth_element(samples.begin(), mid, samples.end());
    return *mid;
}

namespace {

void check_timings(const std::vector<CostSweep>& sweeps) {
    if (sweeps.empty()) throw std::invalid_argument("no cost sweeps");
    const CostSweep& first = sweeps.front();
    if (first.verify.empty()) throw std::invalid_argument("a cost sweep without target timings");
    if (!first.draft.empty() && first.draft.size() != 2)
        throw std::invalid_argument("a cost sweep needs draft timings for 1 and 2 tokens, or none");
    if (!first.draft.empty() && first.verify.size() < 2)
        throw std::invalid_argument(
            "a cost sweep with draft timings needs target timings for 1 and 2 tokens");
    for (const CostSweep& s : sweeps) {
        if (s.verify.size() != first.verify.size() || s.draft.size() != first.draft.size())
            throw std::invalid_argument("cost sweeps of different shapes");
        for (double t : s.verify)
            if (!std::isfinite(t) || t <= 0.0)
                throw std::invalid_argument("target timings must be finite and > 0");
        for (double t : s.draft)
            if (!std::isfinite(t) || t < 0.0)
                throw std::invalid_argument("draft timings must be finite and >= 0");
    }
}

double fastest(const std::vector<double>& times) {
    return *std::min_element(times.begin(), times.end());
}

// The first `count` sweeps' fastest timings.
CostCurve fastest_of(const std::vector<CostSweep>& sweeps, size_t count) {
    const CostSweep& first = sweeps.front();
    const auto column = [&](auto member, size_t n) {
        std::vector<double> times;
        for (size_t s = 0; s < count; ++s) times.push_back((sweeps[s].*member)[n]);
        return times;
    };
    CostCurve curve;
    for (size_t n = 0; n < first.verify.size(); ++n)
        curve.verify.push_back(fastest(column(&CostSweep::verify, n)));
    curve.draft.assign(2, 0.0);
    for (size_t n = 0; n < first.draft.size(); ++n)
        curve.draft[n] = fastest(column(&CostSweep::draft, n));
    return curve;
}

// How much slower than its fastest a target decode typically ran.
double typical_slowdown(const std::vector<CostSweep>& sweeps, const CostCurve& fastest) {
    std::vector<double> slowdowns;
    for (const CostSweep& s : sweeps)
        for (size_t n = 0; n < s.verify.size(); ++n)
            slowdowns.push_back(s.verify[n] / fastest.verify[n]);
    return median(std::move(slowdowns));
}

bool close(const std::vector<double>& a, const std::vector<double>& b, double tolerance) {
    for (size_t i = 0; i < a.size(); ++i)
        if (std::abs(a[i] - b[i]) > tolerance * std::max(a[i], b[i])) return false;
    return true;
}

}  // namespace

CostCurve estimate_costs(const std::vector<CostSweep>& sweeps) {
    check_timings(sweeps);
    CostCurve curve = fastest_of(sweeps, sweeps.size());
    const double slowdown = typical_slowdown(sweeps, curve);
    for (double& t : curve.verify) t *= slowdown;
    for (double& t : curve.draft) t *= slowdown;
    return curve;
}

bool costs_settled(const std::vector<CostSweep>& sweeps, double tolerance) {
    if (sweeps.size() < 2) return false;
    check_timings(sweeps);
    const CostCurve all = fastest_of(sweeps, sweeps.size());
    const CostCurve fewer = fastest_of(sweeps, sweeps.size() - 1);
    return close(all.verify, fewer.verify, tolerance) && close(all.draft, fewer.draft, tolerance);
}

}  // namespace specdec
