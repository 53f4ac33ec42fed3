// Paged attention for decode steps: one query token per sequence, reading the sequence's keys and
// values in place from the KV cache's blocks through its block table.
//
// One thread block per (query head, sequence), WARPS warps. Warp w takes positions w, w + WARPS,
// ...; its 32 lanes split the head dimension (lane l holds elements l, l + 32, ...), so a key or
// value row is read in one coalesced pass and a score is a shuffle reduction. Each warp keeps a
// running softmax (max, sum, weighted values: "online softmax"), and warp 0 merges the warps'
// partial results at the end: no bound on the context length, no scores in memory.
// `decode_reference` in paged_kernel.rs is this algorithm on the CPU, tested against the
// attention built from candle operations.

#define WARPS 4
#define MAX_PER_LANE 8  // head_dim up to 256

extern "C" __global__ void paged_decode_f32(
    const float* __restrict__ q,              // [seqs, n_heads, head_dim]
    const float* __restrict__ keys,           // [blocks, n_kv_heads, block_size, head_dim]
    const float* __restrict__ values,         // same
    const unsigned int* __restrict__ tables,  // [seqs, width]
    const unsigned int* __restrict__ lens,    // [seqs]: positions to attend to
    float* __restrict__ out,                  // [seqs, n_heads, head_dim]
    int n_heads, int n_kv_heads, int block_size, int head_dim, int width, float scale) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_head = head / (n_heads / n_kv_heads);
  const int per_lane = head_dim / 32;
  const float* qh = q + ((size_t)seq * n_heads + head) * head_dim;

  float qr[MAX_PER_LANE], acc[MAX_PER_LANE];
  for (int i = 0; i < per_lane; ++i) {
    qr[i] = qh[lane + 32 * i] * scale;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int len = lens[seq];
  for (int j = warp; j < len; j += WARPS) {
    const unsigned int block = tables[(size_t)seq * width + j / block_size];
    const size_t at =
        (((size_t)block * n_kv_heads + kv_head) * block_size + j % block_size) * head_dim;
    float s = 0.f;
    for (int i = 0; i < per_lane; ++i) s += qr[i] * keys[at + lane + 32 * i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);
    const float p = expf(s - m_new);
    l = l * correction + p;
    for (int i = 0; i < per_lane; ++i)
      acc[i] = acc[i] * correction + p * values[at + lane + 32 * i];
    m = m_new;
  }

  __shared__ float part_max[WARPS], part_sum[WARPS];
  __shared__ float part_acc[WARPS][32 * MAX_PER_LANE];
  if (lane == 0) {
    part_max[warp] = m;
    part_sum[warp] = l;
  }
  for (int i = 0; i < per_lane; ++i) part_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  float top = part_max[0];
  for (int w = 1; w < WARPS; ++w) top = fmaxf(top, part_max[w]);
  float sum = 0.f, r[MAX_PER_LANE];
  for (int i = 0; i < per_lane; ++i) r[i] = 0.f;
  for (int w = 0; w < WARPS; ++w) {
    const float e = expf(part_max[w] - top);  // 0 for a warp that saw no position
    sum += part_sum[w] * e;
    for (int i = 0; i < per_lane; ++i) r[i] += part_acc[w][lane + 32 * i] * e;
  }
  float* o = out + ((size_t)seq * n_heads + head) * head_dim;
  for (int i = 0; i < per_lane; ++i) o[lane + 32 * i] = r[i] / sum;
}
