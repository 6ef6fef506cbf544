// tiercache bulk-copy kernel (sm_90+): whole-block gather/scatter through the Tensor Memory
// Accelerator's non-tensor bulk copies (cp.async.bulk), global -> shared -> global.
//
// One thread per CTA drives a ring of STAGES shared-memory buffers of `chunk` bytes: it issues a
// bulk load of piece k+STAGES-1 while the bulk store of piece k drains, so each SM keeps
// STAGES * chunk bytes in flight with one instruction per piece instead of one 16-byte load per
// thread. Work items are (block, piece) pairs, flattened; CTA c takes items c, c + gridDim.x, ...
// Block i is read at src_base + src_off[i] and written at dst_base + dst_off[i]; sizes and
// addresses must be multiples of 16 bytes (the host checks). Either side may be pinned host
// memory (unified addressing).

#define TC_STAGES 4

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}

extern "C" __global__ void tc_bulk_copy(const unsigned char* src_base, unsigned char* dst_base,
                                        const long long* src_off, const long long* dst_off,
                                        long long n_blocks, long long block_bytes, long long chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[TC_STAGES];
    if (threadIdx.x != 0) return;
    for (int s = 0; s < TC_STAGES; ++s) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bars[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const long long pieces = (block_bytes + chunk - 1) / chunk;
    const long long items = pieces * n_blocks;
    // my items: blockIdx.x + k * gridDim.x, k = 0 .. mine-1
    const long long first = blockIdx.x;
    const long long mine = first < items ? (items - first + gridDim.x - 1) / gridDim.x : 0;
    for (long long k = 0; k < mine + TC_STAGES - 1; ++k) {
        if (k < mine) {  // load piece k into stage k % STAGES
            const int s = (int)(k % TC_STAGES);
            if (k >= TC_STAGES) {  // stage s was stored from at step k - STAGES: let that store read it
                asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(TC_STAGES - 1) : "memory");
            }
            const long long item = first + k * gridDim.x;
            const long long blk = item / pieces, piece = item - blk * pieces;
            const long long off = piece * chunk;
            const unsigned bytes = (unsigned)min(chunk, block_bytes - off);
            const unsigned bar = smem_addr(&bars[s]);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                :: "r"(smem_addr(smem + s * chunk)), "l"(src_base + src_off[blk] + off), "r"(bytes), "r"(bar)
                : "memory");
        }
        const long long j = k - (TC_STAGES - 1);
        if (j >= 0 && j < mine) {  // store piece j once loaded
            const int s = (int)(j % TC_STAGES);
            bar_wait(smem_addr(&bars[s]), (unsigned)((j / TC_STAGES) & 1));
            const long long item = first + j * gridDim.x;
            const long long blk = item / pieces, piece = item - blk * pieces;
            const long long off = piece * chunk;
            const unsigned bytes = (unsigned)min(chunk, block_bytes - off);
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(dst_base + dst_off[blk] + off), "r"(smem_addr(smem + s * chunk)), "r"(bytes)
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
    __trap();  // bulk copies need sm_90; the host never launches this kernel below it
#endif
}
