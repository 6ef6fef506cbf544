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
// The work is flattened into VEC-byte chunks; a grid-stride loop (the host sizes the grid to
// bound the SMs a copy may occupy) gives each thread UNROLL independent chunks per step, all
// loads issued before the stores, to keep many PCIe reads in flight. Index arithmetic is 32-bit
// when the batch has fewer than 2^31 chunks (the usual case), 64-bit otherwise. VEC is 16 (uint4)
// when every pointer, offset, stride and length is 16-byte aligned, else 8, 4 or 1.

// Loads ask L2 to fetch 256 bytes at a time (PTX .L2::256B prefetch size). Over PCIe this
// turns the SMs' 128-byte reads of pinned host memory into larger requests: scattered 16 KiB
// copies went from 84-88% to 92-97% of a contiguous cudaMemcpyAsync on an H100
// (benchmarks/copy_variants.py).
template <typename T>
__device__ __forceinline__ T load_hinted(const T* p) { return *p; }
template <>
__device__ __forceinline__ uint4 load_hinted<uint4>(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
template <>
__device__ __forceinline__ uint2 load_hinted<uint2>(const uint2* p) {
    uint2 v;
    asm volatile("ld.global.L2::256B.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
template <>
__device__ __forceinline__ unsigned int load_hinted<unsigned int>(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.global.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

template <typename T>
struct Vec;
template <> struct Vec<uint4> { static constexpr int bytes = 16; };
template <> struct Vec<uint2> { static constexpr int bytes = 8; };
template <> struct Vec<unsigned int> { static constexpr int bytes = 4; };
template <> struct Vec<unsigned char> { static constexpr int bytes = 1; };

template <typename T, int UNROLL, typename I>
__device__ __forceinline__ void copy_loop(const unsigned char* __restrict__ src_base,
                                          unsigned char* __restrict__ dst_base,
                                          const long long* __restrict__ src_off,
                                          const long long* __restrict__ dst_off, I total,
                                          I chunks_per_block, I chunks_per_seg, long long seg_stride,
                                          bool whole) {
    const I stride = (I)gridDim.x * blockDim.x;
    for (I g = (I)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride * UNROLL) {
        T v[UNROLL];
        T* dptr[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const I c = g + u * stride;
            dptr[u] = nullptr;
            if (c < total) {
                const I blk = c / chunks_per_block;
                const I rem = c - blk * chunks_per_block;
                long long off;
                if (whole) {
                    off = (long long)rem * Vec<T>::bytes;
                } else {
                    const I seg = rem / chunks_per_seg;
                    off = (long long)seg * seg_stride + (long long)(rem - seg * chunks_per_seg) * Vec<T>::bytes;
                }
                v[u] = load_hinted<T>(reinterpret_cast<const T*>(src_base + src_off[blk] + off));
                dptr[u] = reinterpret_cast<T*>(dst_base + dst_off[blk] + off);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (dptr[u] != nullptr) *dptr[u] = v[u];
        }
    }
}

template <typename T, int UNROLL>
__device__ __forceinline__ void copy_blocks(const unsigned char* src_base, unsigned char* dst_base,
                                            const long long* src_off, const long long* dst_off,
                                            long long n_blocks, long long segs, long long seg_stride,
                                            long long seg_bytes) {
    const long long cps = seg_bytes / Vec<T>::bytes;
    const long long cpb = cps * segs;
    const long long total = cpb * n_blocks;
    const bool whole = segs == 1;
    // 32-bit indices while g + UNROLL * stride cannot overflow
    const long long slack = (long long)UNROLL * gridDim.x * blockDim.x;
    if (total + slack < 0x7fffffffLL) {
        copy_loop<T, UNROLL, unsigned int>(src_base, dst_base, src_off, dst_off, (unsigned int)total,
                                           (unsigned int)cpb, (unsigned int)cps, seg_stride, whole);
    } else {
        copy_loop<T, UNROLL, long long>(src_base, dst_base, src_off, dst_off, total, cpb, cps,
                                        seg_stride, whole);
    }
}

#define TC_COPY_KERNEL(NAME, T, UNROLL)                                                          \
    extern "C" __global__ void NAME(const unsigned char* src_base, unsigned char* dst_base,      \
                                    const long long* src_off, const long long* dst_off,          \
                                    long long n_blocks, long long segs, long long seg_stride,    \
                                    long long seg_bytes) {                                       \
        copy_blocks<T, UNROLL>(src_base, dst_base, src_off, dst_off, n_blocks, segs, seg_stride, \
                               seg_bytes);                                                       \
    }

TC_COPY_KERNEL(tc_copy_v16_u4, uint4, 4)
TC_COPY_KERNEL(tc_copy_v16_u8, uint4, 8)
TC_COPY_KERNEL(tc_copy_v8_u4, uint2, 4)
TC_COPY_KERNEL(tc_copy_v8_u8, uint2, 8)
TC_COPY_KERNEL(tc_copy_v4_u4, unsigned int, 4)
TC_COPY_KERNEL(tc_copy_v4_u8, unsigned int, 8)
TC_COPY_KERNEL(tc_copy_v1_u4, unsigned char, 4)
TC_COPY_KERNEL(tc_copy_v1_u8, unsigned char, 8)

// Debug only: keep the stream busy for `ns` nanoseconds (delays the copies queued after it, so
// tests can show what happens to a transfer that is still in flight).
extern "C" __global__ void tc_spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < ns);
}
