// Turns token pieces into text that is safe to hand out as it is generated: whole UTF-8
// characters only, and nothing that might still turn out to be the start of a stop string.
#pragma once

#include <string>
#include <vector>

namespace specdec {

class TextStream {
  public:
    explicit TextStream(std::vector<std::string> stop_strings);

    // Adds a token's bytes; returns the text that can now be emitted (possibly empty).
    std::string push(const std::string& piece);
    // At the end of generation: whatever was held back (stop-string prefixes, broken UTF-8).
    std::string flush();
    // True once a stop string has appeared; it and everything after it are dropped.
    bool stopped() const { return stopped_; }

  private:
    size_t held_for_stop_prefix() const;
    std::string take(size_t n);

    std::vector<std::string> stops_;
    std::string pending_;
    bool stopped_ = false;
};

// Bytes at the end of s that begin a UTF-8 character not yet complete (0..3).
size_t incomplete_utf8_tail(const std::string& s);

}  // namespace specdec
