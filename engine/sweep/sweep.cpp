#include "engine/sweep/sweep.hpp"

#include "engine/common/error.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/schema.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace dsrun {

namespace {

const char* to_string(Distribution d) {
  switch (d) {
    case Distribution::Values: return "values";
    case Distribution::Uniform: return "uniform";
    case Distribution::LogUniform: return "log_uniform";
    case Distribution::IntUniform: return "int_uniform";
  }
  return "values";
}

nlohmann::json scalar_json(const toml::node& n) {
  if (auto v = n.as_integer()) return v->get();
  if (auto v = n.as_floating_point()) return v->get();
  if (auto v = n.as_boolean()) return v->get();
  if (auto v = n.as_string()) return v->get();
  return nullptr;
}

// Reads the [sweep] table, reporting every problem with the file, line and key.
class SweepReader {
 public:
  explicit SweepReader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const toml::node* where, const std::string& key, const std::string& message, const std::string& hint) const {
    ErrorContext c;
    c.file = path_;
    if (where) {
      c.line = static_cast<int>(where->source().begin.line);
      c.column = static_cast<int>(where->source().begin.column);
    }
    c.key = key;
    c.hint = hint;
    throw Error(message, c);
  }

  void only_keys(const toml::table& t, const std::string& prefix, const std::vector<std::string>& known) const {
    for (auto&& [k, node] : t) {
      std::string name(k.str());
      if (std::find(known.begin(), known.end(), name) != known.end()) continue;
      std::string guess = nearest(name, known);
      fail(&node, prefix + name, "unknown key", guess.empty() ? "known keys: " + join(known, ", ") : "did you mean " + prefix + guess + "?");
    }
  }

  double number(const toml::node& n, const std::string& key) const {
    if (auto v = n.as_integer()) return static_cast<double>(v->get());
    if (auto v = n.as_floating_point()) return v->get();
    fail(&n, key, "expected a number", "write for example " + key.substr(key.rfind('.') + 1) + " = 0.5");
  }

  int64_t integer(const toml::node& n, const std::string& key, int64_t min) const {
    auto v = n.as_integer();
    if (!v) fail(&n, key, "expected an integer", "");
    if (v->get() < min) fail(&n, key, "must be at least " + std::to_string(min), "");
    return v->get();
  }

  std::string choice(const toml::node& n, const std::string& key, const std::vector<std::string>& choices) const {
    auto v = n.as_string();
    if (!v) fail(&n, key, "expected a string", "one of: " + join(choices, ", "));
    if (std::find(choices.begin(), choices.end(), v->get()) == choices.end()) {
      std::string guess = nearest(v->get(), choices);
      fail(&n, key, "\"" + v->get() + "\" is not one of " + join(choices, ", "), guess.empty() ? "" : "did you mean \"" + guess + "\"?");
    }
    return v->get();
  }

  void check_recipe_key(const toml::node* where, const std::string& key, const std::string& at) const {
    if (find_key_spec(key) || is_open_table_key(key)) return;
    std::vector<std::string> known;
    for (const auto& s : recipe_schema()) known.push_back(s.key);
    std::string guess = nearest(key, known);
    fail(where, at, "\"" + key + "\" is not a recipe key", guess.empty() ? "docs/recipe.md lists the keys" : "did you mean " + guess + "?");
  }

