#include <Eigen/Core>
#include <thread>
#include <vector>

#include "probes.hpp"

struct GemmProbe::State {
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::vector<Matrix> a, b, c;
  double flops = 0.0;
};

GemmProbe::GemmProbe(unsigned threads, size_t rows, size_t inner, size_t cols) : state_(std::make_unique<State>()) {
  for (unsigned t = 0; t < threads; ++t) {
    state_->a.push_back(State::Matrix::Random(Eigen::Index(rows), Eigen::Index(inner)));
    state_->b.push_back(State::Matrix::Random(Eigen::Index(inner), Eigen::Index(cols)));
    state_->c.push_back(State::Matrix::Zero(Eigen::Index(rows), Eigen::Index(cols)));
  }
  state_->flops = 2.0 * double(rows) * double(inner) * double(cols) * threads;
}

GemmProbe::~GemmProbe() = default;

void GemmProbe::run() {
  const auto multiply = [this](size_t t) { state_->c[t].noalias() = state_->a[t] * state_->b[t]; };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < state_->a.size(); ++t) pool.emplace_back(multiply, t);
  multiply(0);
  for (std::thread &t : pool) t.join();
}

double GemmProbe::flops() const { return state_->flops; }
