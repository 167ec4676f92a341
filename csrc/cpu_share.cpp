#include "cpu_share.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace specdec {

ThreadGovernor::ThreadGovernor(int max, bool enabled)
    : max_(std::max(1, max)),
      enabled_(enabled),
      current_(max_),
      n_cpus_(std::max(1, static_cast<int>(std::thread::hardware_concurrency()))),
      last_(enabled ? read_sample() : Sample{}),
      last_look_(std::chrono::steady_clock::now()) {}

ThreadGovernor::Sample ThreadGovernor::read_sample() {
    Sample s;
    std::ifstream stat("/proc/stat");
    std::string cpu;
    long long user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    if (!(stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal) ||
        cpu != "cpu")
        return s;
    s.busy = user + nice + system + irq + softirq + steal;
    s.total = s.busy + idle + iowait;
    // /proc/self/stat: utime and stime are fields 14 and 15; the command (field 2) may hold
    // spaces, so count from its closing parenthesis.
    std::ifstream self_stat("/proc/self/stat");
    std::string line;
    std::getline(self_stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) return s;
    std::istringstream rest(line.substr(close + 2));
    std::string field;
    long long utime = 0, stime = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {
        if (i == 14) utime = std::atoll(field.c_str());
        if (i == 15) stime = std::atoll(field.c_str());
    }
    s.self = utime + stime;
    s.ok = true;
    return s;
}

double ThreadGovernor::others_busy(const Sample& now) const {
    const long long total = now.total - last_.total;
    if (total <= 0) return 0.0;
    const double others = static_cast<double>(now.busy - last_.busy - (now.self - last_.self));
    // total counts the ticks of every CPU: per CPU, the interval is total / n_cpus ticks.
    return std::max(0.0, others * n_cpus_ / static_cast<double>(total));
}

int ThreadGovernor::threads() {
    if (!enabled_) return max_;
    const auto now_time = std::chrono::steady_clock::now();
    if (now_time - last_look_ < (looked_ ? kInterval : kFirstLook)) return current_;
    last_look_ = now_time;
    looked_ = true;
    const Sample now = read_sample();
    if (!now.ok || !last_.ok) {
        last_ = now;
        return current_;
    }
    const double others = others_busy(now);
    last_ = now;
    // A core counts as taken when others used most of it (0.6: a 30 % background task does
    // not cost a thread).
    const int free_cores = n_cpus_ - static_cast<int>(std::floor(others + 0.4));
    const int fit = std::clamp(free_cores, 1, max_);
    if (fit < current_) {
        current_ = fit;
        pending_up_ = 0;
    } else if (fit > current_) {
        // Our own fewer threads leave room that looks free: move up once two looks agree.
        if (++pending_up_ >= 2) {
            current_ = fit;
            pending_up_ = 0;
        }
    } else {
        pending_up_ = 0;
    }
    return current_;
}

}  // namespace specdec