  SweepParameter parameter(const std::string& key, const toml::node& node) const {
    const std::string at = "sweep.parameters.\"" + key + "\"";
    check_recipe_key(&node, key, at);
    SweepParameter p;
    p.keys = {key};
    if (auto arr = node.as_array()) {  // shorthand: "optimizer.lr" = [1e-3, 3e-3]
      for (auto&& v : *arr) p.values.push_back(scalar_json(v));
      if (p.values.empty()) fail(&node, at, "no values", "give at least one value");
      return p;
    }
    const toml::table* t = node.as_table();
    if (!t) fail(&node, at, "expected a list of values or a table", "write values = [...] or min = ..., max = ..., distribution = \"log_uniform\"");
    only_keys(*t, at + ".", {"values", "min", "max", "distribution", "grid_points"});
    if (auto values = t->get("values")) {
      auto arr = values->as_array();
      if (!arr || arr->empty()) fail(values, at + ".values", "expected a non-empty list", "");
      for (auto&& v : *arr) {
        if (v.is_table() || v.is_array()) fail(&v, at + ".values", "values must be plain (numbers, strings, booleans)", "use [[sweep.paired]] for values that vary together");
        p.values.push_back(scalar_json(v));
      }
      return p;
    }
    const toml::node* min = t->get("min");
    const toml::node* max = t->get("max");
    if (!min || !max) fail(&node, at, "a range needs min and max (or give values)", "");
    p.min = number(*min, at + ".min");
    p.max = number(*max, at + ".max");
    std::string d = t->get("distribution") ? choice(*t->get("distribution"), at + ".distribution", {"uniform", "log_uniform", "int_uniform"}) : "uniform";
    p.distribution = d == "log_uniform" ? Distribution::LogUniform : d == "int_uniform" ? Distribution::IntUniform : Distribution::Uniform;
    if (!(p.min < p.max)) fail(max, at + ".max", "max must be greater than min", "");
    if (p.distribution == Distribution::LogUniform && p.min <= 0) fail(min, at + ".min", "log_uniform needs min > 0", "");
    if (p.distribution == Distribution::IntUniform && (p.min != std::floor(p.min) || p.max != std::floor(p.max)))
      fail(min, at, "int_uniform needs integer bounds", "");
    if (auto g = t->get("grid_points")) p.grid_points = static_cast<int>(integer(*g, at + ".grid_points", 2));
    return p;
  }

