#include "bench/profile.h"

#include <cstdio>
#include <map>
#include <numeric>
#include <string>
#include <utility>

#include "core/error.h"

namespace dflash::bench {

namespace {

using Key = std::pair<target::ForwardOp, target::GemmShape>;

std::string fmt(const char* f, auto... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

std::string gemm_suffix(const target::GemmShape& g) {
  std::string s = " M" + std::to_string(g.M) + " N" + std::to_string(g.N) + " K" + std::to_string(g.K);
  if (g.ldx != g.K || g.ldy != g.N) s += " ldx" + std::to_string(g.ldx) + " ldy" + std::to_string(g.ldy);
  return s;
}

}  // namespace

ProfileSummary summarize_profile(const std::vector<target::OpProfile>& forwards, double reference_ms) {
  DFLASH_CHECK(!forwards.empty(), "profile: no profiled forward to summarize");
  ProfileSummary s;
  s.forwards = static_cast<int>(forwards.size());
  const double n = static_cast<double>(forwards.size());
  // Per key: per-forward totals (one slot per forward, zero where a forward lacks the op) and calls.
  std::map<Key, std::vector<double>> totals;
  std::map<Key, std::vector<double>> calls_us;
  for (size_t f = 0; f < forwards.size(); ++f) {
    DFLASH_CHECK(!forwards[f].ops.empty(), "profile: forward " << f << " recorded no op");
    s.span_ms += forwards[f].span_ms / n;
    for (const target::OpRecord& r : forwards[f].ops) {
      const Key k{r.op, target::forward_op_is_gemm(r.op) ? r.gemm : target::GemmShape{}};
      auto& t = totals[k];
      t.resize(forwards.size(), 0.0);
      t[f] += r.ms;
      calls_us[k].push_back(r.ms * 1e3);
    }
  }
  s.reference_ms = reference_ms > 0 ? reference_ms : s.span_ms;
  for (auto& [k, t] : totals) {
    OpSummary o;
    o.op = k.first;
    o.gemm = k.second;
    const std::vector<double>& c = calls_us[k];
    o.calls_per_forward = static_cast<double>(c.size()) / n;
    o.per_forward_ms = summarize(t, {}, 0);
    o.ms_per_forward = std::accumulate(t.begin(), t.end(), 0.0) / n;
    o.share = o.ms_per_forward / s.reference_ms;
    o.call_us = summarize(c, {}, 0);
    o.mean_us = std::accumulate(c.begin(), c.end(), 0.0) / static_cast<double>(c.size());
    s.ops_ms += o.ms_per_forward;
    if (o.is_gemm()) s.gemm_ms += o.ms_per_forward;
    s.ops.push_back(std::move(o));
  }
  return s;
}

std::string profile_table(const ProfileSummary& s) {
  std::string out = fmt("%-15s %6s %9s %7s %9s %9s %6s %6s %6s %8s %9s %6s %9s\n", "op", "calls", "ms/fwd", "share",
                        "mean us", "p50 us", "M", "N", "K", "TFLOP/s", "alone us", "ratio", "excess ms");
  double excess = 0;
  std::string slow;
  for (const OpSummary& o : s.ops) {
    out += fmt("%-15s %6.0f %9.2f %6.1f%% %9.1f %9.1f", std::string(target::forward_op_name(o.op)).c_str(),
               o.calls_per_forward, o.ms_per_forward, 100.0 * o.share, o.mean_us, o.call_us.p50);
    if (o.is_gemm()) {
      out += fmt(" %6lld %6lld %6lld %8.1f", static_cast<long long>(o.gemm.M), static_cast<long long>(o.gemm.N),
                 static_cast<long long>(o.gemm.K), o.tflops());
      if (o.isolated_us.p50 > 0) {
        out += fmt(" %9.1f %6.3f %9.2f%s", o.isolated_us.p50, o.ratio(), o.excess_ms_per_forward(),
                   o.slow() ? "  SLOW (>5%)" : "");
        excess += o.excess_ms_per_forward();
        if (o.slow()) slow += fmt(" %s (%.3f)", std::string(target::forward_op_name(o.op)).c_str(), o.ratio());
      }
    }
    out += "\n";
  }
  out += fmt("%-15s %6s %9.2f %6.1f%%   (GEMMs %.2f ms = %.1f%%, other ops %.2f ms = %.1f%%)\n", "sum of ops", "",
             s.ops_ms, 100.0 * s.ops_ms / s.reference_ms, s.gemm_ms, 100.0 * s.gemm_ms / s.reference_ms,
             s.ops_ms - s.gemm_ms, 100.0 * (s.ops_ms - s.gemm_ms) / s.reference_ms);
  out += fmt("%-15s %6s %9.2f %6.1f%%   (profiled span - sum of ops: launch gaps, event overhead)\n", "between ops", "",
             s.gaps_ms(), 100.0 * s.gaps_ms() / s.reference_ms);
  out += fmt("%-15s %6s %9.2f %6.1f%%   (first op start .. last op end; plain forward p50 %.2f ms, profiling %+.2f ms)\n",
             "profiled span", "", s.span_ms, 100.0 * s.span_ms / s.reference_ms, s.reference_ms,
             s.span_ms - s.reference_ms);
  out += fmt("GEMMs slower in the forward than alone by more than 5%%:%s; excess over alone %.2f ms per forward\n",
             slow.empty() ? " none" : slow.c_str(), excess);
  return out;
}

std::vector<Row> profile_rows(const ProfileSummary& s, const std::string& mode, const std::string& shape) {
  std::vector<Row> rows;
  auto add = [&](const std::string& kernel, const std::string& sh, const std::string& metric, const std::string& unit,
                 double p50, double p20, double p80) {
    rows.push_back({"target_bench", "forward/" + kernel, "dflash", mode, metric, unit, sh, p50, p20, p80, false});
  };
  for (const OpSummary& o : s.ops) {
    const std::string name(target::forward_op_name(o.op));
    const std::string sh = o.is_gemm() ? shape + gemm_suffix(o.gemm) : shape;
    add(name, sh, "time_per_forward", "ms", o.per_forward_ms.p50, o.per_forward_ms.p20, o.per_forward_ms.p80);
    add(name, sh, "share", "%", 100.0 * o.share, 100.0 * o.share, 100.0 * o.share);
    add(name, sh, "calls", "count", o.calls_per_forward, o.calls_per_forward, o.calls_per_forward);
    add(name, sh, "time_per_call", "us", o.call_us.p50, o.call_us.p20, o.call_us.p80);
    if (!o.is_gemm()) continue;
    // Higher percentiles of time are lower throughput.
    auto tf = [&](double us) { return us > 0 ? o.gemm.flops() / (us * 1e-6) / 1e12 : 0.0; };
    add(name, sh, "achieved", "TFLOP/s", tf(o.call_us.p50), tf(o.call_us.p80), tf(o.call_us.p20));
    if (o.isolated_us.p50 <= 0) continue;
    add(name, sh, "isolated_time_per_call", "us", o.isolated_us.p50, o.isolated_us.p20, o.isolated_us.p80);
    add(name, sh, "in_forward_over_isolated", "x", o.ratio(), o.call_us.p20 / o.isolated_us.p50,
        o.call_us.p80 / o.isolated_us.p50);
    rows.back().noisy = o.isolated_us.noisy;
  }
  add("total", shape, "ops", "ms", s.ops_ms, s.ops_ms, s.ops_ms);
  add("total", shape, "gemms", "ms", s.gemm_ms, s.gemm_ms, s.gemm_ms);
  add("total", shape, "span", "ms", s.span_ms, s.span_ms, s.span_ms);
  add("total", shape, "gaps", "ms", s.gaps_ms(), s.gaps_ms(), s.gaps_ms());
  add("total", shape, "reference", "ms", s.reference_ms, s.reference_ms, s.reference_ms);
  return rows;
}

}  // namespace dflash::bench
