#include "batch.h"

#include <stdexcept>

namespace specdec {

Batch::Batch(int capacity) : batch_(llama_batch_init(capacity, 0, 1)), capacity_(capacity) {}

Batch::~Batch() { llama_batch_free(batch_); }

void Batch::add(llama_token token, llama_pos pos, bool want_logits, llama_seq_id seq) {
    if (batch_.n_tokens >= capacity_) throw std::length_error("batch is full");
    const int i = batch_.n_tokens++;
    batch_.token[i] = token;
    batch_.pos[i] = pos;
    batch_.n_seq_id[i] = 1;
    batch_.seq_id[i][0] = seq;
    batch_.logits[i] = want_logits;
}

}  // namespace specdec