  SweepSpec read() const {
    toml::table root;
    try {
      root = toml::parse_file(path_);
    } catch (const toml::parse_error& e) {
      ErrorContext c;
      c.file = path_;
      c.line = static_cast<int>(e.source().begin.line);
      c.column = static_cast<int>(e.source().begin.column);
      throw Error(std::string(e.description()), c);
    }
    const toml::table* sweep = root["sweep"].as_table();
    if (!sweep) fail(nullptr, "sweep", "no [sweep] section", "add [sweep] with parameters and an objective (docs/sweeps.md)");
    only_keys(*sweep, "sweep.", {"method", "seed", "trials", "max_minutes", "concurrency", "objective", "parameters", "paired", "pruning", "tpe_startup"});
    SweepSpec s;
    s.path = path_;
    if (auto m = sweep->get("method")) {
      const std::string method = choice(*m, "sweep.method", {"grid", "random", "tpe"});
      s.method = method == "random" ? SweepMethod::Random : method == "tpe" ? SweepMethod::Tpe : SweepMethod::Grid;
    }
    if (auto n = sweep->get("seed")) s.seed = static_cast<uint64_t>(integer(*n, "sweep.seed", 0));
    if (auto n = sweep->get("trials")) s.max_trials = integer(*n, "sweep.trials", 1);
    if (auto n = sweep->get("max_minutes")) s.max_minutes = number(*n, "sweep.max_minutes");
    if (auto n = sweep->get("concurrency")) s.concurrency = static_cast<int>(integer(*n, "sweep.concurrency", 1));
    if (auto n = sweep->get("tpe_startup")) s.tpe_startup = static_cast<int>(integer(*n, "sweep.tpe_startup", 1));
    if (auto o = sweep->get("objective")) {
      const toml::table* t = o->as_table();
      if (!t) fail(o, "sweep.objective", "expected a table", "[sweep.objective] metric = \"val_loss\", goal = \"minimize\"");
      only_keys(*t, "sweep.objective.", {"metric", "goal", "target", "summary"});
      if (auto m = t->get("metric")) {
        if (!m->as_string()) fail(m, "sweep.objective.metric", "expected a metric name", "for example \"val_loss\" or \"tokens_per_second\"");
        s.metric = m->as_string()->get();
      }
      if (auto g = t->get("goal")) s.maximize = choice(*g, "sweep.objective.goal", {"minimize", "maximize"}) == "maximize";
      if (auto tg = t->get("target")) s.target = number(*tg, "sweep.objective.target");
      if (auto sm = t->get("summary")) s.summary = choice(*sm, "sweep.objective.summary", {"last", "best", "mean"});
    }
    if (auto params = sweep->get("parameters")) {
      const toml::table* t = params->as_table();
      if (!t) fail(params, "sweep.parameters", "expected a table of \"recipe.key\" = values", "");
      for (auto&& [k, node] : *t) s.parameters.push_back(parameter(std::string(k.str()), node));
    }
    if (auto paired = sweep->get("paired")) {
      const toml::array* groups = paired->as_array();
      if (!groups) fail(paired, "sweep.paired", "expected [[sweep.paired]] tables", "");
      for (auto&& g : *groups) {
        const toml::table* t = g.as_table();
        if (!t) fail(&g, "sweep.paired", "expected a table with keys and values", "");
        only_keys(*t, "sweep.paired.", {"keys", "values"});
        SweepParameter p;
        const toml::array* keys = t->get("keys") ? t->get("keys")->as_array() : nullptr;
        const toml::array* values = t->get("values") ? t->get("values")->as_array() : nullptr;
        if (!keys || keys->size() < 2) fail(&g, "sweep.paired.keys", "expected a list of at least two recipe keys", "");
        for (auto&& k : *keys) {
          if (!k.as_string()) fail(&k, "sweep.paired.keys", "expected a recipe key (string)", "");
          check_recipe_key(&k, k.as_string()->get(), "sweep.paired.keys");
          p.keys.push_back(k.as_string()->get());
        }
        if (!values || values->empty()) fail(&g, "sweep.paired.values", "expected a list of value lists", "");
        for (auto&& row : *values) {
          const toml::array* r = row.as_array();
          if (!r || r->size() != p.keys.size())
            fail(&row, "sweep.paired.values", "each entry must list " + std::to_string(p.keys.size()) + " values, one per key", "");
          nlohmann::json tuple = nlohmann::json::array();
          for (auto&& v : *r) tuple.push_back(scalar_json(v));
          p.values.push_back(tuple);
        }
        s.parameters.push_back(p);
      }
    }
    if (s.parameters.empty()) fail(sweep, "sweep.parameters", "the sweep has no parameters", "add [sweep.parameters] \"optimizer.lr\" = [1e-3, 3e-3]");
    for (size_t i = 0; i < s.parameters.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        for (const auto& k : s.parameters[i].keys)
          if (std::find(s.parameters[j].keys.begin(), s.parameters[j].keys.end(), k) != s.parameters[j].keys.end())
            fail(sweep, "sweep.parameters", "\"" + k + "\" is swept twice", "sweep each key once");
    if (s.method == SweepMethod::Grid && grid_size(s) < 0)
      fail(sweep->get("parameters"), "sweep.parameters", "a grid over a range needs grid_points", "add grid_points = N, or use method = \"random\"");
    if (s.method != SweepMethod::Grid && s.max_trials == 0)
      fail(sweep, "sweep.trials", "random and TPE sweeps need a number of trials", "add trials = 20");
    if (auto p = sweep->get("pruning")) {
      const toml::table* t = p->as_table();
      if (!t) fail(p, "sweep.pruning", "expected a table", "");
      only_keys(*t, "sweep.pruning.", {"method", "grace_steps", "reduction_factor", "min_trials"});
      if (auto m = t->get("method")) {
        const std::string method = choice(*m, "sweep.pruning.method", {"none", "median", "asha"});
        s.pruning.method = method == "median" ? PruneMethod::Median : method == "asha" ? PruneMethod::Asha : PruneMethod::None;
      }
      if (auto g = t->get("grace_steps")) s.pruning.grace_steps = integer(*g, "sweep.pruning.grace_steps", 1);
      if (auto r = t->get("reduction_factor")) {
        s.pruning.reduction_factor = number(*r, "sweep.pruning.reduction_factor");
        if (s.pruning.reduction_factor < 2) fail(r, "sweep.pruning.reduction_factor", "must be at least 2", "3 keeps the top third at each rung");
      }
      if (auto m = t->get("min_trials")) s.pruning.min_trials = static_cast<int>(integer(*m, "sweep.pruning.min_trials", 1));
    }
    return s;
  }

 private:
  std::string path_;
};

// One uniform draw per (seed, index, dimension): resumable and independent of the order of trials.
std::mt19937_64 trial_rng(uint64_t seed, int64_t index, uint64_t salt) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(index), static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32),
                    static_cast<uint32_t>(salt)};
  return std::mt19937_64(seq);
}

