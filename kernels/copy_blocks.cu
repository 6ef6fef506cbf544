// tiercache copy kernels: batched gather/scatter and partial (first-N-tokens) block copies.
//
// One launch copies n_blocks blocks. Block i is read at src_base + src_off[i] and written at
// dst_base + dst_off[i]. Each block is `segs` segments of `seg_bytes` bytes, segment r at byte
// offset r * seg_stride inside the block:
//   - whole blocks:               segs = 1, seg_bytes = block_nbytes
//   - layer-major partial copy:   block [L, K, H, T, D]: segs = L*K*H, seg_stride = T*D*itemsize,
//                                 seg_bytes = num_tokens*D*itemsize
//   - token-major partial copy:   segs = 1, seg_bytes = num_tokens * (bytes per token)
// Either side may be device memory or pinned host memory (unified virtual addressing), so the
// same kernel does host->device, device->host and device->device.
//
// The work is flattened into VEC-byte chunks; a grid-stride loop (the grid is sized by the host
// to bound the SMs a copy may occupy) gives each thread UNROLL independent chunks per step, all
// loads issued before the stores, to keep many PCIe reads in flight. VEC is 16 (uint4) when
// every pointer, offset, stride and length is 16-byte aligned, else 8, 4 or 1.


template <typename T>
struct Vec;
template <> struct Vec<uint4> { static constexpr int bytes = 16; };
template <> struct Vec<uint2> { static constexpr int bytes = 8; };
template <> struct Vec<unsigned int> { static constexpr int bytes = 4; };
template <> struct Vec<unsigned char> { static constexpr int bytes = 1; };

template <typename T, int UNROLL>
__device__ __forceinline__ void copy_chunks(const unsigned char* __restrict__ src_base,
                                            unsigned char* __restrict__ dst_base,
                                            const long long* __restrict__ src_off,
                                            const long long* __restrict__ dst_off,
                                            long long n_blocks, long long segs, long long seg_stride,
                                            long long seg_bytes) {
    const long long chunks_per_seg = seg_bytes / Vec<T>::bytes;
    const long long chunks_per_block = chunks_per_seg * segs;
    const long long total = chunks_per_block * n_blocks;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; g < total; g += stride * UNROLL) {
        T v[UNROLL];
        T* dptr[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long c = g + u * stride;
            dptr[u] = nullptr;
            if (c < total) {
                const long long blk = c / chunks_per_block;
                const long long rem = c - blk * chunks_per_block;
                const long long seg = rem / chunks_per_seg;
                const long long off = seg * seg_stride + (rem - seg * chunks_per_seg) * Vec<T>::bytes;
                v[u] = *reinterpret_cast<const T*>(src_base + src_off[blk] + off);
                dptr[u] = reinterpret_cast<T*>(dst_base + dst_off[blk] + off);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (dptr[u] != nullptr) *dptr[u] = v[u];
        }
    }
}

#define TC_COPY_KERNEL(NAME, T)                                                                  \
    extern "C" __global__ void NAME(const unsigned char* src_base, unsigned char* dst_base,      \
                                    const long long* src_off, const long long* dst_off,          \
                                    long long n_blocks, long long segs, long long seg_stride,    \
                                    long long seg_bytes) {                                       \
        copy_chunks<T, 4>(src_base, dst_base, src_off, dst_off, n_blocks, segs, seg_stride,      \
                          seg_bytes);                                                            \
    }

TC_COPY_KERNEL(tc_copy_v16, uint4)
TC_COPY_KERNEL(tc_copy_v8, uint2)
TC_COPY_KERNEL(tc_copy_v4, unsigned int)
TC_COPY_KERNEL(tc_copy_v1, unsigned char)

// Debug only: keep the stream busy for `ns` nanoseconds (delays the copies queued after it, so
// tests can show what happens to a transfer that is still in flight).
extern "C" __global__ void tc_spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < ns);
}
