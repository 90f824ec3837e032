// Attention of a one-token decode step on the CPU, over each row's own keys (taps_ray/models/decode_attention.py).
//
// Why: a batch's key/value cache is as wide as its longest sequence, and torch's CPU attention kernel computes
// every padded key (the mask only zeroes them) after a fixed cost of ~75 us a call. Here each (row, key/value head)
// gathers the keys its mask lets it see, once for the query heads sharing that key/value head, and computes
// over those alone. Scores, softmax and the weighted sum are float32 whatever the cache's dtype (as torch's
// kernel accumulates); the output has the queries' dtype.
//
// queries [B, H, R, D]: the R query heads that share key/value head h, for one position; keys, values
// [B, H, S, D] (any strides but the last); mask [B, 1, 1, S] additive in the queries' dtype, -inf where a row
// may not attend (None: every key). A row that may attend no key gets zeros.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr float kMasked = -1e30f;  // below every real score; finite, as the build assumes finite math

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {  // the top half of a float32: a shift the compiler vectorises
  const uint32_t bits = uint32_t(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline bool is_minus_inf(float x) {  // by its bits: finite math lets the compiler drop a comparison with -inf
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits == 0xff800000u;
}

template <int64_t D, typename T>
inline void load_row(const T* source, float* row) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) row[d] = to_float(source[d]);
}

// Per-thread scratch, grown on demand: an allocation per call of a long cache's rows would be a fresh mapping.
struct Scratch {
  std::vector<float> keys, values, scores, bias;
  std::vector<int64_t> slots;
  void fit(int64_t width, int64_t head_dim) {  // per instantiation, so one head size; the width only grows
    if (int64_t(keys.size()) >= width * head_dim) return;
    keys.resize(width * head_dim);
    values.resize(width * head_dim);
    scores.resize(width);
    bias.resize(width);
    slots.resize(width);
  }
};

template <int64_t D, typename T>
void attend(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
            const c10::optional<at::Tensor>& mask, float scale, at::Tensor& out) {
  const int64_t batch = queries.size(0), heads = queries.size(1), rows = queries.size(2), width = keys.size(2);
  const T* q = queries.data_ptr<T>();
  const T* k = keys.data_ptr<T>();
  const T* v = values.data_ptr<T>();
  const T* m = mask.has_value() ? mask->data_ptr<T>() : nullptr;
  const int64_t m_row = m ? mask->stride(0) : 0;
  T* o = out.data_ptr<T>();
  // Rows differ in length, so the threads take (row, head) tasks one at a time rather than in equal halves.
  const int64_t tasks = batch * heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    scratch.fit(width, D);
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t b = task / heads, h = task % heads;
      int64_t seen = 0;  // the slots row b may attend, their keys and values as float32, their mask's bias
      for (int64_t s = 0; s < width; ++s) {
        const float bias = m ? to_float(m[b * m_row + s]) : 0.f;
        if (is_minus_inf(bias)) continue;
        scratch.slots[seen] = s;
        scratch.bias[seen++] = bias;
      }
      const T* k_bh = k + b * keys.stride(0) + h * keys.stride(1);
      const T* v_bh = v + b * values.stride(0) + h * values.stride(1);
      for (int64_t j = 0; j < seen; ++j) {
        load_row<D>(k_bh + scratch.slots[j] * keys.stride(2), scratch.keys.data() + j * D);
        load_row<D>(v_bh + scratch.slots[j] * values.stride(2), scratch.values.data() + j * D);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float query[D];
        load_row<D>(q + b * queries.stride(0) + h * queries.stride(1) + r * queries.stride(2), query);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) query[d] *= scale;
        float* scores = scratch.scores.data();
        float top = kMasked;
        for (int64_t j = 0; j < seen; ++j) {
          const float* key = scratch.keys.data() + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
          scores[j] = dot + scratch.bias[j];
          top = scores[j] > top ? scores[j] : top;
        }
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < seen; ++j) {
          scores[j] = std::exp(scores[j] - top);
          total += scores[j];
        }
        float sum[D] = {};
        for (int64_t j = 0; j < seen; ++j) {
          const float weight = scores[j];
          const float* value = scratch.values.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) sum[d] += weight * value[d];
        }
        const float norm = seen ? 1.f / total : 0.f;
        T* row = o + ((b * heads + h) * rows + r) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = T(sum[d] * norm);
      }
    }
  });
}

template <typename T>
void by_head_dim(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                 const c10::optional<at::Tensor>& mask, float scale, at::Tensor& out) {
  switch (queries.size(3)) {
    case 16: return attend<16, T>(queries, keys, values, mask, scale, out);
    case 32: return attend<32, T>(queries, keys, values, mask, scale, out);
    case 64: return attend<64, T>(queries, keys, values, mask, scale, out);
    case 128: return attend<128, T>(queries, keys, values, mask, scale, out);
    default: TORCH_CHECK(false, "decode_attention: head size ", queries.size(3), " (compiled for 16, 32, 64 and 128)");
  }
}

at::Tensor decode_attention(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                            const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(queries.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "decode_attention: 4-d tensors");
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == queries.size(0) && keys.size(1) == queries.size(1)
                  && keys.size(3) == queries.size(3), "decode_attention: queries ", queries.sizes(), ", keys ",
              keys.sizes(), ", values ", values.sizes());
  TORCH_CHECK(queries.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "decode_attention: the head dimension must be contiguous");
  TORCH_CHECK(keys.scalar_type() == queries.scalar_type() && values.scalar_type() == queries.scalar_type(),
              "decode_attention: one dtype for queries, keys and values");
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(0) == queries.size(0) && mask->size(1) == 1 && mask->size(2) == 1
                    && mask->size(3) == keys.size(2) && mask->stride(3) == 1,
                "decode_attention: mask ", mask->sizes(), " (wanted [B, 1, 1, S], contiguous over S)");
    TORCH_CHECK(mask->scalar_type() == queries.scalar_type(), "decode_attention: an additive mask of the queries' dtype");
  }
  at::Tensor out = at::empty(queries.sizes(), queries.options());
  switch (queries.scalar_type()) {
    case at::kFloat: by_head_dim<float>(queries, keys, values, mask, float(scale), out); break;
    case at::kBFloat16: by_head_dim<c10::BFloat16>(queries, keys, values, mask, float(scale), out); break;
    default: TORCH_CHECK(false, "decode_attention: float32 or bfloat16, not ", queries.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(taps, m) {
  m.def("decode_attention(Tensor queries, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(taps, CPU, m) { m.impl("decode_attention", &decode_attention); }
