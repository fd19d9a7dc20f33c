// Every decoder layer of a decode-only step in one call: the layer loop of
// engine/model.py:LlamaModel.forward, run in C++ so that a step pays one ctypes call instead of
// a dozen Python-level ops per layer (built and called like the other kernels; C ABI, ctypes).
//
// It computes nothing of its own but copies: each op is a call of the kernel the Python path
// calls for it (the quantized row product, the fused add + RMSNorm, the fused rotary, the paged
// decode attention, the fused SiLU * up), through the function pointers in `Kernels`, with the
// same arguments in the same order. So for the same inputs its hidden state and delta are the
// Python path's bit for bit (tests/test_cpu_decode_layers.py checks this).
//
//   splitserve_decode_layers(kernels, layers, step) -> 0, or the first nonzero code a kernel
//   returned (-100 for arguments refused here); the step's outputs are then undefined.
//
// Per layer l, for the step's `rows` generated tokens (row r = sequence r of the step):
//   hidden += delta (not at layer 0); normed = rms_norm(hidden) * input_norm      add_rms_norm
//   qkv = normed @ Wqkv.T (+ bias)              [rows, (q_heads + 2 kv_heads) * head_dim]  qgemv
//   rot = rotary(qkv's q and k heads, cos, sin)  [rows, q_heads + kv_heads, head_dim]     rotary
//   key_cache_l[slot r] = rot[r, q_heads:]; value_cache_l[slot r] = qkv[r]'s v heads      copies
//   attn = attention(rot[:, :q_heads] over each sequence's cached context)              attention
//   hidden += attn @ Wo.T; normed = rms_norm(hidden) * post_norm              qgemv, add_rms_norm
//   delta = silu_mul(normed @ Wgate_up.T) @ Wdown.T                      qgemv, silu_mul, qgemv
// On return `hidden` holds the residual stream before the last layer's delta is added and
// `delta` that delta (the caller adds them, as the Python path does after its loop).
//
// Layout: the step's tensors are row-major and contiguous, of the step's dtype (float32 when
// `f32`, else bf16); kv_cache is [layers, 2, blocks, block_size, kv_heads, head_dim]
// contiguous, layer l's keys `2 l` and values `2 l + 1` slabs of `layer_cache_elements`;
// `scratch` holds scratch_elements(step) elements of the dtype.
#include <cstdint>
#include <cstring>

namespace {

using QGemv = int (*)(void* out, int out_f32, const void* x, int x_f32, int64_t rows,
                      const void* packed, int type, const void* bias, int64_t out_features,
                      int64_t in_features, int threads);
using AddRmsNorm = int (*)(void* hidden, const void* delta, const void* weight, void* out,
                           int64_t rows, int64_t cols, float eps, int threads);
using Rotary = int (*)(void* out, const void* x, int64_t token_stride, const void* cos,
                       const void* sin, int64_t tokens, int64_t heads, int64_t head_dim,
                       int threads);
using Attention = int (*)(void* out, const void* query, int64_t query_stride,
                          const void* key_cache, const void* value_cache,
                          const int64_t* block_tables, int64_t table_stride,
                          const int64_t* context_lens, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, int threads);
using SiluMul = int (*)(void* out, const void* gate_up, int64_t rows, int64_t cols, int threads);

}  // namespace

