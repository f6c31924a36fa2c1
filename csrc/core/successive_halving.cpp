#include "core/successive_halving.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace hydra::core {

SuccessiveHalving::SuccessiveHalving(int64_t min_steps, int64_t reduction_factor)
    : min_steps_(min_steps), reduction_factor_(reduction_factor) {
  if (min_steps < 1) {
    throw std::invalid_argument("SuccessiveHalving: min_steps must be >= 1, got " + std::to_string(min_steps));
  }
  if (reduction_factor < 2) {
    throw std::invalid_argument("SuccessiveHalving: reduction_factor must be >= 2, got " +
                                std::to_string(reduction_factor));
  }
}

std::vector<int64_t> SuccessiveHalving::rungs(int64_t total_steps) const {
  std::vector<int64_t> out;
  for (int64_t step = min_steps_; step < total_steps;) {
    out.push_back(step);
    if (step > std::numeric_limits<int64_t>::max() / reduction_factor_) break;
    step *= reduction_factor_;
  }
  return out;
}

RungDecision SuccessiveHalving::report(int rung, double metric) {
  if (rung < 0) throw std::invalid_argument("SuccessiveHalving: rung must be >= 0, got " + std::to_string(rung));
  const double value = std::isnan(metric) ? std::numeric_limits<double>::infinity() : metric;
  std::lock_guard lock(mutex_);
  if (results_.size() <= static_cast<size_t>(rung)) results_.resize(static_cast<size_t>(rung) + 1);
  std::vector<double>& results = results_[static_cast<size_t>(rung)];
  results.insert(std::upper_bound(results.begin(), results.end(), value), value);
  const auto competitors = static_cast<int64_t>(results.size());
  const int64_t kept = std::max<int64_t>(1, competitors / reduction_factor_);
  // Ties rank as the best of them: a task equal to the last kept result continues.
  const int64_t rank = (std::lower_bound(results.begin(), results.end(), value) - results.begin()) + 1;
  return RungDecision{rank <= kept, rung, rank, competitors, kept};
}

}  // namespace hydra::core
