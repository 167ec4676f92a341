#include "ngram_index.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>

#include "errors.h"

namespace specdec {
namespace {
// A map entry's bytes in libstdc++: a node (next, key, value) with the allocator's overhead,
// and a bucket pointer.
constexpr size_t kEntryBytes = 32;
constexpr size_t kBucketBytes = 8;
constexpr int kMaxNgram = 16;  // the engine's bound on ngram_max
constexpr double kMaxTries = 1e15;
// Its last byte is the format's version: a file of another version is named as such.
constexpr char kMagic[8] = {'S', 'P', 'D', 'X', 'N', 'G', 'I', '2'};

struct FileHeader {
    char magic[8];
    int32_t n_vocab, ngram_min, ngram_max;
    uint64_t n_tokens;
    uint64_t vocab_fingerprint;
};

FileError io_error(const std::string& what, const std::string& path) {
    return FileError(what + " " + path + ": " + std::strerror(errno));
}
}  // namespace

SharedNgramIndex::SharedNgramIndex(int ngram_min, int ngram_max, size_t budget_bytes)
    : ngram_min_(ngram_min), ngram_max_(ngram_max), budget_(budget_bytes) {
    if (ngram_min < 1 || ngram_max < ngram_min || ngram_max > 16)
        throw std::invalid_argument("need 1 <= ngram_min <= ngram_max <= 16");
    if (budget_bytes < kMinBudget)
        throw std::invalid_argument("the shared n-gram index needs at least " +
                                    std::to_string(kMinBudget) + " bytes");
    by_length_.resize(static_cast<size_t>(ngram_max - ngram_min + 1));
}

void SharedNgramIndex::clear() noexcept {
    std::vector<llama_token>().swap(tokens_);
    for (auto& map : by_length_) ContextMap().swap(map);
    ContextMap().swap(places_);
    copy_ = CopyPolicy();
}

size_t SharedNgramIndex::bytes() const {
    size_t total = tokens_.capacity() * sizeof(llama_token);
    for (const auto& map : by_length_)
        total += map.size() * kEntryBytes + map.bucket_count() * kBucketBytes;
    total += places_.size() * kEntryBytes + places_.bucket_count() * kBucketBytes;
    return total;
}

void SharedNgramIndex::add(const std::vector<llama_token>& prompt,
                           const std::vector<llama_token>& output) {
    if (output.empty()) return;
    const size_t context = std::min(prompt.size(), static_cast<size_t>(ngram_max_));
    const size_t begin = tokens_.size();
    tokens_.insert(tokens_.end(), prompt.end() - static_cast<long>(context), prompt.end());
    tokens_.insert(tokens_.end(), output.begin(), output.end());
    tokens_.push_back(kBoundary);
    index_from(begin);
    fit_budget();
}

void SharedNgramIndex::fit_budget() {
    while (!tokens_.empty() &&
           (bytes() > budget_ || tokens_.size() >= std::numeric_limits<uint32_t>::max())) {
        const size_t before = tokens_.size();
        forget_older_half();
        if (tokens_.size() == before) {  // nothing left to halve: what remains is the maps' floor
            clear();
            return;
        }
    }
}

void SharedNgramIndex::record(ContextMap& map, uint64_t key, const std::vector<llama_token>& tokens,
                              size_t p) {
    const auto [it, added] = map.try_emplace(key);
    Continuation& c = it->second;
    // Full counts are halved, not frozen: a context steady for long may stop being so.
    if (c.seen == std::numeric_limits<uint16_t>::max()) {
        c.seen /= 2;
        c.changes /= 2;
    }
    c.changes += !added && tokens[c.at] != tokens[p];
    ++c.seen;
    c.at = static_cast<uint32_t>(p);
}

// Position p continues the n-gram tokens_[p-n, p) of its own output; later positions overwrite
// earlier ones, so a lookup finds the most recent occurrence. `begin` starts an output.
void SharedNgramIndex::index_from(size_t begin) {
    size_t output_start = begin;
    for (size_t p = begin; p < tokens_.size(); ++p) {
        if (tokens_[p] == kBoundary) {
            output_start = p + 1;
            continue;
        }
        for (int n = ngram_min_; n <= ngram_max_ && output_start + static_cast<size_t>(n) <= p;
             ++n) {
            auto& map = by_length_[static_cast<size_t>(n - ngram_min_)];
            record(map, hash_tokens(&tokens_[p - n], n), tokens_, p);
        }
        if (output_start + kPlaceTokens <= p)
            record(places_, hash_tokens(&tokens_[p - kPlaceTokens], kPlaceTokens), tokens_, p);
    }
}

// The older half goes (whole outputs where it can), and the maps are built again from the rest.
void SharedNgramIndex::forget_older_half() {
    const auto half = tokens_.begin() + static_cast<long>(tokens_.size() / 2);
    const auto boundary = std::find(half, tokens_.end(), kBoundary);
    // Whole outputs, unless the last one holds more than half of it all: then its older part.
    const bool whole = boundary != tokens_.end() && boundary + 1 != tokens_.end();
    tokens_.erase(tokens_.begin(), whole ? boundary + 1 : half);
    tokens_.shrink_to_fit();
    for (auto& map : by_length_) ContextMap().swap(map);
    ContextMap().swap(places_);
    index_from(0);
}

void SharedNgramIndex::save(const std::string& path, VocabKey vocab) const {
    // A temporary file of its own, created anew (never a file or link already there, which
    // another process could have put in the index's directory), then renamed over the path.
    std::string tmp = path + ".XXXXXX";
    const int fd = mkstemp(tmp.data());
    if (fd < 0) throw io_error("cannot write", path);
    if (write_file(fd, vocab) && std::rename(tmp.c_str(), path.c_str()) == 0) return;
    const FileError error = io_error("cannot write", path);
    std::remove(tmp.c_str());  // a failed save leaves the old file and nothing beside it
    throw error;
}

bool SharedNgramIndex::write_file(int fd, VocabKey vocab) const {
    std::FILE* out = fdopen(fd, "wb");
    if (!out) {
        close(fd);
        return false;
    }
    FileHeader h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.n_vocab = vocab.n_vocab;
    h.vocab_fingerprint = vocab.fingerprint;
    h.ngram_min = ngram_min_;
    h.ngram_max = ngram_max_;
    h.n_tokens = tokens_.size();
    const auto evidence = copy_.evidence();
    bool ok = std::fwrite(&h, sizeof h, 1, out) == 1;
    ok = ok && std::fwrite(evidence.data(), sizeof evidence, 1, out) == 1;
    ok = ok &&
         std::fwrite(tokens_.data(), sizeof(llama_token), tokens_.size(), out) == tokens_.size();
    return std::fclose(out) == 0 && ok;
}

void SharedNgramIndex::load(const std::string& path, VocabKey vocab) {
    // Opening a named pipe would wait for a writer, and a device may never end.
    struct stat st{};
    if (stat(path.c_str(), &st) != 0) throw io_error("cannot read", path);
    if (!S_ISREG(st.st_mode)) throw FileError("cannot read " + path + ": not a regular file");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw io_error("cannot read", path);
    in.seekg(0, std::ios::end);
    const auto size = static_cast<uint64_t>(in.tellg());
    in.seekg(0, std::ios::beg);
    FileHeader h{};
    std::array<double, 2 * CopyPolicy::kBuckets> evidence{};
    in.read(reinterpret_cast<char*>(&h), sizeof h);
    const bool has_magic = in.gcount() >= static_cast<std::streamsize>(sizeof kMagic) &&
                           std::memcmp(h.magic, kMagic, sizeof kMagic - 1) == 0;
    in.read(reinterpret_cast<char*>(evidence.data()), sizeof evidence);
    const std::string bad = path + " is not a shared n-gram index of this model: ";
    // The version first: another version's header may be shorter than this one's.
    if (has_magic && h.magic[sizeof kMagic - 1] != kMagic[sizeof kMagic - 1])
        throw std::invalid_argument(bad + "its format is another version's (" +
                                    std::string(1, h.magic[sizeof kMagic - 1]) + ", this one " +
                                    std::string(1, kMagic[sizeof kMagic - 1]) + ")");
    if (!in || !has_magic) throw std::invalid_argument(bad + "no index header");
    const int n_vocab = vocab.n_vocab;
    if (h.n_vocab != n_vocab)
        throw std::invalid_argument(bad + "its vocabulary has " + std::to_string(h.n_vocab) +
                                    " tokens, the model's " + std::to_string(n_vocab));
    if (h.vocab_fingerprint != vocab.fingerprint)
        throw std::invalid_argument(bad + "its vocabulary has other tokens");
    if (h.ngram_min < 1 || h.ngram_max < h.ngram_min || h.ngram_max > kMaxNgram)
        throw std::invalid_argument(bad + "its n-gram lengths are out of range");
    // Before allocating: a forged count must not cost memory.
    if (h.n_tokens >= std::numeric_limits<uint32_t>::max() ||
        size != sizeof h + sizeof evidence + h.n_tokens * sizeof(llama_token))
        throw std::invalid_argument(bad + "its length does not match its header");
    for (size_t b = 0; b < CopyPolicy::kBuckets; ++b) {
        const double tries = evidence[b], accepts = evidence[b + CopyPolicy::kBuckets];
        // Past 2^53 tries a new one would add nothing: the evidence would be fixed for good.
        if (!(accepts >= 0.0 && accepts <= tries && tries < kMaxTries))
            throw std::invalid_argument(bad + "bad copy evidence");
    }
    // Only the newest tokens that could fit the budget are read, before any map is built (a
    // file saved under a larger budget, or a crafted one, must not cost more memory than that):
    // each token costs its own bytes and an entry and a bucket in every context's map.
    const uint64_t most =
        budget_ / (sizeof(llama_token) + (by_length_.size() + 1) * (kEntryBytes + kBucketBytes));
    const uint64_t skipped = h.n_tokens > most ? h.n_tokens - most : 0;
    in.seekg(static_cast<std::streamoff>(skipped * sizeof(llama_token)), std::ios::cur);
    std::vector<llama_token> tokens;
    tokens.reserve(h.n_tokens - skipped + 1);
    tokens.resize(h.n_tokens - skipped);
    in.read(reinterpret_cast<char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * sizeof(llama_token)));
    if (!in) throw io_error("cannot read", path);
    for (llama_token t : tokens)
        if (t != kBoundary && (t < 0 || t >= n_vocab))
            throw std::invalid_argument(bad + "a token outside the vocabulary");
    if (skipped > 0) {  // from the first whole output on, where one starts in what was read
        const auto boundary = std::find(tokens.begin(), tokens.end(), kBoundary);
        if (boundary != tokens.end() && boundary + 1 != tokens.end())
            tokens.erase(tokens.begin(), boundary + 1);
    }
    if (!tokens.empty() && tokens.back() != kBoundary) tokens.push_back(kBoundary);
    // Nothing of the old index survives from here: a failure leaves it empty, never half-built.
    clear();
    try {
        tokens_ = std::move(tokens);
        copy_.set_evidence(evidence);
        index_from(0);
        fit_budget();
    } catch (...) {
        clear();
        throw;
    }
}

