#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace specdec {
namespace {

using Candidate = SamplingWorkspace::Candidate;

bool by_value_desc(const Candidate& a, const Candidate& b) {
    return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// Keeps the k largest candidates (by value), in no particular order. O(n).
void keep_top_k(std::vector<Candidate>& c, size_t k) {
    if (k >= c.size()) return;
    std::nth_element(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(k), c.end(), by_value_desc);
    c.resize(k);
}

// Replaces logits by softmax probabilities (at the given temperature) over the candidates.
void softmax(std::vector<Candidate>& c, float temperature) {
    float max_logit = -INFINITY;
    for (const auto& x : c) max_logit = std::max(max_logit, x.value);
    double sum = 0.0;
    for (auto& x : c) {
        x.value = std::exp((x.value - max_logit) / temperature);
        sum += x.value;
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (auto& x : c) x.value *= inv;
}

// Keeps the smallest most-probable prefix whose mass reaches top_p. Sorting all of a 262k vocab
// per row is slow, so sort a growing head until it holds enough mass.
void keep_top_p(std::vector<Candidate>& c, float top_p) {
    size_t head = std::min<size_t>(64, c.size());
    while (true) {
        std::partial_sort(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(head), c.end(),
                          by_value_desc);
        double mass = 0.0;
        for (size_t i = 0; i < head; ++i) {
            mass += c[i].value;
            if (mass >= top_p) {
                c.resize(i + 1);
                return;
            }
        }
        if (head == c.size()) return;  // rounding: the whole mass fell short of top_p
        head = std::min(head * 8, c.size());
    }
}

void keep_min_p(std::vector<Candidate>& c, float min_p) {
    float max_p = 0.0f;
    for (const auto& x : c) max_p = std::max(max_p, x.value);
    const float threshold = min_p * max_p;
    c.erase(std::remove_if(c.begin(), c.end(),
                           [threshold](const Candidate& x) { return x.value < threshold; }),
            c.end());
}

void write_distribution(const std::vector<Candidate>& c, int n_vocab, Distribution& out) {
    // Clearing only the old support is much cheaper than refilling a large vocabulary.
    if (out.probs.size() != static_cast<size_t>(n_vocab)) {
        out.probs.assign(static_cast<size_t>(n_vocab), 0.0f);
    } else {
        for (int32_t id : out.support) out.probs[static_cast<size_t>(id)] = 0.0f;
    }
    out.support.clear();
    double sum = 0.0;
    for (const auto& x : c) sum += x.value;
    const float inv = static_cast<float>(1.0 / sum);
    for (const auto& x : c) {
        if (x.value <= 0.0f) continue;
        out.probs[static_cast<size_t>(x.id)] = x.value * inv;
        out.support.push_back(x.id);
    }
}

// Draws from weights w(id) over ids, whose total is `total`.
template <typename Weight>
int32_t draw(const std::vector<int32_t>& ids, double total, Weight w, Rng& rng) {
    const double target = rng.uniform() * total;
    double acc = 0.0;
    int32_t last_positive = ids.empty() ? 0 : ids.front();
    for (int32_t id : ids) {
        const double wi = w(id);
        if (wi <= 0.0) continue;
        acc += wi;
        last_positive = id;
        if (target < acc) return id;
    }
    return last_positive;  // rounding left target just above the accumulated total
}

}  // namespace

void validate(const SamplingParams& p) {
    if (!std::isfinite(p.temperature) || p.temperature < 0.0f)
        throw std::invalid_argument("temperature must be a finite number >= 0, got " +
                                    std::to_string(p.temperature));
    if (p.top_k < 0) throw std::invalid_argument("top_k must be >= 0 (0 disables it)");
    // 0 keeps the most likely token alone, as in llama.cpp and OpenAI's API.
    if (!(p.top_p >= 0.0f && p.top_p <= 1.0f))
        throw std::invalid_argument("top_p must be in [0, 1], got " + std::to_string(p.top_p));
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
        throw std::invalid_argument("min_p must be in [0, 1], got " + std::to_string(p.min_p));
}

bool all_finite(const float* values, int n) {
    // x * 0 is 0 for a finite x and NaN otherwise; a sum without branches vectorises.
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += values[i] * 0.0f;
    return acc == 0.0f;
}

int32_t argmax(const float* logits, int n_vocab) {
    return static_cast<int32_t>(std::max_element(logits, logits + n_vocab) - logits);
}

Top2 top2(const float* logits, int n_vocab) {
    int32_t best = 0;
    float first = logits[0];
    float second = -INFINITY;
    for (int i = 1; i < n_vocab; ++i) {
        const float v = logits[i];
        if (v > first) {
            second = first;
            first = v;
            best = i;
        } else if (v > second) {
            second = v;
        }
    }
    return {best, first - second};
}

float max_probability(const float* logits, int n_vocab, int32_t best) {
    const float top = logits[best];
    double sum = 0.0;
    for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - top));
    return static_cast<float>(1.0 / sum);
}

