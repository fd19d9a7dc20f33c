// The sampler's per-row work on the CPU in a few passes over each row, where torch's path
// (engine/sampler.py) spends a top-k of 256 candidates, a log-sum-exp, masks, a softmax, a
// cumulative sum and a search over the vocabulary (C ABI, ctypes; built like fused_ops.cpp).
//
//   splitserve_sample_f32(logits, rows, vocab, temperature, top_k, top_p, min_p, uniform,
//                         out_ids, threads)
//     logits [rows, vocab] float32 contiguous: the penalized logits (-inf: a token the row may
//     not take), not modified. Per row r: temperature[r] > 0; top_k[r] (int64; 0 or >= vocab:
//     off); top_p[r] in (0, 1] (1: off); min_p[r] in [0, 1] (0: off); uniform[r] in [0, 1).
//     out_ids[r] (int64) is the token the reproducibility contract of engine/sampler.py picks:
//       x = logits[r] / temperature[r]                (one float32 division per entry);
//       kth = the k-th largest x (-inf when top-k is off);
//       pth = the largest value v such that the x >= kth sorted descending reach top_p of
//             their mass (sum of exp(x - max)) at v, counting v's own mass (-inf when off);
//       mth = max + log(min_p) (-inf when off);
//       kept = { i : x_i >= max(kth, pth, mth) and exp(x_i - max) above float32's range
//                floor (e^-87) } (ties with the cut-off are kept; the most likely token always);
//       the token i where the running sum of exp(x - max) over kept tokens, in vocabulary
//       order, first exceeds uniform[r] times its total.
//     Sums are in double of float32 terms; exp is cpu_common.h's (relative error below 1e-7).
//     So a token equals torch's except where its uniform or top_p lands within float rounding
//     of a boundary between two tokens' cumulative masses (torch sums in float32, in its
//     order). A row whose logits are all -inf gets token 0.
//   splitserve_token_logprobs_f32(logits, rows, vocab, chosen, num_top, out_logprob, out_rank,
//                                 out_top_ids, out_top_logprobs, threads)
//     logits [rows, vocab] float32 contiguous (raw); chosen [rows] int64 in [0, vocab).
//     Per row, with lp_i = (x_i - max) - log(sum_j exp(x_j - max)) (the sum in double):
//     out_logprob[r] = lp_chosen; out_rank[r] = 1 + #{ j : lp_j > lp_chosen } (int64);
//     out_top_ids / out_top_logprobs [rows, num_top]: the num_top largest lp, descending,
//     ties by lower id first (num_top may be 0; num_top <= vocab).
//     The logprobs are torch's log_softmax within float rounding (its exp and its sum's order
//     differ); ranks and the top are counted on these values, so they agree with them.
// Both return 0, or -1 for arguments they refuse. Rows are split across `threads` OpenMP
// threads; each thread reuses its own scratch rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace splitserve_cpu;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kBlock = 64;  // entries per block: a block whose max is below a floor is skipped
constexpr float kFloorsNats[] = {2.0f, 4.0f, 6.0f, 8.0f, 12.0f, 16.0f, 24.0f};
// The cut-offs' candidates are first looked for among x >= max - 2, then - 4, ... - 24, then
// everywhere: the first floor whose entries hold the top-k's k or the top-p's mass.
constexpr int64_t kSortBelow = 48;  // a selection range this small is sorted, not split

struct Entry {
  float value;  // x
  float mass;   // exp(x - max)
};

struct Scratch {
  std::vector<float> scaled;       // [vocab] x
  std::vector<float> mass;         // [vocab] exp(x - max); 0 below the exp floor and at -inf
  std::vector<float> block_max;    // [blocks] the largest x of each block of kBlock
  std::vector<double> block_mass;  // [blocks] the kept mass of each block
  std::vector<Entry> entries;      // [vocab] the cut-offs' candidates

  void fit(int64_t vocab) {
    if (static_cast<int64_t>(scaled.size()) < vocab) {
      const int64_t blocks = (vocab + kBlock - 1) / kBlock;
      scaled.resize(vocab);
      mass.resize(vocab);
      block_max.resize(blocks);
      block_mass.resize(blocks);
      entries.resize(vocab);
    }
  }
};

Scratch& thread_scratch(int64_t vocab) {
  thread_local Scratch scratch;
  scratch.fit(vocab);
  return scratch;
}

inline int threads_for(int64_t rows, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, threads)));
}

// One row's x, mass and block maxima (in the calling thread's scratch).
struct Row {
  const float* x;
  const float* mass;
  const float* block_max;
  int64_t vocab;
  int64_t blocks;

  int64_t start(int64_t block) const { return block * kBlock; }
  int64_t end(int64_t block) const { return std::min(vocab, (block + 1) * kBlock); }
};

