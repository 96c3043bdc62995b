// Causal attention for the prefill (and chunked-prefill) requests of a step,
// all of them in one call, over K/V that already sit in the paged cache.
//
// Chapter 7 (a prefill step is compute-bound: hundreds of query tokens meet
// hundreds of keys); chapter 3 explains chunked prefill, chapter 4 the blocks.
// vLLM 0.32 counterpart: the prefill half of csrc/cpu/cpu_attn_impl.hpp behind
// vllm/v1/attention/backends/cpu_attn.py.
//
// The torch reference (torch_ref.py, _prefill_one) gathers each request's
// blocks and calls scaled_dot_product_attention once per request and layer;
// on the 2-core CPU these notes use, that reached ~50-75 GFLOP/s at prompt
// lengths of 64-256 tokens. Here attention is done as two small matrix
// products per tile of query rows, with the same register tiling as gemm.cpp:
//   S = Q_tile K^T (scores)  ->  softmax per row, causal mask  ->  O = P V.
// A tile is up to 12 query rows: a few consecutive tokens x the G query heads
// that share one KV head, so one pass over that head's keys serves them all.
// The keys of a (request, KV head) are first copied once into a transposed
// scratch K^T [head_dim, keys]: S's inner loop then loads 32 keys' values of
// one dimension as two vectors and broadcasts one query value per row.
// Softmax is two-pass (the whole score row of a tile fits in the scratch), so
// no running-max rescaling is needed. In bf16, K^T, scores and accumulators
// are fp32; only the query, the cached rows and the output are bf16.
#include "ops.h"
#include "paged.h"

#include <array>
#include <cstring>
#include <utility>

