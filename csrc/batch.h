// One preallocated llama_batch, reused for every decode of a context.
#pragma once

#include "llama.h"

namespace specdec {

class Batch {
  public:
    explicit Batch(int capacity);
    ~Batch();
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

    void clear() { batch_.n_tokens = 0; }
    // Appends a token of sequence 0; throws std::length_error past capacity.
    void add(llama_token token, llama_pos pos, bool want_logits);
    int size() const { return batch_.n_tokens; }
    int capacity() const { return capacity_; }
    const llama_batch& get() const { return batch_; }

  private:
    llama_batch batch_;
    int capacity_;
};

}  // namespace specdec