void assign(TrialParams& out, const SweepParameter& p, const nlohmann::json& value) {
  if (p.keys.size() == 1) {
    out[p.keys[0]] = value;
    return;
  }
  for (size_t k = 0; k < p.keys.size(); ++k) out[p.keys[k]] = value[k];
}

nlohmann::json range_value(const SweepParameter& p, double t) {  // t in [0, 1] along the range
  if (p.distribution != Distribution::IntUniform && (t <= 0 || t >= 1)) return t <= 0 ? p.min : p.max;  // the ends exactly
  if (p.distribution == Distribution::LogUniform) return std::exp(std::log(p.min) + t * (std::log(p.max) - std::log(p.min)));
  if (p.distribution == Distribution::IntUniform) return static_cast<int64_t>(std::llround(p.min + t * (p.max - p.min)));
  return p.min + t * (p.max - p.min);
}

// Where a parameter lives for TPE: categories by index, ranges in [lo, hi] (log space for log_uniform).
double to_model_space(const SweepParameter& p, double x) { return p.distribution == Distribution::LogUniform ? std::log(x) : x; }

nlohmann::json sample_dimension(const SweepParameter& p, std::mt19937_64& rng) {
  if (p.distribution == Distribution::Values) return p.values[std::uniform_int_distribution<size_t>(0, p.values.size() - 1)(rng)];
  if (p.distribution == Distribution::IntUniform) return std::uniform_int_distribution<int64_t>(static_cast<int64_t>(p.min), static_cast<int64_t>(p.max))(rng);
  return range_value(p, std::uniform_real_distribution<double>(0.0, 1.0)(rng));
}

// The value of parameter p in a trial: a scalar, or for paired keys the tuple.
nlohmann::json value_of(const SweepParameter& p, const TrialParams& t) {
  if (p.keys.size() == 1) return t.count(p.keys[0]) ? t.at(p.keys[0]) : nlohmann::json();
  nlohmann::json tuple = nlohmann::json::array();
  for (const auto& k : p.keys) tuple.push_back(t.count(k) ? t.at(k) : nlohmann::json());
  return tuple;
}

// A Parzen estimator in one dimension: Gaussian kernels at the observations plus a wide prior.
struct Parzen {
  std::vector<double> centers, sigmas;
  double lo = 0, hi = 1;
  // Bandwidths as in Hyperopt: each kernel as wide as the larger gap to its neighbours (the range
  // ends count as neighbours), clipped to [width / min(100, n + 1), width].
  Parzen(std::vector<double> points, double lo_, double hi_) : lo(lo_), hi(hi_) {
    const double width = hi - lo;
    std::sort(points.begin(), points.end());
    const double narrowest = width / std::min(100.0, static_cast<double>(points.size() + 1));
    for (size_t i = 0; i < points.size(); ++i) {
      const double left = points[i] - (i > 0 ? points[i - 1] : lo);
      const double right = (i + 1 < points.size() ? points[i + 1] : hi) - points[i];
      centers.push_back(points[i]);
      sigmas.push_back(std::clamp(std::max(left, right), narrowest, width));
    }
    centers.push_back((lo + hi) / 2);  // the prior: the whole range, weighted like one observation
    sigmas.push_back(width);
  }
  double density(double x) const {
    double d = 0;
    for (size_t i = 0; i < centers.size(); ++i) {
      const double z = (x - centers[i]) / sigmas[i];
      d += std::exp(-0.5 * z * z) / sigmas[i];
    }
    return d / static_cast<double>(centers.size());
  }
  double sample(std::mt19937_64& rng) const {
    const size_t i = std::uniform_int_distribution<size_t>(0, centers.size() - 1)(rng);
    for (int attempt = 0; attempt < 100; ++attempt) {
      const double x = std::normal_distribution<double>(centers[i], sigmas[i])(rng);
      if (x >= lo && x <= hi) return x;
    }
    return std::clamp(centers[i], lo, hi);
  }
};

}  // namespace