NgramMatch SharedNgramIndex::match(const std::vector<llama_token>& text) const {
    const long end = static_cast<long>(text.size());
    for (int n = ngram_max_; n >= ngram_min_; --n) {
        if (n > end) continue;
        const auto& map = by_length_[static_cast<size_t>(n - ngram_min_)];
        const auto it = map.find(hash_tokens(&text[static_cast<size_t>(end - n)], n));
        if (it == map.end()) continue;
        const long p = it->second.at;
        // A hash collision must not become a draft.
        if (!std::equal(text.end() - n, text.end(), tokens_.begin() + p - n)) continue;
        return {p, matched_length(tokens_.data(), p, text.data(), end, n)};
    }
    return {};
}

const SharedNgramIndex::Continuation* SharedNgramIndex::context_before(const ContextMap& map,
                                                                       size_t p, int n) const {
    if (p < static_cast<size_t>(n)) return nullptr;
    const auto context = tokens_.begin() + static_cast<long>(p) - n;
    if (std::find(context, context + n, kBoundary) != context + n) return nullptr;
    const auto it = map.find(hash_tokens(&*context, n));
    if (it == map.end()) return nullptr;
    const auto latest = tokens_.begin() + static_cast<long>(it->second.at) - n;
    return std::equal(context, context + n, latest) ? &it->second : nullptr;
}

