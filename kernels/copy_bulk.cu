// tiercache bulk-copy kernel (sm_90+): gather/scatter of whole blocks or of the first tokens of
// each block through the Tensor Memory Accelerator's non-tensor bulk copies (cp.async.bulk),
// global -> shared -> global. Either side may be pinned host memory (unified addressing).
//
// Block i is read at src_base + src_off[i] and written at dst_base + dst_off[i]. Each block is
// `segs` segments of `seg_bytes` bytes, segment r at byte offset r * seg_stride (whole blocks:
// segs = 1; the partial copies of copy_blocks.cu: one segment per (layer, kv, head)).
// Segments longer than `chunk` are cut into pieces of `chunk` bytes; shorter ones are packed
// `chunk / seg_bytes` to a piece. Every size, offset and address is a multiple of 16 bytes (the
// host checks).
//
// One warp per CTA drives a ring of STAGES shared-memory buffers of `chunk` bytes, each with an
// mbarrier: the loads of group k + AHEAD are in flight while group k is stored. The 32 lanes
// issue the bulk copies of a group's units between them, so short segments (256 bytes for one
// token of one head) still keep STAGES * chunk bytes in flight per CTA.
//
// Reuse of a buffer: bulk async-groups are per thread, so before group k reloads buffer
// k % STAGES every lane waits until its stores of group k - STAGES have finished reading shared
// memory (cp.async.bulk.wait_group.read with the count of store groups committed since), then
// the warp syncs.

// Two shapes are compiled (the host picks one per launch):
//   tc_bulk_copy        4 buffers of `chunk` bytes (16 KiB: 64 KiB of shared memory), loads 2
//                       groups ahead (so one store group may still be reading a buffer while the
//                       next is reloaded): the most bytes in flight per CTA (of the rings tried
//                       on 8 SMs beside a bf16 GEMM, benchmarks/copy_variants.py `large`);
//   tc_bulk_copy_small  2 buffers of `chunk` bytes (2 KiB), at most 32 registers per thread:
//                       a CTA small enough to sit beside a compute kernel's CTAs on the same SM
//                       (cuBLAS's bf16 GEMM on an H100 leaves 1024 registers and ~6 KiB of shared
//                       memory per SM), so the copy neither waits for SMs nor takes them.
// Groups are claimed from a counter (`claim[0]`, zero before the launch), several consecutive
// ones per atomic, instead of dealt by CTA index, so CTAs that start late (their SM was busy)
// find the work done by others and exit.
// `claim[1 + smid]` (zero before the launch, 256 words) counts this launch's CTAs per SM: a CTA
// that finds `per_sm` already running on its SM exits at once, so the copy never holds more
// than `per_sm` CTAs' worth of one SM (the scheduler otherwise stacks several small CTAs on one
// SM, and then a compute CTA that needs that SM's leftover registers cannot start there).

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
#endif

struct Units {
    long long unit;  // bytes per unit (a whole segment, or a piece of a long one)
    long long ups;   // units per segment
    long long per;   // units per group (one shared-memory buffer)
    long long segs, seg_stride, seg_bytes;

    // byte offset of unit u inside its block and its length
    __device__ __forceinline__ void locate(long long u, long long& blk, long long& off, unsigned& bytes) const {
        const long long q = u / ups, piece = u - q * ups;
        blk = q / segs;
        const long long r = q - blk * segs;
        off = r * seg_stride + piece * unit;
        const long long left = seg_bytes - piece * unit;
        bytes = (unsigned)(left < unit ? left : unit);
    }
};