extern "C" {

// The kernels of the step's dtype (the bf16 or the float32 symbol of each library).
struct SplitserveDecodeKernels {
  QGemv qgemv;
  AddRmsNorm add_rms_norm;
  Rotary rotary;
  Attention attention;
  SiluMul silu_mul;
};

// A projection's packed GGUF blocks (kernels/cpu_qgemv.py:QuantWeight).
struct SplitserveProjection {
  const void* packed;
  const void* bias;  // [out_features] of the step's dtype, or null
  int64_t type;      // ggml type id
  int64_t out_features;
  int64_t in_features;
};

struct SplitserveDecodeLayer {
  const void* input_norm;  // [hidden]
  const void* post_norm;   // [hidden]
  SplitserveProjection qkv, o_proj, gate_up, down;
};

struct SplitserveDecodeStep {
  int64_t f32;     // 1: float32 tensors, 0: bf16
  int64_t rows;    // generated tokens of the step, one per sequence
  int64_t layers;
  void* hidden;    // [rows, hidden_size], updated in place
  void* delta;     // [rows, hidden_size], written
  const void* cos;  // [rows, head_dim]
  const void* sin;  // [rows, head_dim]
  const int64_t* slots;         // [rows]: cache row of each token
  const int64_t* block_tables;  // [rows, table_stride]
  int64_t table_stride;
  const int64_t* context_lens;  // [rows], the new token included
  void* kv_cache;
  int64_t layer_cache_elements;  // elements of one layer's keys (or values)
  int64_t hidden_size, q_heads, kv_heads, head_dim, intermediate, block_size;
  float eps, scale;
  int64_t threads;
  void* scratch;
};

// Elements of the dtype `scratch` must hold for `rows` rows.
int64_t splitserve_decode_layers_scratch(int64_t rows, int64_t hidden_size, int64_t q_heads,
                                         int64_t kv_heads, int64_t head_dim,
                                         int64_t intermediate) {
  const int64_t qkv = (q_heads + 2 * kv_heads) * head_dim;
  const int64_t rot = (q_heads + kv_heads) * head_dim;
  return rows * (2 * hidden_size + qkv + rot + q_heads * head_dim + 3 * intermediate);
}

int splitserve_decode_layers(const SplitserveDecodeKernels* k, const SplitserveDecodeLayer* layers,
                             const SplitserveDecodeStep* s) {
  if (s->rows <= 0 || s->layers <= 0 || s->q_heads <= 0 || s->kv_heads <= 0 ||
      s->head_dim <= 0) {
    return -100;
  }
  const int64_t element = s->f32 ? 4 : 2;
  const int f32 = s->f32 ? 1 : 0;
  const int threads = static_cast<int>(s->threads);
  const int64_t rows = s->rows, hidden = s->hidden_size, dim = s->head_dim;
  const int64_t q_size = s->q_heads * dim, kv_size = s->kv_heads * dim;
  const int64_t qkv_size = q_size + 2 * kv_size, rot_size = q_size + kv_size;
  char* next = static_cast<char*>(s->scratch);
  auto take = [&](int64_t elements) {
    char* start = next;
    next += elements * element;
    return start;
  };
  char* normed = take(rows * hidden);
  char* qkv = take(rows * qkv_size);
  char* rot = take(rows * rot_size);
  char* attn = take(rows * q_size);
  char* o_out = take(rows * hidden);
  char* gate_up = take(rows * 2 * s->intermediate);
  char* act = take(rows * s->intermediate);
  char* cache = static_cast<char*>(s->kv_cache);
  const int64_t slab_bytes = s->layer_cache_elements * element;
  const int64_t kv_row_bytes = kv_size * element;

  auto project = [&](void* out, const void* x, const SplitserveProjection& p) {
    return k->qgemv(out, f32, x, f32, rows, p.packed, static_cast<int>(p.type), p.bias,
                    p.out_features, p.in_features, threads);
  };
  for (int64_t l = 0; l < s->layers; ++l) {
    const SplitserveDecodeLayer& layer = layers[l];
    char* key_cache = cache + (2 * l) * slab_bytes;
    char* value_cache = cache + (2 * l + 1) * slab_bytes;
    int code = k->add_rms_norm(s->hidden, l == 0 ? nullptr : s->delta, layer.input_norm, normed,
                               rows, hidden, s->eps, threads);
    if (code == 0) code = project(qkv, normed, layer.qkv);
    if (code == 0) {
      code = k->rotary(rot, qkv, rows > 1 ? qkv_size : rot_size, s->cos, s->sin, rows,
                       s->q_heads + s->kv_heads, dim, threads);
    }
    if (code != 0) return code;
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(key_cache + s->slots[r] * kv_row_bytes, rot + (r * rot_size + q_size) * element,
                  kv_row_bytes);
      std::memcpy(value_cache + s->slots[r] * kv_row_bytes,
                  qkv + (r * qkv_size + q_size + kv_size) * element, kv_row_bytes);
    }
    code = k->attention(attn, rot, rot_size, key_cache, value_cache, s->block_tables,
                        s->table_stride, s->context_lens, rows, s->q_heads, s->kv_heads, dim,
                        s->block_size, s->scale, threads);
    if (code == 0) code = project(o_out, attn, layer.o_proj);
    if (code == 0) {
      code = k->add_rms_norm(s->hidden, o_out, layer.post_norm, normed, rows, hidden, s->eps,
                             threads);
    }
    if (code == 0) code = project(gate_up, normed, layer.gate_up);
    if (code == 0) code = k->silu_mul(act, gate_up, rows, s->intermediate, threads);
    if (code == 0) code = project(s->delta, act, layer.down);
    if (code != 0) return code;
  }
  return 0;
}

}  // extern "C"
