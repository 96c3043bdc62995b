// Causal attention for the prefill (and chunked-prefill) requests of a step,
// all of them in one call, over K/V that already sit in the paged cache.
//
// Chapter 7 (a prefill step is compute-bound: hundreds of query tokens meet
// hundreds of keys; "Long prompts: attention in tiles"); chapter 3 explains
// chunked prefill, chapter 4 the blocks.
// vLLM 0.32 counterpart: the prefill half of csrc/cpu/cpu_attn_impl.hpp behind
// vllm/v1/attention/backends/cpu_attn.py.
//
// The torch reference (torch_ref.py, _prefill_one) gathers each request's
// blocks and calls scaled_dot_product_attention once per request and layer.
// Here attention is done the way flash attention does it, in tiles that are
// small matrix products with the register tiling of gemm.cpp:
//
//   for each block of kKeyBlock keys (K^T and V copied once, as fp32):
//     for each tile of kTileRows query rows that can see the block:
//       S = Q_tile K_block^T                  (scores, [rows, keys])
//       m_new = max(m, rowmax(S))             (running max of each row)
//       P = exp(S - m_new), masked causally   (this block's softmax numerators)
//       l = l * exp(m - m_new) + rowsum(P)    (running denominator)
//       O = O * exp(m - m_new) + P V_block    (running output, fp32)
//   out = O / l
//
// This is the "online softmax": when a later block raises a row's maximum,
// what was summed so far is rescaled by exp(old max - new max), so no row
// ever needs all its scores at once. Scratch stays a few blocks in size,
// whatever the prompt's length, and a key block is read from memory once
// for all the query rows of a work item instead of once per tile (the first
// version of this kernel held a tile's whole score row, up to 2,048 keys, and
// streamed every key again for every tile of rows).
//
// A sliding-window layer (chapter 4) also gives each row a first key: the
// query at position p reads keys p - sliding_window + 1 .. p. Key blocks wholly
// before the first row's window are never loaded, rows whose window starts
// after a key block skip it, and the leading keys of a block that fall before
// a row's window are masked like the causal mask masks the trailing ones.
//
// A tile's rows are (token, head) pairs, token-major: a few consecutive tokens
// x the G query heads that share one KV head, so one pass over that head's
// keys serves them all. In bf16, K^T, V, scores and accumulators are fp32;
// only the query, the cached rows and the output are bf16.
#include "ops.h"
#include "paged.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cstring>
#include <utility>

namespace {

constexpr int64_t kKeyChunk = 2 * kLanes;  // keys per score tile: two vectors
// Keys per block: K^T [D, 128] and V [128, D] in fp32 are 32 KB each at
// D = 64, so both stay in the core's L2 (512 KB or more) while every query
// tile of the work item passes over them.
constexpr int64_t kKeyBlock = 128;
// Query tokens per work item (x G heads = its rows). Long prompts are split
// so that both cores get work even when a model has few KV heads (SmolLM2
// has 3: with one item per KV head, one core would do two and the other one).
constexpr int64_t kQueryBlockTokens = 128;

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
      store_vec(s + r * s_stride + j, acc[r][0] * scale);
      store_vec(s + r * s_stride + j + kLanes, acc[r][1] * scale);
    }
  }
}

// o_r = rescale[r] * o_r + sum_j p[r][j] v_j over j < num_keys, two vectors of
// output dimensions at a time (head_dim is a multiple of kKeyChunk). o holds the running
// fp32 outputs [rows, head_dim]; v is the block's values [keys, head_dim].
template <int ROWS>
void accumulate_value_tile(float* o, const float* p, int64_t p_stride, const float* v, int64_t num_keys,
                           int64_t head_dim, const float* rescale) {
  for (int64_t d = 0; d < head_dim; d += kKeyChunk) {
    FloatVec acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) {
      acc[r][0] = load_vec(o + r * head_dim + d) * rescale[r];
      acc[r][1] = load_vec(o + r * head_dim + d + kLanes) * rescale[r];
    }
    for (int64_t j = 0; j < num_keys; ++j) {
      const FloatVec v0 = load_vec(v + j * head_dim + d), v1 = load_vec(v + j * head_dim + d + kLanes);
      for (int r = 0; r < ROWS; ++r) {
        const float w = p[r * p_stride + j];
        acc[r][0] += w * v0;
        acc[r][1] += w * v1;
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      store_vec(o + r * head_dim + d, acc[r][0]);
      store_vec(o + r * head_dim + d + kLanes, acc[r][1]);
    }
  }
}

