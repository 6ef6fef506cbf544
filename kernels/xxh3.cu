// XXH3-64 (seed 0, the default secret) of rows of device memory, bit-exact with the xxhash
// library's XXH3_64bits for inputs of more than 240 bytes (its "long" form), so a block file's
// data checksum can be checked, or made, where the data is: in VRAM.
//
// Algorithm: XXH3 by Yann Collet (xxhash, https://github.com/Cyan4973/xxHash, BSD-2-Clause),
// long-input form: 8 lanes of 64-bit accumulators; every 64-byte stripe adds, per lane i,
// the data word (to lane i ^ 1) and the product of the low and high 32 bits of (data word ^
// secret word) (to lane i); after every 16 stripes (a 1024-byte block) each lane is
// scrambled (xorshift 47, xor a secret word, multiply by PRIME32_1); then the last partial
// block, the input's last stripe, and a merge of the lanes with an avalanche.
//
// The sums within a block do not depend on their order, and a lane's scramble depends only on
// that lane. So the work is split in two launches:
//   tc_xxh3_blocks  every warp takes whole 1024-byte blocks of a row (grid: splits x rows) and
//                   writes each block's 8 lane sums to part[row][block][lane]: all the data is
//                   read here, coalesced, by the whole GPU.
//   tc_xxh3_finish  one thread block per row: 8 threads run the lanes' chain of add-and-scramble
//                   over the blocks' sums (staged through shared memory), then the tail and the
//                   merge; out[row] is the row's XXH3-64.
// The secret comes from the host library (XXH3_generateSecret_fromSeed with seed 0 gives the
// default secret), 192 bytes in device memory; the constants below are the algorithm's primes.
//
// Rows start at base + row * pitch; base and pitch must be multiples of 8 (the host checks).

#define TC_STRIPE 64
#define TC_BLOCK 1024          // 16 stripes of the default 192-byte secret
#define TC_SECRET 192
#define TC_FINISH_CHUNK 256    // blocks' sums staged in shared memory per step (16 KiB)

__device__ __forceinline__ unsigned long long tc_ld64u(const unsigned char* p) {
    unsigned long long v = 0;
#pragma unroll
    for (int b = 7; b >= 0; --b) v = (v << 8) | p[b];
    return v;
}

__device__ __forceinline__ unsigned long long tc_mul32(unsigned long long x) {
    return (unsigned long long)(unsigned int)x * (x >> 32);
}

extern "C" __global__ void tc_xxh3_blocks(const unsigned char* __restrict__ base, long long pitch,
                                          long long nblocks, const unsigned long long* __restrict__ secret,
                                          unsigned long long* __restrict__ part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int i = lane & 7, s0 = lane >> 3;  // this thread's accumulator lane; first stripe
    const long long row = blockIdx.y;
    // stripe s, lane i reads the secret's 64-bit word s + i (byte 8 s + 8 i)
    unsigned long long key[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) key[k] = secret[s0 + 4 * k + i];
    const unsigned long long* row64 = (const unsigned long long*)(base + row * pitch);
    for (long long blk = (long long)blockIdx.x * warps + warp; blk < nblocks; blk += (long long)gridDim.x * warps) {
        const unsigned long long* p = row64 + blk * (TC_BLOCK / 8);
        unsigned long long v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = p[lane + 32 * k];  // word lane + 32 k: stripe s0 + 4 k, lane i
        unsigned long long prod = 0, data = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            prod += tc_mul32(v[k] ^ key[k]);
            data += v[k];
        }
        // sum over the four threads of each lane i (lanes i, i + 8, i + 16, i + 24)
        prod += __shfl_xor_sync(0xffffffffu, prod, 8);
        data += __shfl_xor_sync(0xffffffffu, data, 8);
        prod += __shfl_xor_sync(0xffffffffu, prod, 16);
        data += __shfl_xor_sync(0xffffffffu, data, 16);
        // lane i's sum: its products plus the data words of lane i ^ 1
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, data, 1);
        if (lane < 8) part[(row * nblocks + blk) * 8 + lane] = prod + other;
    }
}

extern "C" __global__ void tc_xxh3_finish(const unsigned char* __restrict__ base, long long pitch, long long len,
                                          long long nblocks, const unsigned char* __restrict__ secret,
                                          const unsigned long long* __restrict__ part,
                                          unsigned long long* __restrict__ out) {
    __shared__ unsigned long long sums[TC_FINISH_CHUNK * 8];
    __shared__ unsigned long long accs[8];
    const long long row = blockIdx.x;
    const int t = threadIdx.x;
    const unsigned long long P32_1 = 0x9E3779B1ull, P32_2 = 0x85EBCA77ull, P32_3 = 0xC2B2AE3Dull;
    const unsigned long long P64_1 = 0x9E3779B185EBCA87ull, P64_2 = 0xC2B2AE3D27D4EB4Full,
                             P64_3 = 0x165667B19E3779F9ull, P64_4 = 0x85EBCA77C2B2AE63ull,
                             P64_5 = 0x27D4EB2F165667C5ull;
    const unsigned long long init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    unsigned long long acc = t < 8 ? init[t] : 0;
    const unsigned long long scramble_key = t < 8 ? tc_ld64u(secret + TC_SECRET - TC_STRIPE + 8 * t) : 0;
    const unsigned long long* rowpart = part + row * nblocks * 8;
    for (long long c0 = 0; c0 < nblocks; c0 += TC_FINISH_CHUNK) {
        const int n = (int)min((long long)TC_FINISH_CHUNK, nblocks - c0);
        __syncthreads();
        for (int q = t; q < n * 8; q += blockDim.x) sums[q] = rowpart[c0 * 8 + q];
        __syncthreads();
        if (t < 8) {
            for (int b = 0; b < n; ++b) {
                acc += sums[b * 8 + t];
                acc ^= acc >> 47;
                acc ^= scramble_key;
                acc *= P32_1;
            }
        }
    }
    if (t < 8) {
        const unsigned char* in = base + row * pitch;
        // the last partial block: its whole stripes, with the secret from its start
        const long long start = nblocks * TC_BLOCK;
        const long long stripes = ((len - 1) - start) / TC_STRIPE;
        for (long long s = 0; s < stripes; ++s) {
            const unsigned char* st = in + start + s * TC_STRIPE;
            const unsigned long long mine = tc_ld64u(st + 8 * t), twin = tc_ld64u(st + 8 * (t ^ 1));
            acc += tc_mul32(mine ^ tc_ld64u(secret + 8 * s + 8 * t)) + twin;
        }
        // the input's last stripe, with the secret 7 bytes before its last stripe
        const unsigned char* st = in + len - TC_STRIPE;
        const unsigned long long mine = tc_ld64u(st + 8 * t), twin = tc_ld64u(st + 8 * (t ^ 1));
        acc += tc_mul32(mine ^ tc_ld64u(secret + TC_SECRET - TC_STRIPE - 7 + 8 * t)) + twin;
        accs[t] = acc;
    }
    __syncthreads();
    if (t == 0) {
        unsigned long long h = (unsigned long long)len * P64_1;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned long long a = accs[2 * k] ^ tc_ld64u(secret + 11 + 16 * k);
            const unsigned long long b = accs[2 * k + 1] ^ tc_ld64u(secret + 11 + 16 * k + 8);
            h += (a * b) ^ __umul64hi(a, b);
        }
        h ^= h >> 37;
        h *= 0x165667919E3779F9ull;
        h ^= h >> 32;
        out[row] = h;
    }
}
