// SPDX-License-Identifier: Apache-2.0
// The structured synthetic Q/K/V generator (generator.h). docs/generator.md is the recipe this
// file implements; the Python copy there reproduces every output bit.
#include "sparseprefill/generator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace sparseprefill {

std::uint64_t splitmix64(std::uint64_t* state) {
  std::uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {

// Bit reproducibility across compilers and Python rests on one invariant: every product that
// feeds an addition or subtraction is exact in double (dyadic operands with few significant
// bits), so contracting a*b+c into an FMA cannot change a result. Products that may round
// (amplitudes) are only ever passed to std::nearbyint through to_grid().

// Stream tags: each tensor / parameter set draws from its own splitmix64 stream.
enum StreamTag : std::uint64_t {
  kTagQueryHead = 1,  // per query head: kind, weights, noise scale, slash offset
  kTagKvHead = 2,     // per KV head: number of sink keys
  kTagStripes = 3,    // per (batch, KV head): stripe positions, widths, channels, strengths
  kTagQNoise = 4,     // per (batch, query head)
  kTagQMod = 5,       // per (batch, query head): per-query sink and stripe factors
  kTagKNoise = 6,     // per (batch, KV head)
  kTagVNoise = 7,     // per (batch, KV head)
};

constexpr double kScore = 12.0;          // score (natural log units) of a unit-weight component
constexpr double kStripeShare = 0.75;    // stripes score lower: mean pooling dilutes narrow ones
constexpr double kKeyAmplitude = 8.0;    // K's value on a structured channel at full strength
constexpr double kSplineSelf = 0.55;     // nominal sum of squared spline weights
constexpr double kFeatureNoise = 0.125;  // noise scale on structured channels (keeps cross
                                         // talk between amplitudes and noise small)
constexpr double kGrid = 1048576.0;      // structured terms are multiples of 2^-20
constexpr int kMaxStripeChannels = 4;
constexpr int kStripeSpacing = 1024;  // one stripe per this many keys

std::uint64_t derive(std::uint64_t s, std::uint64_t x) {
  std::uint64_t state = s + x;
  return splitmix64(&state);
}

std::uint64_t stream_key(std::uint64_t seed, std::uint64_t tag, std::uint64_t a, std::uint64_t b) {
  return derive(derive(derive(seed, tag), a), b);
}

// The n-th value of the stream `key` (random access: splitmix64's state advances by a
// constant, so the n-th state is key + n·γ).
std::uint64_t draw(std::uint64_t key, std::uint64_t n) {
  std::uint64_t state = key + n * 0x9E3779B97F4A7C15ull;
  return splitmix64(&state);
}

// A uniform in (0, 1): an odd multiple of 2^-21 from the top 20 bits.
double to_uniform(std::uint64_t x) {
  return (static_cast<double>(x >> 44) + 0.5) * (1.0 / 1048576.0);
}

double uniform(std::uint64_t key, std::uint64_t n) { return to_uniform(draw(key, n)); }

// Irwin–Hall "normal": 2·(u0 + u1 + u2 - 1.5), mean 0, variance 1, range (-3, 3). The sum of
// three odd multiples of 2^-21 is odd, so the result is an odd multiple of 2^-20: never 0.
double normal(std::uint64_t key, std::uint64_t n) {
  const double s = uniform(key, n) + uniform(key, n + 1) + uniform(key, n + 2);
  return (s - 1.5) * 2.0;
}

// Rounds a structured term to a multiple of 2^-20. Noise on structured channels is an odd
// multiple of 2^-23, so noise + terms is never 0, and all sums below are exact.
double to_grid(double x) { return std::nearbyint(x * kGrid) * (1.0 / kGrid); }

// Quadratic B-spline position features: position x lies in cell c = floor(x / w) at phase
// phi = (x mod w) / w and puts weights (1-phi)²/2, 1/2 + phi(1-phi), phi²/2 on codes c, c+1,
// c+2. Code c is position channel c; w is chosen so that every code of a sequence has its own
// channel, hence q·k of two position features is exactly 0 beyond 3w apart.
struct Spline {
  std::int64_t cell = 0;
  double weight[3] = {};
};

Spline spline_at(std::int64_t x, int w_log2) {
  Spline s;
  s.cell = x >> w_log2;  // x >= 0
  const std::int64_t j = x - (s.cell << w_log2);
  const double phi = static_cast<double>(j) * std::ldexp(1.0, -w_log2);
  const double r = 1.0 - phi;
  s.weight[0] = r * r * 0.5;
  s.weight[1] = phi * r + 0.5;
  s.weight[2] = phi * phi * 0.5;
  return s;
}

// Where each kind of structure lives among the d channels.
struct Layout {
  int sink = 0;          // channel 0
  int stripe_first = 1;  // stripe channels 1 .. stripes
  int stripes = 0;
  int position_first = 0;  // position channels
  int positions = 0;       // m
  int features_end = 0;    // channels >= this carry noise only
  int w_log2 = 0;          // spline cell width 2^w_log2
};

Layout make_layout(int d, int seq_k) {
  Layout l;
  l.stripes = std::min(kMaxStripeChannels, d / 16);
  l.position_first = 1 + l.stripes;
  l.positions = d / 2;
  l.features_end = l.position_first + l.positions;
  // Smallest w = 2^k with (m - 3)·w >= seq_k: codes of positions 0 .. seq_k-1 plus the two
  // trailing codes of the last cell never wrap around the m channels.
  const std::int64_t cells = std::max(1, l.positions - 3);
  while ((cells << l.w_log2) < seq_k) ++l.w_log2;
  return l;
}

enum HeadKind : int { kSinkHead = 0, kLocalHead = 1, kStripeHead = 2, kSlashHead = 3 };

// Per query head: the score each component adds at full strength, and its noise scale.
struct QueryHead {
  double sink_score = 0, local_score = 0, stripe_score = 0, slash_score = 0;
  double noise = 1.0;  // 1, 1.25, 1.5 or 1.75: how diffuse the head is
  std::int64_t slash_offset = 0;
};

QueryHead make_query_head(std::uint64_t model, int h, const Layout& layout, int seq_k,
                          double peakedness) {
  const std::uint64_t key = stream_key(model, kTagQueryHead, static_cast<std::uint64_t>(h), 0);
  const int kind = static_cast<int>(draw(key, 0) >> 62);
  double weight[4];
  for (int c = 0; c < 4; ++c) {
    const double u = uniform(key, 1 + static_cast<std::uint64_t>(c));
    weight[c] = c == kind ? 1.0 + 0.5 * u : 0.25 + 0.5 * u;
  }
  QueryHead q;
  const double full = peakedness * kScore;
  q.sink_score = full * weight[kSinkHead];
  q.local_score = full * weight[kLocalHead];
  q.stripe_score = full * weight[kStripeHead] * kStripeShare;
  q.slash_score = full * weight[kSlashHead];
  q.noise = static_cast<double>(4 + (draw(key, 5) >> 62)) * 0.25;
  const std::int64_t w = std::int64_t{1} << layout.w_log2;
  const double span = static_cast<double>(std::max(1, seq_k / 2));
  q.slash_offset = w + static_cast<std::int64_t>(std::floor(uniform(key, 6) * span));
  return q;
}

struct Stripe {
  std::int64_t first = 0, end = 0;  // key positions [first, end)
  int channel = 0;
  double strength = 0;
};

std::vector<Stripe> make_stripes(std::uint64_t seed, int b, int g, const Layout& layout,
                                 int seq_k) {
  std::vector<Stripe> stripes;
  if (layout.stripes == 0) return stripes;
  const std::uint64_t key =
      stream_key(seed, kTagStripes, static_cast<std::uint64_t>(b), static_cast<std::uint64_t>(g));
  const int count = std::max(1, seq_k / kStripeSpacing);
  for (int s = 0; s < count; ++s) {
    const std::uint64_t n = 4 * static_cast<std::uint64_t>(s);
    Stripe st;
    st.first = static_cast<std::int64_t>(std::floor(uniform(key, n) * seq_k));
    st.end = std::min<std::int64_t>(
        seq_k, st.first + 4 + static_cast<std::int64_t>(draw(key, n + 1) >> 58));
    st.channel =
        static_cast<int>((draw(key, n + 2) >> 32) % static_cast<std::uint64_t>(layout.stripes));
    st.strength = 0.5 + 0.5 * uniform(key, n + 3);
    stripes.push_back(st);
  }
  return stripes;
}

// Stores x (a double) into element `index` of `out`: rounded to fp32 first, then to the
// output dtype (both round to nearest even).
void store(HostTensor* out, std::int64_t index, double x) {
  const float f = static_cast<float>(x);
  switch (out->dtype()) {
    case DType::kBF16: out->as<std::uint16_t>()[index] = float_to_bf16(f); break;
    case DType::kFP16: out->as<std::uint16_t>()[index] = float_to_fp16(f); break;
    default: out->as<float>()[index] = f; break;
  }
}

Status validate_config(const GeneratorConfig& c) {
  if (c.batch < 1) return invalid_argument("batch: expected >= 1, got " + std::to_string(c.batch));
  if (c.seq_q < 1) return invalid_argument("seq_q: expected >= 1, got " + std::to_string(c.seq_q));
  if (c.seq_k < c.seq_q) {
    return invalid_argument("seq_k: expected >= seq_q (" + std::to_string(c.seq_q) + "), got " +
                            std::to_string(c.seq_k));
  }
  if (c.h_kv < 1) return invalid_argument("h_kv: expected >= 1, got " + std::to_string(c.h_kv));
  if (c.h_q < 1 || c.h_q % c.h_kv != 0) {
    return invalid_argument("h_q: expected a positive multiple of h_kv (" + std::to_string(c.h_kv) +
                            "), got " + std::to_string(c.h_q));
  }
  if (c.d < 8) return invalid_argument("d: expected >= 8, got " + std::to_string(c.d));
  if (c.dtype != DType::kBF16 && c.dtype != DType::kFP16 && c.dtype != DType::kFP32) {
    return invalid_argument(std::string("dtype: expected bf16, fp16 or fp32, got ") + dtype_name(c.dtype));
  }
  if (!std::isfinite(c.peakedness) || c.peakedness < 0 || c.peakedness > 100) {
    return invalid_argument("peakedness: expected a finite value in [0, 100], got " +
                            std::to_string(c.peakedness));
  }
  // Element counts must fit comfortably in int64 and in memory: 2^40 elements per tensor.
  const double q_elems = static_cast<double>(c.batch) * c.seq_q * c.h_q * c.d;
  const double k_elems = static_cast<double>(c.batch) * c.seq_k * c.h_kv * c.d;
  if (q_elems > 1099511627776.0 || k_elems > 1099511627776.0) {
    return invalid_argument("batch, seq_k, h_q, d: tensors of more than 2^40 elements");
  }
  return Status::ok_status();
}

}  // namespace

Status generate(const GeneratorConfig& config, HostTensor* q, HostTensor* k, HostTensor* v) {
  if (q == nullptr || k == nullptr || v == nullptr) {
    return invalid_argument("q, k, v: expected non-null output tensors");
  }
  SP_RETURN_IF_ERROR(validate_config(config));
  const GeneratorConfig& c = config;
  const int d = c.d;
  const Layout layout = make_layout(d, c.seq_k);
  const double sqrt_d = std::sqrt(static_cast<double>(d));
  const std::int64_t offset = c.seq_k - c.seq_q;  // absolute position of query row 0

  *q = HostTensor(c.dtype, {c.batch, c.seq_q, c.h_q, d});
  *k = HostTensor(c.dtype, {c.batch, c.seq_k, c.h_kv, d});
  *v = HostTensor(c.dtype, {c.batch, c.seq_k, c.h_kv, d});

  // The head structure (the "model") comes from the seed's upper 32 bits, the content (noise,
  // stripe positions, per-query factors) from the whole seed: seeds that differ only in their
  // lower 32 bits are different inputs to one model, so calibrating on one and testing on
  // another is meaningful.
  const std::uint64_t model = c.seed >> 32;
  std::vector<QueryHead> heads;
  for (int h = 0; h < c.h_q; ++h)
    heads.push_back(make_query_head(model, h, layout, c.seq_k, c.peakedness));
  std::vector<int> sink_keys;
  for (int g = 0; g < c.h_kv; ++g) {
    const std::uint64_t key = stream_key(model, kTagKvHead, static_cast<std::uint64_t>(g), 0);
    sink_keys.push_back(1 + static_cast<int>(draw(key, 0) >> 62));
  }

  std::vector<double> row(static_cast<std::size_t>(d));
  const auto noise_scale = [&](int ch, double head_noise) {
    return ch < layout.features_end ? kFeatureNoise : head_noise;
  };
  const auto add_spline = [&](std::int64_t x, double amplitude) {
    const Spline s = spline_at(x, layout.w_log2);
    // x >= 0 and (m - 3)·w >= seq_k keep cell + 2 < m.
    for (int j = 0; j < 3; ++j) {
      const auto ch = static_cast<std::size_t>(layout.position_first + s.cell + j);
      row[ch] += to_grid(amplitude * s.weight[j]);
    }
  };

  for (int b = 0; b < c.batch; ++b) {
    const auto ub = static_cast<std::uint64_t>(b);
    // ---- keys and values [b, seq_k, h_kv, d]
    for (int g = 0; g < c.h_kv; ++g) {
      const auto ug = static_cast<std::uint64_t>(g);
      const std::uint64_t k_key = stream_key(c.seed, kTagKNoise, ub, ug);
      const std::uint64_t v_key = stream_key(c.seed, kTagVNoise, ub, ug);
      // stripe_value[t][channel]: K's stripe channels, summed over overlapping stripes.
      std::vector<double> stripe_value(static_cast<std::size_t>(c.seq_k) * kMaxStripeChannels, 0.0);
      for (const Stripe& s : make_stripes(c.seed, b, g, layout, c.seq_k)) {
        const double value = to_grid(kKeyAmplitude * s.strength);
        for (std::int64_t t = s.first; t < s.end; ++t) {
          stripe_value[static_cast<std::size_t>(t * kMaxStripeChannels + s.channel)] += value;
        }
      }
      for (std::int64_t t = 0; t < c.seq_k; ++t) {
        for (int ch = 0; ch < d; ++ch) {
          const auto n = static_cast<std::uint64_t>((t * d + ch) * 3);
          row[static_cast<std::size_t>(ch)] = noise_scale(ch, 1.0) * normal(k_key, n);
        }
        if (t < sink_keys[static_cast<std::size_t>(g)]) {
          row[static_cast<std::size_t>(layout.sink)] +=
              to_grid(kKeyAmplitude * (t == 0 ? 1.0 : 0.75));
        }
        for (int s = 0; s < layout.stripes; ++s) {
          row[static_cast<std::size_t>(layout.stripe_first + s)] +=
              stripe_value[static_cast<std::size_t>(t * kMaxStripeChannels + s)];
        }
        add_spline(t, kKeyAmplitude);
        const std::int64_t base = ((b * c.seq_k + t) * c.h_kv + g) * static_cast<std::int64_t>(d);
        for (int ch = 0; ch < d; ++ch) {
          store(k, base + ch, row[static_cast<std::size_t>(ch)]);
          store(v, base + ch, normal(v_key, static_cast<std::uint64_t>((t * d + ch) * 3)));
        }
      }
    }
    // ---- queries [b, seq_q, h_q, d] at absolute positions offset .. seq_k - 1
    for (int h = 0; h < c.h_q; ++h) {
      const auto uh = static_cast<std::uint64_t>(h);
      const QueryHead& head = heads[static_cast<std::size_t>(h)];
      const std::uint64_t q_key = stream_key(c.seed, kTagQNoise, ub, uh);
      const std::uint64_t mod_key = stream_key(c.seed, kTagQMod, ub, uh);
      // Amplitudes such that q·k·scale adds the head's score at full key strength.
      const double sink_amp = head.sink_score * sqrt_d / kKeyAmplitude;
      const double stripe_amp = head.stripe_score * sqrt_d / kKeyAmplitude;
      const double local_amp = head.local_score * sqrt_d / (kKeyAmplitude * kSplineSelf);
      const double slash_amp = head.slash_score * sqrt_d / (kKeyAmplitude * kSplineSelf);
      for (std::int64_t r = 0; r < c.seq_q; ++r) {
        const std::int64_t i = offset + r;
        for (int ch = 0; ch < d; ++ch) {
          const auto n = static_cast<std::uint64_t>((i * d + ch) * 3);
          row[static_cast<std::size_t>(ch)] = noise_scale(ch, head.noise) * normal(q_key, n);
        }
        const auto mod = static_cast<std::uint64_t>(i * (1 + kMaxStripeChannels));
        row[static_cast<std::size_t>(layout.sink)] +=
            to_grid(sink_amp * (0.75 + 0.5 * uniform(mod_key, mod)));
        for (int s = 0; s < layout.stripes; ++s) {
          row[static_cast<std::size_t>(layout.stripe_first + s)] +=
              to_grid(stripe_amp * uniform(mod_key, mod + 1 + static_cast<std::uint64_t>(s)));
        }
        add_spline(i, local_amp);
        if (i - head.slash_offset >= 0) add_spline(i - head.slash_offset, slash_amp);
        const std::int64_t base = ((b * c.seq_q + r) * c.h_q + h) * static_cast<std::int64_t>(d);
        for (int ch = 0; ch < d; ++ch) store(q, base + ch, row[static_cast<std::size_t>(ch)]);
      }
    }
  }
  return Status::ok_status();
}

}  // namespace sparseprefill