// Both tile kernels for 1 .. kTileRows rows, indexed by rows - 1 (a block's
// first and last tiles are usually partial), for element type T.
template <typename T>
struct TileKernels {
  void (*scores)(float*, int64_t, const T* const*, const float*, int64_t, int64_t, int64_t, float);
  void (*values)(float*, const float*, int64_t, const float*, int64_t, int64_t, const float*);
};
template <typename T, int... Rows>
constexpr std::array<TileKernels<T>, sizeof...(Rows)> kernels_for(std::integer_sequence<int, Rows...>) {
  return {TileKernels<T>{&score_tile<Rows + 1, T>, &accumulate_value_tile<Rows + 1>}...};
}
template <typename T>
constexpr auto kKernels = kernels_for<T>(std::make_integer_sequence<int, kTileRows>{});

// Everything one work item reads: query tokens first_token .. first_token +
// num_tokens - 1 of one request, the G query heads of one KV head.
template <typename T>
struct PrefillItem {
  const T* query;  // this request's first query row, head 0
  int64_t query_row_stride;  // elements between consecutive tokens' query rows
  T* out;  // this request's first output row (contiguous [q_len, Hq, D])
  int64_t first_head, group, num_heads, head_dim;
  int64_t first_token, num_tokens;
  int64_t num_context;  // the request's query token i sits at position num_context + i
  int64_t sliding_window;  // keys a query reads back, itself included; <= 0: all
  PagedRows<T> keys, values;
};

// Copies keys first .. first + n - 1 into kt (K^T [head_dim, kKeyBlock], the
// columns from n to the next multiple of kKeyChunk zeroed) and their values into
// v ([n, head_dim]), both fp32.
template <typename T>
void load_key_block(float* kt, float* v, const PrefillItem<T>& item, int64_t first, int64_t n) {
  const int64_t dim = item.head_dim, padded = (n + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
  for (int64_t j = 0; j < n; ++j) {
    const T* k = row_at(item.keys, first + j);
    for (int64_t d = 0; d < dim; ++d) kt[d * kKeyBlock + j] = to_float(k[d]);
    const T* value = row_at(item.values, first + j);
    for (int64_t d = 0; d < dim; d += kLanes) store_vec(v + j * dim + d, load_vec(value + d));
  }
  for (int64_t d = 0; d < dim; ++d) std::fill(kt + d * kKeyBlock + n, kt + d * kKeyBlock + padded, 0.f);
}

// [anchor: online-softmax]
// Turns the scores of row r (keys skip[r] .. keys_seen[r]-1 of the block
// visible) into this block's softmax numerators in place, and updates the
// row's running max and sum; rescale[r] is what the row's output so far must
// be multiplied by. skip[r] is 0 but in a sliding window.
inline void online_softmax(float* scores, int rows, const int64_t* skip, const int64_t* keys_seen,
                           int64_t tile_keys, float* row_max, float* row_sum, float* rescale) {
  for (int r = 0; r < rows; ++r) {
    float* p = scores + r * kKeyBlock;
    const float new_max = std::max(row_max[r], *std::max_element(p + skip[r], p + keys_seen[r]));
    // The first block a row sees has nothing to rescale (its sum is still 0).
    rescale[r] = row_sum[r] == 0.f ? 0.f : std::exp(row_max[r] - new_max);
    row_sum[r] = row_sum[r] * rescale[r] + exp_and_sum(p + skip[r], keys_seen[r] - skip[r], new_max);
    row_max[r] = new_max;
    std::fill(p, p + skip[r], 0.f);                   // the window: earlier keys weigh nothing
    std::fill(p + keys_seen[r], p + tile_keys, 0.f);  // the causal mask: later keys weigh nothing
  }
}
// [/anchor: online-softmax]

template <typename T>
void prefill_work_item(const PrefillItem<T>& item, float scale, std::vector<float>& scratch) {
  const int64_t dim = item.head_dim, group = item.group;
  const int64_t total_rows = item.num_tokens * group;
  // Row i is (token first_token + i / G, head first_head + i % G) and sees
  // the keys at positions up to its own: num_context + token + 1 of them.
  auto token_of = [&](int64_t i) { return item.first_token + i / group; };
  auto head_of = [&](int64_t i) { return item.first_head + i % group; };
  auto keys_visible = [&](int64_t i) { return item.num_context + token_of(i) + 1; };
  // ... and, in a sliding window, none before its window's first key.
  auto first_visible = [&](int64_t i) { return first_key_in_window(keys_visible(i), item.sliding_window); };
  const int64_t last_key = keys_visible(total_rows - 1);
  // scratch: K^T block | V block | scores [kTileRows, kKeyBlock] | outputs O [rows, D] | max | sum.
  scratch.resize(2 * dim * kKeyBlock + kTileRows * kKeyBlock + total_rows * (dim + 2));
  float* kt = scratch.data();
  float* v = kt + dim * kKeyBlock;
  float* scores = v + dim * kKeyBlock;
  float* o = scores + kTileRows * kKeyBlock;
  float* row_max = o + total_rows * dim;
  float* row_sum = row_max + total_rows;
  std::fill(o, o + total_rows * dim, 0.f);
  std::fill(row_max, row_max + total_rows, -FLT_MAX);
  std::fill(row_sum, row_sum + total_rows, 0.f);
  // Row 0 reaches back furthest: no earlier key is read by any row.
  for (int64_t first_key = first_visible(0); first_key < last_key; first_key += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, last_key - first_key);
    load_key_block(kt, v, item, first_key, n);
    // Rows before this one see no key of the block (they end before it) ...
    const int64_t first_row = std::max<int64_t>(0, (first_key - item.num_context - item.first_token) * group);
    // ... nor do rows from this one on, whose window starts after the block.
    const int64_t end_row =
        item.sliding_window > 0
            ? std::clamp<int64_t>((first_key + n + item.sliding_window - 1 - item.num_context - item.first_token) * group,
                                  0, total_rows)
            : total_rows;
    for (int64_t first = first_row; first < end_row; first += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, end_row - first));
      const T* q_rows[kTileRows];
      int64_t keys_seen[kTileRows];  // of this block; >= 1 for every row from first_row on
      int64_t skip[kTileRows];       // leading keys of this block before the row's window; < keys_seen
      float rescale[kTileRows];
      for (int r = 0; r < rows; ++r) {
        q_rows[r] = item.query + token_of(first + r) * item.query_row_stride + head_of(first + r) * dim;
        keys_seen[r] = std::min(n, keys_visible(first + r) - first_key);
        skip[r] = std::max<int64_t>(0, first_visible(first + r) - first_key);
      }
      // Rows are token-major, so the tile's last row sees the most keys.
      const int64_t tile_keys = keys_seen[rows - 1];
      const int64_t padded_keys = (tile_keys + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
      kKernels<T>[rows - 1].scores(scores, kKeyBlock, q_rows, kt, kKeyBlock, dim, padded_keys, scale);
      online_softmax(scores, rows, skip, keys_seen, tile_keys, row_max + first, row_sum + first, rescale);
      kKernels<T>[rows - 1].values(o + first * dim, scores, kKeyBlock, v, tile_keys, dim, rescale);
    }
  }
  for (int64_t i = 0; i < total_rows; ++i) {
    T* out_row = item.out + (token_of(i) * item.num_heads + head_of(i)) * dim;
    const float inv_sum = 1.f / row_sum[i];
    for (int64_t d = 0; d < dim; d += kLanes) store_vec(out_row + d, load_vec(o + i * dim + d) * inv_sum);
  }
}

}  // namespace

