// tiercache token append: a decode step's new K/V tokens into a layer's tail block and into
// the ring buffer the attention reads, together with the tail's earlier tokens, in one launch.
//
// The ring's K and V live in two pools of one allocation (V at kv + pool_stride bytes), the
// tails' likewise (V at tails + tail_pool_stride): in VRAM, or in pinned host memory that the
// kernel reads and writes through its unified address. Within a pool, (sequence b, head h) =
// row r = b * heads + h of:
//   - the ring buffer: kv + ring_off + r * ring_row_stride, tokens contiguous (token t at
//     t * row_bytes)
//   - the layer's tail: tails + tail_off + r * tail_row_stride, tokens 0..tokens_per_block-1
// For ring tokens base + i, i in [0, n):
//   i <  split: ring <- tail token i                      (what earlier steps appended)
//   i >= split: ring <- new token i - split, tail token i <- the same bytes
// New tokens come from strided [batch, heads, q, head_dim] tensors (strides in bytes; the
// head_dim axis contiguous), as attention projections hand them over.
//
// The work is flattened into VEC-byte chunks (VEC = 16 when every address, stride and row is
// 16-byte aligned, else 1), a grid-stride loop over 2 pools x rows x n tokens x chunks.

template <typename T>
__device__ __forceinline__ void append_chunks(
    unsigned long long kv, long long pool_stride, long long tail_off, long long ring_off,
    long long ring_row_stride, long long tail_row_stride, unsigned long long tails, long long tail_pool_stride,
    unsigned long long new_k, unsigned long long new_v,
    long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh, long long v_st,
    int heads, int rows, int row_bytes, int base, int split, int n) {
    const long long per_row = row_bytes / (int)sizeof(T);
    const long long total = 2LL * rows * n * per_row;
    for (long long w = blockIdx.x * (long long)blockDim.x + threadIdx.x; w < total;
         w += (long long)gridDim.x * blockDim.x) {
        long long c = w % per_row;
        long long rest = w / per_row;
        int i = (int)(rest % n);
        rest /= n;
        int r = (int)(rest % rows);
        int p = (int)(rest / rows);
        char* pool = (char*)kv + p * pool_stride;
        char* tail = (char*)tails + p * tail_pool_stride + tail_off + r * tail_row_stride + (long long)i * row_bytes;
        T* ring = (T*)(pool + ring_off + r * ring_row_stride + (long long)(base + i) * row_bytes) + c;
        if (i < split) {
            *ring = ((const T*)tail)[c];
        } else {
            int b = r / heads, h = r % heads;
            long long u = i - split;
            const char* src = p == 0 ? (const char*)new_k + b * k_sb + h * k_sh + u * k_st
                                     : (const char*)new_v + b * v_sb + h * v_sh + u * v_st;
            T v = ((const T*)src)[c];
            *ring = v;
            ((T*)tail)[c] = v;
        }
    }
}

#define TC_APPEND(NAME, T)                                                                          \
    extern "C" __global__ void NAME(                                                                \
        unsigned long long kv, long long pool_stride, long long tail_off, long long ring_off,       \
        long long ring_row_stride, long long tail_row_stride,                                       \
        unsigned long long tails, long long tail_pool_stride,                                       \
        unsigned long long new_k, unsigned long long new_v,                                         \
        long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh, long long v_st, \
        int heads, int rows, int row_bytes, int base, int split, int n) {                           \
        append_chunks<T>(kv, pool_stride, tail_off, ring_off, ring_row_stride, tail_row_stride,     \
                         tails, tail_pool_stride, new_k, new_v, k_sb, k_sh, k_st, v_sb, v_sh, v_st, \
                         heads, rows, row_bytes, base, split, n);                                   \
    }

TC_APPEND(tc_kv_append_v16, uint4)
TC_APPEND(tc_kv_append_v1, unsigned char)
