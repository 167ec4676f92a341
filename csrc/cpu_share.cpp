#include "cpu_share.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace specdec {
namespace {

std::vector<bool> affinity_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    std::vector<bool> cpus;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
        if (CPU_ISSET(cpu, &set)) {
            cpus.resize(static_cast<size_t>(cpu) + 1, false);
            cpus[static_cast<size_t>(cpu)] = true;
        }
    return cpus;
}

// cgroup v2's cpu.max: "QUOTA PERIOD", or "max PERIOD" for none; 0 when there is none.
int cgroup_cpu_quota() {
    std::ifstream file("/sys/fs/cgroup/cpu.max");
    std::string quota;
    long long period = 0;
    if (!(file >> quota >> period) || quota == "max" || period <= 0) return 0;
    const long long q = std::atoll(quota.c_str());
    return q > 0 ? static_cast<int>((q + period - 1) / period) : 0;
}

// The utime + stime of this process, in clock ticks; -1 when unreadable.
long long own_ticks() {
    // Fields 14 and 15; the command (field 2) may hold spaces, so count from its ')'.
    std::ifstream self_stat("/proc/self/stat");
    std::string line;
    std::getline(self_stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos || close + 2 > line.size()) return -1;
    std::istringstream rest(line.substr(close + 2));
    std::string field;
    long long ticks = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i)
        if (i == 14 || i == 15) ticks += std::atoll(field.c_str());
    return ticks;
}

}  // namespace

int usable_cores() {
    const std::vector<bool> cpus = affinity_cpus();
    int n = static_cast<int>(std::count(cpus.begin(), cpus.end(), true));
    if (n == 0) n = static_cast<int>(std::thread::hardware_concurrency());
    const int quota = cgroup_cpu_quota();
    if (quota > 0) n = std::min(n, quota);
    return std::max(1, n);
}

ThreadGovernor::ThreadGovernor(int max, bool enabled)
    : max_(std::max(1, max)),
      enabled_(enabled),
      current_(max_),
      allowed_(affinity_cpus()),
      last_look_(std::chrono::steady_clock::now()) {
    n_allowed_ = std::max(1, static_cast<int>(std::count(allowed_.begin(), allowed_.end(), true)));
    if (enabled_) last_ = read_sample();
}

ThreadGovernor::Sample ThreadGovernor::read_sample() const {
    Sample s;
    std::ifstream stat("/proc/stat");
    std::string line;
    while (std::getline(stat, line)) {
        if (line.compare(0, 3, "cpu") != 0) break;        // the cpu lines come first
        if (line.size() < 4 || line[3] == ' ') continue;  // the all-CPU line
        std::istringstream in(line.substr(3));
        size_t cpu = 0;
        long long user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0,
                  steal = 0;
        if (!(in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal))
            return s;
        if (cpu >= allowed_.size() || !allowed_[cpu]) continue;
        const long long busy = user + nice + system + irq + softirq + steal;
        s.busy += busy;
        s.total += busy + idle + iowait;
    }
    s.self = own_ticks();
    s.ok = s.total > 0 && s.self >= 0;
    return s;
}

double ThreadGovernor::others_busy(const Sample& now) const {
    const long long total = now.total - last_.total;
    if (total <= 0) return 0.0;
    const double others = static_cast<double>(now.busy - last_.busy - (now.self - last_.self));
    // total counts the ticks of every allowed CPU: per CPU, the interval is total / n ticks.
    return std::max(0.0, others * n_allowed_ / static_cast<double>(total));
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
    const int free_cores = n_allowed_ - static_cast<int>(std::floor(others + 0.4));
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