void token_logprob(const float* logits, int n_vocab, int32_t token, int n_top,
                   SamplingWorkspace& ws, TokenLogprob& out) {
    float top = -INFINITY;
    for (int i = 0; i < n_vocab; ++i) top = std::max(top, logits[i]);
    double sum = 0.0;
    for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - top));
    const auto log_z = static_cast<float>(static_cast<double>(top) + std::log(sum));
    out.token = token;
    out.logprob = logits[token] - log_z;
    out.top.clear();
    if (n_top <= 0) return;
    auto& c = ws.candidates;
    c.resize(static_cast<size_t>(n_vocab));
    for (int i = 0; i < n_vocab; ++i) c[static_cast<size_t>(i)] = {i, logits[i]};
    const auto n = std::min(static_cast<size_t>(n_top), c.size());
    std::partial_sort(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(n), c.end(),
                      [](const Candidate& a, const Candidate& b) {
                          return a.value > b.value || (a.value == b.value && a.id < b.id);
                      });
    // Tokens a grammar forbids (-inf) are no alternatives.
    for (size_t i = 0; i < n && std::isfinite(c[i].value); ++i)
        out.top.emplace_back(c[i].id, c[i].value - log_z);
}

void make_distribution(const float* logits, int n_vocab, const SamplingParams& params,
                       SamplingWorkspace& ws, Distribution& out) {
    auto& c = ws.candidates;
    c.resize(static_cast<size_t>(n_vocab));
    for (int i = 0; i < n_vocab; ++i) c[static_cast<size_t>(i)] = {i, logits[i]};
    if (params.top_k > 0) keep_top_k(c, static_cast<size_t>(params.top_k));
    softmax(c, params.temperature);
    if (params.top_p < 1.0f) keep_top_p(c, params.top_p);
    if (params.min_p > 0.0f) keep_min_p(c, params.min_p);
    write_distribution(c, n_vocab, out);
}

int32_t sample(const Distribution& dist, Rng& rng) {
    return draw(dist.support, 1.0, [&](int32_t id) { return dist[id]; }, rng);
}

double acceptance_probability(float p_x, float q_x) {
    if (q_x <= 0.0f) return 0.0;
    return std::min(1.0, static_cast<double>(p_x) / static_cast<double>(q_x));
}

double acceptance_chance(const Distribution& p, const Distribution& q) {
    double total = 0.0;
    for (int32_t id : q.support) total += std::min(double(p[id]), double(q[id]));
    return std::min(total, 1.0);
}

bool accept_draft(const Distribution& p, const Distribution& q, int32_t x, Rng& rng) {
    return rng.uniform() < acceptance_probability(p[x], q[x]);
}

bool accept_point_draft(const Distribution& p, int32_t x, Rng& rng) {
    return rng.uniform() < static_cast<double>(p[x]);
}

int32_t sample_residual(const Distribution& p, const Distribution& q, Rng& rng) {
    auto residual = [&](int32_t id) { return std::max(0.0, double(p[id]) - double(q[id])); };
    double total = 0.0;
    for (int32_t id : p.support) total += residual(id);
    // A rejection implies p != q, so the residual has mass; only rounding can leave none.
    if (total <= 0.0) return sample(p, rng);
    return draw(p.support, total, residual, rng);
}

int32_t sample_residual_point(const Distribution& p, int32_t x, Rng& rng) {
    auto residual = [&](int32_t id) { return id == x ? 0.0 : double(p[id]); };
    const double total = 1.0 - double(p[x]);
    if (total <= 0.0) return sample(p, rng);
    return draw(p.support, total, residual, rng);
}

int32_t most_likely(const Distribution& d) {
    int32_t best = d.support.empty() ? 0 : d.support.front();
    for (int32_t id : d.support)
        if (d[id] > d[best] || (d[id] == d[best] && id < best)) best = id;
    return best;
}

}  // namespace specdec