bool paged_prefill_supports(int64_t head_dim) { return head_dim > 0 && head_dim % kKeyChunk == 0; }

// query [T, Hq, D] (token rows may be strided, heads dense); out [T, Hq, D]
// contiguous; requests first_req .. R-1 own rows query_start_loc[r] ..
// query_start_loc[r+1]; seq_lens[r] counts their keys, this step's included
// (already written to the cache). Rows of other requests are not touched.
// query, out and the caches are all fp32 or all bf16. sliding_window > 0:
// each query reads only its last sliding_window keys.
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_table, at::Tensor query_start_loc,
                             at::Tensor seq_lens, int64_t first_req, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [tokens, heads, head_dim] with dense heads");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table must be int32 with contiguous rows");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
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
    // Work items: (request, KV head, block of query tokens); cost ~ rows x keys seen.
    std::vector<PrefillItem<scalar_t>> items;
    std::vector<int64_t> cost;
    for (int64_t r = first_req; r < num_reqs; ++r) {
      const int64_t q_len = qsl[r + 1] - qsl[r], seq_len = lens[r];
      const int32_t* blocks = table + r * block_table.stride(0);
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        const PagedRows<scalar_t> keys{kc + g * head_dim, blocks, block_size, row_stride, block_stride, seq_len};
        const PagedRows<scalar_t> values{vc + g * head_dim, blocks, block_size, row_stride, block_stride, seq_len};
        for (int64_t t = 0; t < q_len; t += kQueryBlockTokens) {
          const int64_t tokens = std::min(kQueryBlockTokens, q_len - t);
          items.push_back(PrefillItem<scalar_t>{query.data_ptr<scalar_t>() + qsl[r] * query.stride(0),
                                                query.stride(0),
                                                out.data_ptr<scalar_t>() + qsl[r] * num_heads * head_dim,
                                                g * group, group, num_heads, head_dim, t, tokens,
                                                seq_len - q_len, sliding_window, keys, values});
          // rows x keys they read: up to their position, or a window's worth more than the rows
          const int64_t keys_read = seq_len - q_len + t + tokens;
          cost.push_back(tokens * (sliding_window > 0 ? std::min(keys_read, sliding_window + tokens) : keys_read));
        }
      }
    }
    run_longest_first(cost,
                      [&](std::vector<float>& scratch, int64_t i) { prefill_work_item(items[i], fscale, scratch); });
  });
}
