// One preallocated llama_batch, reused for every decode of a context.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "llama.h"

namespace specdec {

class Batch {
  public:
    explicit Batch(int capacity);
    ~Batch();
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

    void clear() { batch_.n_tokens = 0; }
    // Appends a token of sequence `seq`; throws std::length_error past capacity.
    void add(llama_token token, llama_pos pos, bool want_logits, llama_seq_id seq = 0);
    int size() const { return batch_.n_tokens; }
    int capacity() const { return capacity_; }
    const llama_batch& get() const { return batch_; }

  private:
    llama_batch batch_;
    int capacity_;
};

// Decodes tokens[from, to) of sequence `seq` at positions first_pos.. in batches of at most
// `chunk` tokens (0: as many as `batch` holds), logits on tokens[logits_from..] (`to - 1`: the
// last only; `to`: none). `decode(batch)` runs each one.
template <typename Decode>
void decode_in_chunks(Batch& batch, const std::vector<llama_token>& tokens, size_t from, size_t to,
                      llama_pos first_pos, size_t logits_from, size_t chunk, Decode&& decode,
                      llama_seq_id seq = 0) {
    if (chunk == 0) chunk = static_cast<size_t>(batch.capacity());
    for (size_t start = from; start < to; start += chunk) {
        const size_t stop = std::min(to, start + chunk);
        batch.clear();
        for (size_t i = start; i < stop; ++i)
            batch.add(tokens[i], first_pos + static_cast<llama_pos>(i - from), i >= logits_from,
                      seq);
        decode(batch);
    }
}

}  // namespace specdec