// STAGES buffers; loads run AHEAD groups ahead of stores (1 <= AHEAD < STAGES); TAKE groups per claim;
// WRITES >= 0: after each store group, wait until at most WRITES of this lane's store groups are
// still writing (bounds the writes in flight; -1: no bound beyond the ring's)
template <int STAGES, int AHEAD, int TAKE, int WRITES = -1>
__device__ __forceinline__ void bulk_copy(const unsigned char* src_base, unsigned char* dst_base,
                                          const long long* src_off, const long long* dst_off, long long n_blocks,
                                          long long segs, long long seg_stride, long long seg_bytes, long long chunk,
                                          unsigned long long* claim, int per_sm) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(AHEAD >= 1 && AHEAD < STAGES, "AHEAD must be in [1, STAGES)");
    // store groups committed after the one that last used the buffer being reloaded
    constexpr int NEWER = STAGES - 1 - AHEAD;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[STAGES];
    __shared__ long long group_of[STAGES];  // the group each buffer holds
    const int lane = threadIdx.x;
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bars[s])) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    int crowded = 0;
    if (lane == 0 && per_sm > 0) {
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        if (smid < 256) crowded = atomicAdd(&claim[1 + smid], 1ULL) >= (unsigned long long)per_sm;
    }
    if (__shfl_sync(0xffffffffu, crowded, 0)) return;
    Units U;
    U.unit = seg_bytes < chunk ? seg_bytes : chunk;
    U.ups = (seg_bytes + U.unit - 1) / U.unit;
    U.per = chunk / U.unit;
    U.segs = segs;
    U.seg_stride = seg_stride;
    U.seg_bytes = seg_bytes;
    const long long units = n_blocks * segs * U.ups;
    const long long groups = (units + U.per - 1) / U.per;
    long long loaded = 0, stored = 0;
    long long next = 0, last = 0;  // groups [next, last) claimed and not yet loaded
    bool more = true;
    while (more || stored < loaded) {
        if (more && next == last) {  // claim TAKE consecutive groups at a time: one atomic per TAKE loads
            long long g = 0;
            if (lane == 0) g = (long long)atomicAdd(claim, (unsigned long long)TAKE);
            next = __shfl_sync(0xffffffffu, g, 0);
            last = min(next + TAKE, groups);
            more = next < groups;
        }
        if (more) {
            const long long g = next++;
            {  // load group g into buffer loaded % STAGES
                const int s = (int)(loaded % STAGES);
                if (loaded >= STAGES) {  // the stores of group loaded - STAGES must be done reading it
                    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(NEWER) : "memory");
                    __syncwarp();
                }
                const long long u0 = g * U.per, u1 = min(u0 + U.per, units);
                const unsigned bar = smem_addr(&bars[s]);
                if (lane == 0) {
                    group_of[s] = g;
                    long long blk, off;
                    unsigned bytes;
                    U.locate(u0, blk, off, bytes);  // the one unit when segments are cut into pieces
                    const unsigned total = U.ups == 1 ? (unsigned)((u1 - u0) * seg_bytes) : bytes;
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(total)
                                 : "memory");
                }
                __syncwarp();
                for (long long u = u0 + lane; u < u1; u += 32) {
                    long long blk, off;
                    unsigned bytes;
                    U.locate(u, blk, off, bytes);
                    asm volatile(
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                        :: "r"(smem_addr(smem + s * chunk + (u - u0) * U.unit)), "l"(src_base + src_off[blk] + off),
                           "r"(bytes), "r"(bar)
                        : "memory");
                }
                ++loaded;
            }
        }
        if (loaded - stored > AHEAD || (!more && stored < loaded)) {  // store the oldest loaded group
            const int s = (int)(stored % STAGES);
            bar_wait(smem_addr(&bars[s]), (unsigned)((stored / STAGES) & 1));
            const long long g = group_of[s];
            const long long u0 = g * U.per, u1 = min(u0 + U.per, units);
            for (long long u = u0 + lane; u < u1; u += 32) {
                long long blk, off;
                unsigned bytes;
                U.locate(u, blk, off, bytes);
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                             :: "l"(dst_base + dst_off[blk] + off), "r"(smem_addr(smem + s * chunk + (u - u0) * U.unit)),
                                "r"(bytes)
                             : "memory");
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            if constexpr (WRITES >= 0) asm volatile("cp.async.bulk.wait_group %0;" :: "n"(WRITES) : "memory");
            ++stored;
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
    __trap();  // bulk copies need sm_90; the host never launches these kernels below it
#endif
}

#define TC_BULK_ARGS                                                                                          \
    const unsigned char *src_base, unsigned char *dst_base, const long long *src_off, const long long *dst_off, \
        long long n_blocks, long long segs, long long seg_stride, long long seg_bytes, long long chunk,         \
        unsigned long long *claim, int per_sm
#define TC_BULK_PASS src_base, dst_base, src_off, dst_off, n_blocks, segs, seg_stride, seg_bytes, chunk, claim, per_sm

#ifndef TC_STAGES
#define TC_STAGES 4
#endif
#ifndef TC_AHEAD
#define TC_AHEAD (TC_STAGES - 2)
#endif
#ifndef TC_WRITES
#define TC_WRITES -1
#endif

extern "C" __global__ void __launch_bounds__(32) tc_bulk_copy(TC_BULK_ARGS) {
    bulk_copy<TC_STAGES, TC_AHEAD, TC_STAGES, TC_WRITES>(TC_BULK_PASS);
}

// 32 threads x at most 32 registers: one warp's share of what a large compute CTA leaves
extern "C" __global__ void __maxnreg__(32) tc_bulk_copy_small(TC_BULK_ARGS) {
    bulk_copy<2, 1, 4>(TC_BULK_PASS);
}