SweepSpec load_sweep_spec(const std::string& path) { return SweepReader(path).read(); }

nlohmann::json sweep_spec_to_json(const SweepSpec& s) {
  nlohmann::json params = nlohmann::json::array();
  for (const auto& p : s.parameters)
    params.push_back({{"keys", p.keys}, {"distribution", to_string(p.distribution)}, {"values", p.values}, {"min", p.min}, {"max", p.max}, {"grid_points", p.grid_points}});
  const char* methods[] = {"grid", "random", "tpe"};
  const char* prunes[] = {"none", "median", "asha"};
  return {{"path", s.path}, {"method", methods[static_cast<int>(s.method)]}, {"seed", s.seed}, {"trials", s.max_trials},
          {"max_minutes", s.max_minutes}, {"concurrency", s.concurrency}, {"metric", s.metric}, {"maximize", s.maximize},
          {"target", s.target ? nlohmann::json(*s.target) : nlohmann::json()}, {"summary", s.summary}, {"tpe_startup", s.tpe_startup},
          {"parameters", params},
          {"pruning", {{"method", prunes[static_cast<int>(s.pruning.method)]}, {"grace_steps", s.pruning.grace_steps},
                       {"reduction_factor", s.pruning.reduction_factor}, {"min_trials", s.pruning.min_trials}}}};
}

SweepSpec sweep_spec_from_json(const nlohmann::json& j) {
  SweepSpec s;
  s.path = j.at("path");
  const std::string method = j.at("method");
  s.method = method == "random" ? SweepMethod::Random : method == "tpe" ? SweepMethod::Tpe : SweepMethod::Grid;
  s.seed = j.at("seed");
  s.max_trials = j.at("trials");
  s.max_minutes = j.at("max_minutes");
  s.concurrency = j.at("concurrency");
  s.metric = j.at("metric");
  s.maximize = j.at("maximize");
  if (!j.at("target").is_null()) s.target = j.at("target").get<double>();
  s.summary = j.at("summary");
  s.tpe_startup = j.at("tpe_startup");
  for (const auto& p : j.at("parameters")) {
    SweepParameter q;
    q.keys = p.at("keys").get<std::vector<std::string>>();
    const std::string d = p.at("distribution");
    q.distribution = d == "uniform" ? Distribution::Uniform : d == "log_uniform" ? Distribution::LogUniform : d == "int_uniform" ? Distribution::IntUniform : Distribution::Values;
    q.values = p.at("values").get<std::vector<nlohmann::json>>();
    q.min = p.at("min");
    q.max = p.at("max");
    q.grid_points = p.at("grid_points");
    s.parameters.push_back(q);
  }
  const auto& pr = j.at("pruning");
  const std::string pm = pr.at("method");
  s.pruning.method = pm == "median" ? PruneMethod::Median : pm == "asha" ? PruneMethod::Asha : PruneMethod::None;
  s.pruning.grace_steps = pr.at("grace_steps");
  s.pruning.reduction_factor = pr.at("reduction_factor");
  s.pruning.min_trials = pr.at("min_trials");
  return s;
}

int64_t grid_size(const SweepSpec& spec) {
  int64_t n = 1;
  for (const auto& p : spec.parameters) {
    const int64_t k = p.distribution == Distribution::Values ? static_cast<int64_t>(p.values.size()) : p.grid_points;
    if (k <= 0) return -1;
    n *= k;
  }
  return n;
}

TrialParams grid_trial(const SweepSpec& spec, int64_t index) {
  TrialParams out;
  // Mixed radix, the last parameter varying fastest.
  for (auto it = spec.parameters.rbegin(); it != spec.parameters.rend(); ++it) {
    const SweepParameter& p = *it;
    const int64_t k = p.distribution == Distribution::Values ? static_cast<int64_t>(p.values.size()) : p.grid_points;
    const int64_t i = index % k;
    index /= k;
    assign(out, p, p.distribution == Distribution::Values ? p.values[static_cast<size_t>(i)] : range_value(p, static_cast<double>(i) / static_cast<double>(k - 1)));
  }
  return out;
}