namespace {

constexpr int kTileRows = 12;  // 12 rows x 2 vectors = 24 accumulators (gemm.cpp's tiling)
constexpr int64_t kKeyChunk = 2 * kLanes;  // keys per score tile: two vectors

// s[r][j] = scale * q_r . k_j for j < num_keys (a multiple of kKeyChunk);
// kt is K^T: dimension d of key j at kt[d * kt_stride + j].
template <int ROWS, typename T>
void score_tile(float* s, int64_t s_stride, const T* const* q_rows, const float* kt, int64_t kt_stride,
                int64_t head_dim, int64_t num_keys, float scale) {
  for (int64_t j = 0; j < num_keys; j += kKeyChunk) {
    FloatVec acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = FloatVec{};
    for (int64_t d = 0; d < head_dim; ++d) {
      const FloatVec k0 = load_vec(kt + d * kt_stride + j), k1 = load_vec(kt + d * kt_stride + j + kLanes);
      for (int r = 0; r < ROWS; ++r) {
        const float qd = to_float(q_rows[r][d]);
        acc[r][0] += qd * k0;
        acc[r][1] += qd * k1;
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const FloatVec lo = acc[r][0] * scale, hi = acc[r][1] * scale;
      std::memcpy(s + r * s_stride + j, &lo, sizeof(lo));
      std::memcpy(s + r * s_stride + j + kLanes, &hi, sizeof(hi));
    }
  }
}

// out_r = inv_sum[r] * sum_j p[r][j] v_j over the first values.len keys, 32
// output dimensions at a time (head_dim is a multiple of 32).
template <int ROWS, typename T>
void weighted_value_tile(T* const* out_rows, const float* p, int64_t p_stride, const PagedRows<T>& values,
                         int64_t head_dim, const float* inv_sum) {
  for (int64_t d = 0; d < head_dim; d += kKeyChunk) {
    FloatVec acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = FloatVec{};
    for_each_row(values, head_dim, [&](int64_t j, const T* v) {
      const FloatVec v0 = load_vec(v + d), v1 = load_vec(v + d + kLanes);
      for (int r = 0; r < ROWS; ++r) {
        const float w = p[r * p_stride + j];
        acc[r][0] += w * v0;
        acc[r][1] += w * v1;
      }
    });
    for (int r = 0; r < ROWS; ++r) {
      store_vec(out_rows[r] + d, acc[r][0] * inv_sum[r]);
      store_vec(out_rows[r] + d + kLanes, acc[r][1] * inv_sum[r]);
    }
  }
}

// Both tile kernels for 1 .. kTileRows rows, indexed by rows - 1 (the last
// tile of a request is usually partial), for element type T.
template <typename T>
struct TileKernels {
  void (*scores)(float*, int64_t, const T* const*, const float*, int64_t, int64_t, int64_t, float);
  void (*values)(T* const*, const float*, int64_t, const PagedRows<T>&, int64_t, const float*);
};
template <typename T, int... Rows>
constexpr std::array<TileKernels<T>, sizeof...(Rows)> kernels_for(std::integer_sequence<int, Rows...>) {
  return {TileKernels<T>{&score_tile<Rows + 1, T>, &weighted_value_tile<Rows + 1, T>}...};
}
template <typename T>
constexpr auto kKernels = kernels_for<T>(std::make_integer_sequence<int, kTileRows>{});

// Everything one (request, KV head) work item reads.
template <typename T>
struct PrefillItem {
  const T* query;  // this request's first query row, head 0
  int64_t query_row_stride;  // elements between consecutive tokens' query rows
  T* out;  // this request's first output row (contiguous [q_len, Hq, D])
  int64_t first_head, group, num_heads, head_dim;
  int64_t q_len, num_context;  // query token i sits at position num_context + i
  PagedRows<T> keys, values;
};

template <typename T>
void prefill_one_kv_head(const PrefillItem<T>& item, float scale, std::vector<float>& scratch) {
  const int64_t dim = item.head_dim, seq_len = item.keys.len;
  const int64_t kt_stride = (seq_len + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
  // scratch = K^T [dim, kt_stride] followed by the scores [kTileRows, kt_stride].
  scratch.assign((dim + kTileRows) * kt_stride, 0.f);
  float* kt = scratch.data();
  float* scores = kt + dim * kt_stride;
  for_each_row(item.keys, dim, [&](int64_t j, const T* k) {
    for (int64_t d = 0; d < dim; ++d) kt[d * kt_stride + j] = to_float(k[d]);
  });
  // Rows are (token, head) pairs, token-major, so a tile's last row has the
  // furthest causal limit and the tile needs keys up to that limit only.
  const int64_t total_rows = item.q_len * item.group;
  for (int64_t first = 0; first < total_rows; first += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, total_rows - first));
    const T* q_rows[kTileRows];
    T* out_rows[kTileRows];
    int64_t visible[kTileRows];  // keys row r may see: its position + 1
    for (int r = 0; r < rows; ++r) {
      const int64_t token = (first + r) / item.group, head = item.first_head + (first + r) % item.group;
      q_rows[r] = item.query + token * item.query_row_stride + head * dim;
      out_rows[r] = item.out + (token * item.num_heads + head) * dim;
      visible[r] = item.num_context + token + 1;
    }
    const int64_t num_keys = visible[rows - 1];
    const int64_t padded_keys = (num_keys + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
    kKernels<T>[rows - 1].scores(scores, kt_stride, q_rows, kt, kt_stride, dim, padded_keys, scale);
    float inv_sum[kTileRows];
    for (int r = 0; r < rows; ++r) {
      float* p = scores + r * kt_stride;
      const float max_score = *std::max_element(p, p + visible[r]);
      inv_sum[r] = 1.f / exp_and_sum(p, visible[r], max_score);
      std::fill(p + visible[r], p + num_keys, 0.f);  // the causal mask: later keys weigh nothing
    }
    PagedRows<T> values = item.values;
    values.len = num_keys;
    kKernels<T>[rows - 1].values(out_rows, scores, kt_stride, values, dim, inv_sum);
  }
}

}  // namespace

bool paged_prefill_supports(int64_t head_dim) { return head_dim > 0 && head_dim % kKeyChunk == 0; }

// query [T, Hq, D] (token rows may be strided, heads dense); out [T, Hq, D]
// contiguous; requests first_req .. R-1 own rows query_start_loc[r] ..
// query_start_loc[r+1]; seq_lens[r] counts their keys, this step's included
// (already written to the cache). Rows of other requests are not touched.
// query, out and the caches are all fp32 or all bf16.
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_start_loc,
                             torch::Tensor seq_lens, int64_t first_req, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [tokens, heads, head_dim] with dense heads");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1,
              "block_table must be int32 with contiguous rows");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "query_start_loc and seq_lens must be int32");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(paged_prefill_supports(head_dim), "head_dim must be a multiple of ", kKeyChunk, ", got ", head_dim);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * head_dim;
  const int64_t block_stride = key_cache.stride(0);  // see PagedRows
  const int64_t num_reqs = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  dispatch_float_bf16(query.scalar_type(), "paged_prefill_attention", [&](auto zero) {
    using scalar_t = decltype(zero);
    check_contiguous_as(out, query.scalar_type(), "out");
    check_paged_cache(key_cache, query.scalar_type(), "key_cache");
    check_paged_cache(value_cache, query.scalar_type(), "value_cache");
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    // Work items: (request, KV head); cost ~ query rows x keys.
    std::vector<PrefillItem<scalar_t>> items;
    std::vector<int64_t> cost;
    for (int64_t r = first_req; r < num_reqs; ++r) {
      const int64_t q_len = qsl[r + 1] - qsl[r], seq_len = lens[r];
      if (q_len <= 0) continue;
      const int32_t* blocks = table + r * block_table.stride(0);
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        const PagedRows<scalar_t> keys{kc + g * head_dim, blocks, block_size, row_stride, block_stride, seq_len};
        const PagedRows<scalar_t> values{vc + g * head_dim, blocks, block_size, row_stride, block_stride, seq_len};
        items.push_back(PrefillItem<scalar_t>{query.data_ptr<scalar_t>() + qsl[r] * query.stride(0),
                                              query.stride(0),
                                              out.data_ptr<scalar_t>() + qsl[r] * num_heads * head_dim, g * group,
                                              group, num_heads, head_dim, q_len, seq_len - q_len, keys, values});
        cost.push_back(q_len * seq_len);
      }
    }
    run_longest_first(cost,
                      [&](std::vector<float>& scratch, int64_t i) { prefill_one_kv_head(items[i], fscale, scratch); });
  });
}
