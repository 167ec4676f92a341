#include "text_stream.h"

#include <algorithm>
#include <utility>

namespace specdec {

size_t incomplete_utf8_tail(const std::string& s) {
    // Walk back over at most 3 continuation bytes to the lead byte of the last character.
    const size_t n = s.size();
    for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
        const auto c = static_cast<unsigned char>(s[n - back]);
        if ((c & 0xC0) == 0x80) continue;  // continuation byte
        size_t need = 1;
        if ((c & 0xE0) == 0xC0)
            need = 2;
        else if ((c & 0xF0) == 0xE0)
            need = 3;
        else if ((c & 0xF8) == 0xF0)
            need = 4;
        return need > back ? back : 0;
    }
    return 0;  // only continuation bytes: invalid, nothing to wait for
}

TextStream::TextStream(std::vector<std::string> stop_strings) : stops_(std::move(stop_strings)) {}

std::string TextStream::take(size_t n) {
    std::string out = pending_.substr(0, n);
    pending_.erase(0, n);
    return out;
}

size_t TextStream::held_for_stop_prefix() const {
    size_t hold = 0;
    for (const auto& stop : stops_) {
        const size_t max_len = std::min(stop.size() - 1, pending_.size());
        for (size_t len = max_len; len > hold; --len) {
            if (pending_.compare(pending_.size() - len, len, stop, 0, len) == 0) {
                hold = len;
                break;
            }
        }
    }
    return hold;
}

std::string TextStream::push(const std::string& piece) {
    if (stopped_) return "";
    pending_ += piece;
    size_t first_stop = std::string::npos;
    for (const auto& stop : stops_) first_stop = std::min(first_stop, pending_.find(stop));
    if (first_stop != std::string::npos) {
        stopped_ = true;
        std::string out = take(first_stop);
        pending_.clear();
        return out;
    }
    const size_t hold = std::max(held_for_stop_prefix(), incomplete_utf8_tail(pending_));
    return take(pending_.size() - hold);
}

std::string TextStream::flush() {
    if (stopped_) return "";
    return take(pending_.size());
}

}  // namespace specdec