TrialParams random_trial(const SweepSpec& spec, int64_t index) {
  TrialParams out;
  for (size_t d = 0; d < spec.parameters.size(); ++d) {
    std::mt19937_64 rng = trial_rng(spec.seed, index, d);
    assign(out, spec.parameters[d], sample_dimension(spec.parameters[d], rng));
  }
  return out;
}

TrialParams tpe_trial(const SweepSpec& spec, int64_t index, const std::vector<TrialOutcome>& finished) {
  if (static_cast<int>(finished.size()) < spec.tpe_startup) return random_trial(spec, index);
  std::vector<const TrialOutcome*> order;
  for (const auto& f : finished) order.push_back(&f);
  std::stable_sort(order.begin(), order.end(), [&](const TrialOutcome* a, const TrialOutcome* b) {
    return spec.maximize ? a->objective > b->objective : a->objective < b->objective;
  });
  const size_t n_good = std::max<size_t>(1, static_cast<size_t>(std::ceil(0.25 * static_cast<double>(order.size()))));
  TrialParams out;
  for (size_t d = 0; d < spec.parameters.size(); ++d) {
    const SweepParameter& p = spec.parameters[d];
    std::mt19937_64 rng = trial_rng(spec.seed, index, 1000 + d);
    if (p.distribution == Distribution::Values) {
      // Categories: counts in the good and bad groups, each with a prior of one.
      std::vector<double> good(p.values.size(), 1.0), bad(p.values.size(), 1.0);
      for (size_t i = 0; i < order.size(); ++i) {
        const nlohmann::json v = value_of(p, order[i]->params);
        for (size_t c = 0; c < p.values.size(); ++c)
          if (p.values[c] == v) (i < n_good ? good : bad)[c] += 1;
      }
      std::discrete_distribution<size_t> draw(good.begin(), good.end());
      double sum_good = 0, sum_bad = 0;
      for (double g : good) sum_good += g;
      for (double b : bad) sum_bad += b;
      size_t best = draw(rng);
      for (int c = 0; c < 24; ++c) {
        const size_t x = draw(rng);
        if (good[x] / sum_good / (bad[x] / sum_bad) > good[best] / sum_good / (bad[best] / sum_bad)) best = x;
      }
      assign(out, p, p.values[best]);
      continue;
    }
    const double lo = to_model_space(p, p.min), hi = to_model_space(p, p.max);
    std::vector<double> good_points, bad_points;
    for (size_t i = 0; i < order.size(); ++i) {
      const nlohmann::json v = value_of(p, order[i]->params);
      if (!v.is_number()) continue;
      (i < n_good ? good_points : bad_points).push_back(to_model_space(p, v.get<double>()));
    }
    Parzen l(good_points, lo, hi), g(bad_points, lo, hi);
    double best = l.sample(rng), best_ratio = l.density(best) / g.density(best);
    for (int c = 1; c < 24; ++c) {
      const double x = l.sample(rng), ratio = l.density(x) / g.density(x);
      if (ratio > best_ratio) {
        best = x;
        best_ratio = ratio;
      }
    }
    const double x = p.distribution == Distribution::LogUniform ? std::exp(best) : best;
    assign(out, p, p.distribution == Distribution::IntUniform ? nlohmann::json(static_cast<int64_t>(std::llround(x))) : nlohmann::json(x));
  }
  return out;
}

TrialParams next_trial(const SweepSpec& spec, int64_t index, const std::vector<TrialOutcome>& finished) {
  switch (spec.method) {
    case SweepMethod::Grid: return grid_trial(spec, index);
    case SweepMethod::Random: return random_trial(spec, index);
    case SweepMethod::Tpe: return tpe_trial(spec, index, finished);
  }
  return {};
}

int64_t trial_budget(const SweepSpec& spec) {
  if (spec.method != SweepMethod::Grid) return spec.max_trials;
  const int64_t all = grid_size(spec);
  return spec.max_trials > 0 ? std::min(all, spec.max_trials) : all;
}