// The deepest context whose record the index keeps: the place's once the match reaches it,
// else the longest key the match covers.
bool SharedNgramIndex::steady_at(size_t p, int matched) const {
    const Continuation* c =
        matched >= kPlaceTokens ? context_before(places_, p, kPlaceTokens) : nullptr;
    const int n = std::min(matched, ngram_max_);
    if (!c && n >= ngram_min_)
        c = context_before(by_length_[static_cast<size_t>(n - ngram_min_)], p, n);
    if (!c) return true;
    return tokens_[c->at] == tokens_[p] && 2 * c->changes <= c->seen - 1;
}

int SharedNgramIndex::steady_length(NgramMatch m, int k) const {
    if (!m.found()) return 0;
    int n = 0;
    for (auto p = static_cast<size_t>(m.from);
         n < k && p < tokens_.size() && tokens_[p] != kBoundary && steady_at(p, m.length + n); ++p)
        ++n;
    return n;
}

void SharedNgramIndex::propose(NgramMatch m, int k, Draft& out) const {
    copy(m, steady_length(m, k), out);
}

void SharedNgramIndex::copy(NgramMatch m, int n, Draft& out) const {
    out.start_copy(DraftSource::kIndex);
    for (int j = 0; j < n; ++j) {
        out.tokens.push_back(tokens_[static_cast<size_t>(m.from + j)]);
        out.q.push_back(nullptr);
    }
}

}  // namespace specdec