// The largest entry of x (NaNs never win), -inf for an all -inf row.
float row_max(const float* x, int64_t n) {
  float best = kNegInf;
#pragma omp simd reduction(max : best)
  for (int64_t i = 0; i < n; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

// x = logits / temperature (into `scaled`, unless the temperature is 1: x is then the logits)
// and each block's max; returns the row's max.
float scale_row(const float* logits, float temperature, float* scaled, float* block_max,
                int64_t vocab) {
  const float* x = logits;
  if (temperature != 1.0f) {
#pragma omp simd
    for (int64_t i = 0; i < vocab; ++i) scaled[i] = logits[i] / temperature;
    x = scaled;
  }
  float top = kNegInf;
  int64_t start = 0, block = 0;
  for (; start + kBlock <= vocab; start += kBlock, ++block) {
    float best = kNegInf;  // a fixed trip count: one vector max per register, then across them
#pragma omp simd reduction(max : best)
    for (int64_t i = 0; i < kBlock; ++i) best = x[start + i] > best ? x[start + i] : best;
    block_max[block] = best;
    top = best > top ? best : top;
  }
  if (start < vocab) {
    block_max[block] = row_max(x + start, vocab - start);
    top = block_max[block] > top ? block_max[block] : top;
  }
  return top;
}

// mass[i] = exp(x[i] - top), 0 where x[i] - top is below the exp floor (and at -inf); returns
// their sum.
double fill_mass(const float* x, float top, float* mass, int64_t n) {
  exp_nonpositive_shifted(x, top, mass, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) mass[i] = x[i] - top >= kExpFloor ? mass[i] : 0.0f;
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += mass[i];
  return total;
}

struct Tally {
  int64_t count;  // entries with x >= the floor (-inf and below the exp floor included)
  double mass;
};

// The count and mass of `block`'s entries with x >= floor (the mass summed in float: 64 terms).
template <int64_t kCount>
inline Tally block_tally(const float* x, const float* mass, int64_t count, float floor) {
  const int64_t n = kCount > 0 ? kCount : count;  // a full block's trip count is a constant
  int64_t in_count = 0;
  float in_mass = 0.0f;
#pragma omp simd reduction(+ : in_count, in_mass)
  for (int64_t i = 0; i < n; ++i) {
    const bool in = x[i] >= floor;
    in_count += in;
    in_mass += in ? mass[i] : 0.0f;
  }
  return Tally{in_count, in_mass};
}

inline Tally block_tally(const Row& row, int64_t block, float floor) {
  const int64_t start = row.start(block), count = row.end(block) - start;
  return count == kBlock ? block_tally<kBlock>(row.x + start, row.mass + start, kBlock, floor)
                         : block_tally<0>(row.x + start, row.mass + start, count, floor);
}

Tally tally(const Row& row, float floor) {
  Tally result{0, 0.0};
  for (int64_t block = 0; block < row.blocks; ++block) {
    if (row.block_max[block] < floor) continue;
    const Tally in_block = block_tally(row, block, floor);
    result.count += in_block.count;
    result.mass += in_block.mass;
  }
  return result;
}

// The entries with x >= floor, into entries[0..); returns how many.
int64_t gather(const Row& row, float floor, Entry* entries) {
  int64_t count = 0;
  for (int64_t block = 0; block < row.blocks; ++block) {
    if (row.block_max[block] < floor) continue;
    for (int64_t i = row.start(block); i < row.end(block); ++i) {
      if (row.x[i] >= floor) entries[count++] = Entry{row.x[i], row.mass[i]};
    }
  }
  return count;
}

// The highest floor of top - kFloorsNats (else `lowest`) above `lowest` whose entries satisfy
// `enough`.
template <typename Enough>
float first_floor(const Row& row, float top, float lowest, Enough enough) {
  for (float nats : kFloorsNats) {
    const float floor = top - nats;
    if (!(floor > lowest)) break;
    if (enough(tally(row, floor))) return floor;
  }
  return lowest;
}

// The value at which entries[0..n), taken in descending order of value, first reach `target`
// of mass counting each value's own (tied entries are one step: kept together); the smallest
// value when rounding leaves them short. A weighted selection: three-way splits around a
// pivot, then a sort of the last few. Reorders the entries; n >= 1.
float mass_cutoff(Entry* entries, int64_t n, double target) {
  int64_t lo = 0, hi = n;
  double above = 0.0;  // mass of the entries known to lie above [lo, hi)
  while (hi - lo > kSortBelow) {
    const float a = entries[lo].value, b = entries[(lo + hi) / 2].value, c = entries[hi - 1].value;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of 3
    // [lo, gt) > pivot, [gt, lt) == pivot, [lt, hi) < pivot
    int64_t gt = lo, i = lo, lt = hi;
    while (i < lt) {
      const float v = entries[i].value;
      if (v > pivot) {
        std::swap(entries[gt++], entries[i++]);
      } else if (v < pivot) {
        std::swap(entries[i], entries[--lt]);
      } else {
        ++i;
      }
    }
    double greater = 0.0, equal = 0.0;
    for (int64_t j = lo; j < gt; ++j) greater += entries[j].mass;
    for (int64_t j = gt; j < lt; ++j) equal += entries[j].mass;
    if (above + greater >= target) {
      hi = gt;
    } else if (above + greater + equal >= target) {
      return pivot;
    } else {
      above += greater + equal;
      lo = lt;
    }
  }
  if (hi == lo) return entries[lo > 0 ? lo - 1 : 0].value;  // rounding: nothing left below
  std::sort(entries + lo, entries + hi,
            [](const Entry& x, const Entry& y) { return x.value > y.value; });
  for (int64_t j = lo; j < hi; ++j) {
    above += entries[j].mass;
    if (j + 1 < hi && entries[j + 1].value == entries[j].value) continue;  // a tie is one step
    if (above >= target) return entries[j].value;
  }
  return entries[hi - 1].value;
}

// The lowest value a row keeps under top-k then top-p (-inf when both are off).
float nucleus_cutoff(const Row& row, float top, double all_mass, int64_t top_k, float top_p,
                     Entry* entries) {
  const bool k_on = top_k > 0 && top_k < row.vocab;
  const bool p_on = top_p < 1.0f;
  float kth = kNegInf;
  if (k_on) {
    const float floor =
        first_floor(row, top, kNegInf, [&](const Tally& t) { return t.count >= top_k; });
    const int64_t count = gather(row, floor, entries);
    auto descending = [](const Entry& a, const Entry& b) { return a.value > b.value; };
    std::nth_element(entries, entries + (top_k - 1), entries + count, descending);
    kth = entries[top_k - 1].value;
  }
  if (!p_on) return kth;
  const double target = static_cast<double>(top_p) * (k_on ? tally(row, kth).mass : all_mass);
  const float floor = first_floor(row, top, kth, [&](const Tally& t) { return t.mass >= target; });
  const float pth = mass_cutoff(entries, gather(row, floor, entries), target);
  return std::max(kth, pth);
}

// The last kept entry of `block` (one is: its kept mass is positive).
int64_t last_kept(const Row& row, int64_t block, float cutoff) {
  for (int64_t i = row.end(block) - 1; i > row.start(block); --i) {
    if (row.x[i] >= cutoff && row.mass[i] > 0.0f) return i;
  }
  return row.start(block);
}

// The token the draw picks among x >= cutoff (see the contract).
int64_t draw(const Row& row, float cutoff, float uniform, double* block_mass) {
  double total = 0.0;
  for (int64_t block = 0; block < row.blocks; ++block) {
    const double sum = row.block_max[block] >= cutoff ? block_tally(row, block, cutoff).mass : 0.0;
    block_mass[block] = sum;
    total += sum;
  }
  const double target = static_cast<double>(uniform) * total;
  double running = 0.0;
  int64_t last_block = 0;
  for (int64_t block = 0; block < row.blocks; ++block) {
    if (block_mass[block] <= 0.0) continue;
    last_block = block;
    if (running + block_mass[block] <= target) {
      running += block_mass[block];
      continue;
    }
    for (int64_t i = row.start(block); i < row.end(block); ++i) {
      if (row.x[i] >= cutoff && row.mass[i] > 0.0f) {
        running += row.mass[i];
        if (running > target) return i;
      }
    }
    break;  // rounding: the block's sum passed the target, its terms one by one did not
  }
  return last_kept(row, last_block, cutoff);  // rounding: the target reached the total
}

int64_t sample_row(const float* logits, int64_t vocab, float temperature, int64_t top_k,
                   float top_p, float min_p, float uniform) {
  Scratch& scratch = thread_scratch(vocab);
  float* mass = scratch.mass.data();
  // temperature 1 (OpenAI's default) divides by nothing: x is the logits themselves
  const float* x = temperature == 1.0f ? logits : scratch.scaled.data();
  const float top = scale_row(logits, temperature, scratch.scaled.data(), scratch.block_max.data(),
                              vocab);
  if (!(top > kNegInf)) return 0;
  const double all_mass = fill_mass(x, top, mass, vocab);
  const Row row{x, mass, scratch.block_max.data(), vocab, (vocab + kBlock - 1) / kBlock};
  float cutoff = nucleus_cutoff(row, top, all_mass, top_k, top_p, scratch.entries.data());
  if (min_p > 0.0f) cutoff = std::max(cutoff, top + std::log(min_p));
  return draw(row, cutoff, uniform, scratch.block_mass.data());
}

bool ascending_ids_of_descending_values(float value_a, int64_t id_a, float value_b, int64_t id_b) {
  return value_a > value_b || (value_a == value_b && id_a < id_b);
}

// How many of x[0..n) have a logprob ((x - top) - log_norm) above `logprob`.
int64_t count_above(const float* x, int64_t n, float top, float log_norm, float logprob) {
  int64_t above = 0;
#pragma omp simd reduction(+ : above)
  for (int64_t i = 0; i < n; ++i) above += ((x[i] - top) - log_norm) > logprob;
  return above;
}

void logprob_row(const float* x, int64_t vocab, int64_t chosen, int64_t num_top,
                 float* out_logprob, int64_t* out_rank, int64_t* top_ids, float* top_logprobs) {
  Scratch& scratch = thread_scratch(vocab);
  const float* block_max = scratch.block_max.data();
  const float top = scale_row(x, 1.0f, nullptr, scratch.block_max.data(), vocab);
  const Row row{x, nullptr, block_max, vocab, (vocab + kBlock - 1) / kBlock};
  const float log_norm = static_cast<float>(std::log(fill_mass(x, top, scratch.mass.data(), vocab)));
  // (x - top) - log_norm rounds monotonically in x: a block's max has its largest logprob
  auto logprob_of = [&](float value) { return (value - top) - log_norm; };
  const float chosen_logprob = logprob_of(x[chosen]);
  int64_t larger = 0;
  for (int64_t block = 0; block < row.blocks; ++block) {
    if (!(logprob_of(block_max[block]) > chosen_logprob)) continue;
    const int64_t start = row.start(block);
    larger += count_above(x + start, row.end(block) - start, top, log_norm, chosen_logprob);
  }
  *out_logprob = chosen_logprob;
  *out_rank = larger + 1;
  // the num_top best so far, kept sorted (descending logprob, ascending id); a block is scanned
  // only while its max beats the last of them
  int64_t held = 0;
  for (int64_t block = 0; block < row.blocks && num_top > 0; ++block) {
    if (held == num_top && !(logprob_of(block_max[block]) > top_logprobs[held - 1])) continue;
    for (int64_t i = row.start(block); i < row.end(block); ++i) {
      const float lp = logprob_of(x[i]);
      if (held == num_top && !(lp > top_logprobs[held - 1])) continue;
      int64_t at = held < num_top ? held++ : num_top - 1;
      while (at > 0 && ascending_ids_of_descending_values(lp, i, top_logprobs[at - 1],
                                                          top_ids[at - 1])) {
        top_logprobs[at] = top_logprobs[at - 1];
        top_ids[at] = top_ids[at - 1];
        --at;
      }
      top_logprobs[at] = lp;
      top_ids[at] = i;
    }
  }
}

}  // namespace

extern "C" {

int splitserve_sample_f32(const float* logits, int64_t rows, int64_t vocab,
                          const float* temperature, const int64_t* top_k, const float* top_p,
                          const float* min_p, const float* uniform, int64_t* out_ids,
                          int threads) {
  if (rows < 0 || vocab <= 0) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    if (!(temperature[r] > 0.0f) || !(top_p[r] > 0.0f) || !(min_p[r] >= 0.0f) ||
        !(uniform[r] >= 0.0f && uniform[r] < 1.0f) || top_k[r] < 0) {
      return -1;
    }
  }
#pragma omp parallel for num_threads(threads_for(rows, threads)) schedule(dynamic, 1)
  for (int64_t r = 0; r < rows; ++r) {
    out_ids[r] = sample_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r],
                            min_p[r], uniform[r]);
  }
  return 0;
}

int splitserve_token_logprobs_f32(const float* logits, int64_t rows, int64_t vocab,
                                  const int64_t* chosen, int64_t num_top, float* out_logprob,
                                  int64_t* out_rank, int64_t* out_top_ids,
                                  float* out_top_logprobs, int threads) {
  if (rows < 0 || vocab <= 0 || num_top < 0 || num_top > vocab) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    if (chosen[r] < 0 || chosen[r] >= vocab) return -1;
  }
#pragma omp parallel for num_threads(threads_for(rows, threads)) schedule(dynamic, 4)
  for (int64_t r = 0; r < rows; ++r) {
    logprob_row(logits + r * vocab, vocab, chosen[r], num_top, out_logprob + r, out_rank + r,
                out_top_ids + r * num_top, out_top_logprobs + r * num_top);
  }
  return 0;
}

}  // extern "C"