std::vector<std::string> trial_overrides(const TrialParams& params) {
  std::vector<std::string> out;
  for (const auto& [key, v] : params) {
    std::string text;
    if (v.is_string()) text = v.dump();  // a JSON string is a TOML basic string
    else if (v.is_boolean()) text = v.get<bool>() ? "true" : "false";
    else if (v.is_number_integer()) text = std::to_string(v.get<int64_t>());
    else text = v.dump();  // the shortest text that reads back as the same double
    out.push_back(key + "=" + text);
  }
  return out;
}

std::string describe_params(const TrialParams& params) {
  std::vector<std::string> parts;
  for (const auto& [key, v] : params) parts.push_back(key + "=" + (v.is_string() ? v.get<std::string>() : v.is_number_float() ? format_double(v.get<double>(), 4) : v.dump()));
  return join(parts, " ");
}

std::optional<double> summarize_curve(const Curve& curve, const std::string& summary, bool maximize) {
  if (curve.empty()) return std::nullopt;
  if (summary == "last") return curve.back().second;
  double acc = summary == "mean" ? 0.0 : curve.front().second;
  for (const auto& [step, v] : curve) {
    if (summary == "mean") acc += v;
    else acc = maximize ? std::max(acc, v) : std::min(acc, v);
  }
  return summary == "mean" ? acc / static_cast<double>(curve.size()) : acc;
}

namespace {

// The best value of a curve at or before `step`; nullopt if it has none there.
std::optional<double> best_until(const Curve& c, int64_t step, bool maximize) {
  std::optional<double> best;
  for (const auto& [s, v] : c) {
    if (s > step) break;
    if (!best || (maximize ? v > *best : v < *best)) best = v;
  }
  return best;
}

std::string number_text(double v) { return format_double(v, 4); }

}  // namespace

std::optional<std::string> prune_reason(const PruningSpec& p, bool maximize, const Curve& trial, const std::vector<Curve>& others) {
  if (p.method == PruneMethod::None || trial.empty()) return std::nullopt;
  const int64_t at = trial.back().first;
  if (at < p.grace_steps) return std::nullopt;
  auto worse = [&](double a, double b) { return maximize ? a < b : a > b; };
  if (p.method == PruneMethod::Median) {
    const double mine = *best_until(trial, at, maximize);
    std::vector<double> theirs;
    for (const auto& o : others)
      if (!o.empty() && o.back().first >= at)
        if (auto v = best_until(o, at, maximize)) theirs.push_back(*v);
    if (static_cast<int>(theirs.size()) < p.min_trials) return std::nullopt;
    std::sort(theirs.begin(), theirs.end());
    const size_t n = theirs.size();
    const double median = n % 2 ? theirs[n / 2] : (theirs[n / 2 - 1] + theirs[n / 2]) / 2;
    if (!worse(mine, median)) return std::nullopt;
    return "median stopping: best " + number_text(mine) + " by step " + std::to_string(at) + " is worse than the median " + number_text(median) + " of " +
           std::to_string(n) + " trials by that step";
  }
  // ASHA: rungs at grace · factor^k; a trial must be in the top 1/factor of those that reached a rung.
  for (double rung = static_cast<double>(p.grace_steps); rung <= static_cast<double>(at); rung *= p.reduction_factor) {
    const int64_t r = static_cast<int64_t>(rung);
    const double mine = *best_until(trial, r, maximize);
    std::vector<double> values{mine};
    for (const auto& o : others)
      if (!o.empty() && o.back().first >= r)
        if (auto v = best_until(o, r, maximize)) values.push_back(*v);
    if (static_cast<double>(values.size()) < p.reduction_factor) continue;  // too few to rank yet
    std::sort(values.begin(), values.end(), [&](double a, double b) { return worse(b, a); });  // best first
    const size_t keep = static_cast<size_t>(std::floor(static_cast<double>(values.size()) / p.reduction_factor));
    if (keep == 0 || !worse(mine, values[keep - 1])) continue;
    return "ASHA: at rung step " + std::to_string(r) + ", " + number_text(mine) + " is not in the top " + std::to_string(keep) + " of " +
           std::to_string(values.size()) + " trials (reduction factor " + number_text(p.reduction_factor) + ")";
  }
  return std::nullopt;
}

}  // namespace dsrun
