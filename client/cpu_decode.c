/* Paged decode attention on the CPU: one new token per sequence, K/V read where they lie.
 *
 * Built and loaded by kvdaemon.client.cpu_decode (the system C compiler, first use,
 * -O3 -march=native); the Python side checks every shape, dtype and stride first.
 *
 * For each sequence (sequences are shared out over threads by their lengths; the
 * threads are torch's own OpenMP team where the caller passed its GOMP_parallel,
 * else started per call): positions are taken VW at a time (a chunk; VW lanes per
 * vector: 16 with AVX-512, else 8), and for each KV head its query heads are served
 * a few per pass (their sums stay in registers). Scores of a chunk's positions are
 * reduced together (reduce_lanes, no per-score horizontal sum), the online softmax
 * keeps a running max and sum per query head (fp32), and each V row is read once per
 * pass and added to every head of the pass. K and V are read in place, block by
 * block; while a chunk is computed, its V rows and the next chunk's K rows are
 * prefetched into L2 a row at a time (a burst of prefetches, or prefetches into L1,
 * stall on the line-fill buffers).
 *
 * 16 lanes (32 registers): a pass keeps its query rows and its output rows in
 * registers (HEADS_PER_PASS). 8 lanes (AVX2, 16 registers): attend_head8 serves all
 * of a KV head's query heads per chunk, K vectors loaded once for up to 8 heads whose
 * query rows are read from L1, V in blocks of two vectors for up to 4 heads.
 *
 * Semantics match the torch path: scores = q.k * scale, then softcap * tanh(s / softcap)
 * when softcap > 0; only positions p with len - window <= p < len when window > 0;
 * softmax in fp32, output cast to the dtype (bf16 rounds to nearest even).
 *
 * bf16 where the machine has more (head_dim a multiple of 32): with AMX, and 4 to 16
 * query heads per KV head, each chunk of a KV head is two tile products (scores of all
 * its query heads against K transposed into pairs, then their weights against V rows
 * paired), about 4x fewer instructions than vectors; else with AVX512-BF16 the dot
 * instruction takes bf16 pairs as they are (no widening). Both round the softmax
 * weights to bf16 before they meet V (as torch's bf16 SDPA does) and keep every sum
 * in fp32. A thread's tile configuration is put back as it was after each call.
 *
 * Types: fp32, bf16, fp16 (GCC vector extensions, which GCC lowers to whatever the
 * machine has). head_dim a multiple of 16, at most 256; query heads per KV head at
 * most MAX_GROUP.
 */
#include <math.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Lanes per vector: 16 where the machine has 512-bit vectors, else 8 (AVX2: 256 bits, 16
 * registers; GCC lowers 8-lane vectors to whatever other machines have). */
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh16 __attribute__((vector_size(VW * 2)));
typedef _Float16 vf16 __attribute__((vector_size(VW * 2)));

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
#define MAX_ND (256 / VW) /* vectors per row: head_dim <= 256 */
#define MAX_GROUP 32 /* query heads per KV head */
#define MAX_THREADS 64
#ifdef __AVX512BF16__
#define DOT_BF16 1 /* bf16 through vdpbf16ps (attend_chunk_dot) */
#else
#define DOT_BF16 0
#endif
#if DOT_BF16 && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define AMX_BF16 1 /* bf16 on the tile unit where the kernel lets the process use it (amx_ok) */
#include <sys/syscall.h>
#include <unistd.h>
#else
#define AMX_BF16 0
#endif
static int amx_ok; /* set once by kvd_decode_init */

struct decode_args {
    const void *query;
    int64_t query_row, query_head; /* element strides */
    const void *k_cache, *v_cache;
    int64_t k_block, k_slot, k_head, v_block, v_slot, v_head; /* element strides */
    const int32_t *block_tables;
    int64_t table_row, num_blocks;
    const int32_t *seq_lens;  /* per sequence of the table */
    const int64_t *seq_ids;   /* the decode sequences, and their query rows */
    const int64_t *rows;
    int64_t num_seqs;
    void *out;
    int64_t out_row, out_head;
    int64_t block_size, num_kv_heads, group, head_dim, window;
    float scale, softcap;
    int32_t dtype;
    int32_t num_threads;
};

#if VW == 16
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
#endif

static inline vf vmax(vf a, vf b)
{
    vi m = a > b;
    return (vf)((m & (vi)a) | (~m & (vi)b));
}

/* Lane i of SWAPk holds i xor k: shuffles that halve a vector's lanes into its sums. */
#if VW == 16
static const vi SWAP8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
static const vi SWAP4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
static const vi SWAP2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
static const vi SWAP1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
#else
static const vi SWAP4 = {4, 5, 6, 7, 0, 1, 2, 3};
static const vi SWAP2 = {2, 3, 0, 1, 6, 7, 4, 5};
static const vi SWAP1 = {1, 0, 3, 2, 5, 4, 7, 6};
#endif

static inline float hsum(vf v)
{
#if VW == 16
    v += __builtin_shuffle(v, SWAP8);
#endif
    v += __builtin_shuffle(v, SWAP4);
    v += __builtin_shuffle(v, SWAP2);
    v += __builtin_shuffle(v, SWAP1);
    return v[0];
}

static inline float hmax(vf v)
{
#if VW == 16
    v = vmax(v, __builtin_shuffle(v, SWAP8));
#endif
    v = vmax(v, __builtin_shuffle(v, SWAP4));
    v = vmax(v, __builtin_shuffle(v, SWAP2));
    v = vmax(v, __builtin_shuffle(v, SWAP1));
    return v[0];
}

/* e^x for x <= 0 (clamped at -87): 2^n * e^f with |f| <= ln2/2, Taylor to degree 7
 * (relative error about 5e-9, below fp32's rounding). */
static inline vf vexp(vf x)
{
    x = vmax(x, splat(-87.f));
    vf t = x * 1.4426950408889634f;
    vf n = (t + 12582912.f) - 12582912.f; /* round to nearest */
    vf f = (t - n) * 0.6931471805599453f;
    vf p = splat(1.f / 5040.f);
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

/* cap * tanh(x / cap), from e^(-2|x|/cap): never overflows. */
static inline vf vsoftcap(vf x, float cap)
{
    vi sign = (vi)x & (vi)splat(-0.f);
    vf ax = (vf)((vi)x & ~(vi)splat(-0.f));
    vf e = vexp(ax * (-2.f / cap));
    vf th = (1.f - e) / (1.f + e);
    return (vf)((vi)th | sign) * cap;
}

/* Whether any lane is set (a mask of compares). */
static inline int any_lane(vi x)
{
#if VW == 16
    return _mm512_test_epi32_mask((__m512i)x, (__m512i)x) != 0;
#elif defined(__AVX2__)
    return !_mm256_testz_si256((__m256i)x, (__m256i)x);
#else
    vi y = x | __builtin_shuffle(x, SWAP4);
    y |= __builtin_shuffle(y, SWAP2);
    y |= __builtin_shuffle(y, SWAP1);
    return y[0] != 0;
#endif
}

/* The online softmax over one chunk's scores s (lanes outside keep do not count):
 * the weights e^(s - m), 0 outside keep. The running max *m moves only when a score
 * passes it; then *corr (else 1) is what the sums and outputs so far must be scaled
 * by, and *lv, the running sums (one per lane, added up at the end), is scaled here. */
static inline vf softmax_chunk(vf s, vi keep, float *m, vf *lv, float *corr)
{
    const vf masked = (vf)(((vi)s & keep) | (~keep & (vi)splat(-INFINITY)));
    *corr = 1.f;
    if (any_lane(masked > splat(*m))) {
        const float top = hmax(masked);
        *corr = vexp(splat(*m - top))[0]; /* m = -inf: e^-87, times sums of 0 */
        *m = top;
        *lv *= *corr;
    }
    return (vf)((vi)vexp(s - *m) & keep);
}

/* VW vectors -> one vector of their VW sums; lane i holds the sum of a[PERM[i]]. Each
 * level adds pairs of half-width slices of two vectors: VW - 1 adds, twice the shuffles. */
static inline vf reduce_lanes(const vf *a)
{
#if VW == 8
    vf b[4], c[2];
    for (int k = 0; k < 4; k++)
        b[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], (vi){0, 1, 2, 3, 8, 9, 10, 11}) +
               __builtin_shuffle(a[2 * k], a[2 * k + 1], (vi){4, 5, 6, 7, 12, 13, 14, 15});
    for (int k = 0; k < 2; k++)
        c[k] = __builtin_shuffle(b[2 * k], b[2 * k + 1], (vi){0, 1, 8, 9, 4, 5, 12, 13}) +
               __builtin_shuffle(b[2 * k], b[2 * k + 1], (vi){2, 3, 10, 11, 6, 7, 14, 15});
    return __builtin_shuffle(c[0], c[1], (vi){0, 8, 2, 10, 4, 12, 6, 14}) +
           __builtin_shuffle(c[0], c[1], (vi){1, 9, 3, 11, 5, 13, 7, 15});
#else
    vf b[8], c[4], d[2];
    for (int k = 0; k < 8; k++)
        b[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], (vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(a[2 * k], a[2 * k + 1], (vi){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int k = 0; k < 4; k++)
        c[k] = __builtin_shuffle(b[2 * k], b[2 * k + 1], (vi){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
               __builtin_shuffle(b[2 * k], b[2 * k + 1], (vi){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    for (int k = 0; k < 2; k++)
        d[k] = __builtin_shuffle(c[2 * k], c[2 * k + 1], (vi){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
               __builtin_shuffle(c[2 * k], c[2 * k + 1], (vi){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    return __builtin_shuffle(d[0], d[1], (vi){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
           __builtin_shuffle(d[0], d[1], (vi){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
#endif
}

static int PERM[VW]; /* filled once by kvd_decode_init */
static vi INVPERM;   /* lane of token t in reduce_lanes's result */

/* One chunk's weights for one query head from its scaled scores s: softcap, the online
 * softmax (softmax_chunk), and the weights added to the head's running sums *lv. */
static inline __attribute__((always_inline)) vf chunk_weights(const struct decode_args *a, vf s, vi keep,
                                                              float *m, vf *lv, float *corr)
{
    if (a->softcap > 0.f)
        s = vsoftcap(s, a->softcap);
    s = softmax_chunk(s, keep, m, lv, corr);
    *lv += s;
    return s;
}

/* Prefetches into L2 (an L1 prefetch holds a fill buffer): a position's V row of this
 * chunk and, when next_row is not NULL, the next chunk's K row, bytes of each. */
static inline __attribute__((always_inline)) void prefetch_rows(const char *v_row, const char *next_row,
                                                               int64_t bytes)
{
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(v_row + off, 0, 2);
        if (next_row)
            __builtin_prefetch(next_row + off, 0, 2);
    }
}

/* The outputs of query heads [j0, j0 + np) into registers, scaled by their corr (the
 * softmax's max moved), and back: a pass accumulates its V rows in o in between. */
static inline __attribute__((always_inline)) void outputs_in(const vf *acc, int64_t j0, int np, int P, int64_t nd,
                                                            const float *corr, vf (*o)[MAX_ND])
{
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        if (p >= np)
            break;
#pragma GCC unroll 16
        for (int64_t c = 0; c < nd; c++)
            o[p][c] = acc[(j0 + p) * nd + c] * corr[p];
    }
}

static inline __attribute__((always_inline)) void outputs_out(vf *acc, int64_t j0, int np, int P, int64_t nd,
                                                             vf (*o)[MAX_ND])
{
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        if (p >= np)
            break;
#pragma GCC unroll 16
        for (int64_t c = 0; c < nd; c++)
            acc[(j0 + p) * nd + c] = o[p][c];
    }
}

static inline __attribute__((always_inline)) vf loadv(const void *base, int64_t i, int dt)
{
    if (dt == DT_F32) {
        vf x;
        memcpy(&x, (const float *)base + i, sizeof x);
        return x;
    }
    if (dt == DT_BF16) {
        vh16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        return (vf)(__builtin_convertvector(h, vu) << 16);
    }
#if VW == 8 && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const _Float16 *)base + i)));
#else
    vf16 h;
    memcpy(&h, (const _Float16 *)base + i, sizeof h);
    return __builtin_convertvector(h, vf);
#endif
}

static inline __attribute__((always_inline)) void storev(void *base, int64_t i, vf x, int dt)
{
    if (dt == DT_F32) {
        memcpy((float *)base + i, &x, sizeof x);
    } else if (dt == DT_BF16) {
        vu bits = (vu)x;
        bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
        vh16 h = __builtin_convertvector(bits >> 16, vh16);
        memcpy((uint16_t *)base + i, &h, sizeof h);
    } else {
#if VW == 8 && defined(__F16C__)
        _mm_storeu_si128((__m128i *)((_Float16 *)base + i), _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT));
#else
        vf16 h = __builtin_convertvector(x, vf16);
        memcpy((_Float16 *)base + i, &h, sizeof h);
#endif
    }
}

/* Rows of one chunk of VW positions from t0 (ntok of them real; the others repeat
 * position t0, so every row read is one of the sequence's): block and slot found by
 * counting, not dividing. */
static inline void chunk_rows(const struct decode_args *a, const int32_t *table, int64_t t0, int64_t ntok, int esize,
                              const char **kr, const char **vr)
{
    const int64_t bs = a->block_size;
    int64_t b = t0 / bs, slot = t0 % bs;
    for (int t = 0; t < VW; t++) {
        const int64_t block = table[b];
        kr[t] = (const char *)a->k_cache + (block * a->k_block + slot * a->k_slot) * esize;
        vr[t] = (const char *)a->v_cache + (block * a->v_block + slot * a->v_slot) * esize;
        if (t + 1 >= ntok) {
            b = t0 / bs; /* the padding rows repeat position t0 */
            slot = t0 % bs;
        } else if (++slot == bs) {
            slot = 0;
            b++;
        }
    }
}

/* Heads per pass: a pass keeps its query rows and its output rows in registers
 * (P * ND vectors each, 16 at most). */
#define HEADS_PER_PASS(ND) ((ND) == 0 ? 1 : (ND) <= 4 ? 4 : (ND) <= 8 ? 2 : 1)

/* One chunk of VW positions for query heads [j0, j0 + np) of KV head h: scores, the
 * online softmax update of m, l and acc, and the weighted V rows added to acc. */
static inline __attribute__((always_inline)) void attend_chunk(const struct decode_args *a, const char *const *kr,
                                                              const char *const *vr, const char *const *next_k,
                                                              int nnext, int64_t ntok, vi keep,
                                                              int64_t h, int64_t j0, int np, const vf *qv, vf *acc,
                                                              float *m, vf *lv, int dt, int ND)
{
    enum { MAXP = 4 };
    const int P = HEADS_PER_PASS(ND);
    const int64_t nd = ND ? ND : a->head_dim / VW;
    const int64_t esize = dt == DT_F32 ? 4 : 2, koff = h * a->k_head * esize, voff = h * a->v_head * esize;
    vf part[MAXP][VW];
    float w[MAXP][VW] __attribute__((aligned(64)));
    float corr[MAXP];
    for (int t = 0; t < VW; t++) {
        const char *k = kr[t] + koff;
        if (next_k) /* this chunk's V row and the next chunk's K row, a token at a time */
            prefetch_rows(vr[t] + voff, t < nnext ? next_k[t] + koff : NULL, a->head_dim * esize);
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            if (p >= np)
                break;
            const vf *q = qv + (j0 + p) * nd;
            vf x = q[0] * loadv(k, 0, dt);
#pragma GCC unroll 16
            for (int64_t c = 1; c < nd; c++)
                x += q[c] * loadv(k, c * VW, dt);
            part[p][t] = x;
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        if (p >= np)
            break;
        const int64_t j = j0 + p;
        const vf s = __builtin_shuffle(chunk_weights(a, reduce_lanes(part[p]), keep, &m[j], &lv[j], &corr[p]), INVPERM);
        memcpy(w[p], &s, sizeof s);
    }
    vf o[MAXP][MAX_ND];
    outputs_in(acc, j0, np, P, nd, corr, o);
    for (int64_t t = 0; t < ntok; t++) {
        const char *v = vr[t] + voff;
        vf vv[MAX_ND];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nd; c++)
            vv[c] = loadv(v, c * VW, dt);
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            if (p >= np)
                break;
            const vf weight = splat(w[p][t]);
#pragma GCC unroll 16
            for (int64_t c = 0; c < nd; c++)
                o[p][c] += weight * vv[c];
        }
    }
    outputs_out(acc, j0, np, P, nd, o);
}

#if VW == 8
/* The 8-lane path (AVX2: 16 registers) serves all g query heads of a KV head per chunk
 * of 8 positions, in passes sized at compile time (8, 4 or 1 heads; 4, 2 or 1 for V)
 * so every sum stays in a register: scores_pass loads each K vector once for its heads
 * (their query rows read from L1), values_pass each V vector once for its heads. */

/* Scores of query heads [0, NP) of q (rows of nd vectors) against the chunk's 8 K rows:
 * part[p][t] holds head p's 8 partial sums at position t. NP + 1 registers. When next_k
 * is not NULL, prefetches this chunk's V rows and the next chunk's K rows (row_bytes). */
static inline __attribute__((always_inline)) void scores_pass(const char *const *kr, const char *const *vr,
                                                             const char *const *next_k, int nnext, int64_t koff,
                                                             int64_t voff, int64_t row_bytes, const vf *q,
                                                             int64_t nd, int dt, int NP, vf (*part)[8])
{
    for (int t = 0; t < 8; t++) {
        const char *k = kr[t] + koff;
        if (next_k)
            prefetch_rows(vr[t] + voff, t < nnext ? next_k[t] + koff : NULL, row_bytes);
        vf x[8];
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++)
            x[p] = splat(0.f);
#pragma GCC unroll 32
        for (int64_t c = 0; c < nd; c++) {
            const vf kc = loadv(k, c * 8, dt);
#pragma GCC unroll 8
            for (int p = 0; p < NP; p++)
                x[p] += q[p * nd + c] * kc;
        }
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++)
            part[p][t] = x[p];
    }
}

/* Output rows of query heads [0, NP) of acc, scaled by their corr, plus the chunk's ntok
 * V rows weighted by w: two vectors of dims at a time, 2 * NP sums in registers. */
static inline __attribute__((always_inline)) void values_pass(const char *const *vr, int64_t voff, int64_t ntok,
                                                             const float (*w)[8], const float *corr, vf *acc,
                                                             int64_t nd, int dt, int NP)
{
    for (int64_t c = 0; c < nd; c += 2) {
        vf o[4][2];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) {
            o[p][0] = acc[p * nd + c] * corr[p];
            o[p][1] = acc[p * nd + c + 1] * corr[p];
        }
        for (int64_t t = 0; t < ntok; t++) {
            const char *v = vr[t] + voff;
            const vf v0 = loadv(v, c * 8, dt), v1 = loadv(v, c * 8 + 8, dt);
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++) {
                const vf weight = splat(w[p][t]);
                o[p][0] += weight * v0;
                o[p][1] += weight * v1;
            }
        }
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) {
            acc[p * nd + c] = o[p][0];
            acc[p * nd + c + 1] = o[p][1];
        }
    }
}

/* One chunk of 8 positions for the g query heads of KV head h: scores, the online
 * softmax update of m, lv and acc, and the weighted V rows added to acc. */
static inline __attribute__((always_inline)) void attend_head8(const struct decode_args *a, const char *const *kr,
                                                              const char *const *vr, const char *const *next_k,
                                                              int nnext, int64_t ntok, vi keep, int64_t h,
                                                              const vf *qv, vf *acc, float *m, vf *lv, int dt,
                                                              int ND)
{
    const int64_t nd = ND ? ND : a->head_dim / 8, g = a->group, j0 = h * g;
    const int64_t esize = dt == DT_F32 ? 4 : 2, koff = h * a->k_head * esize, voff = h * a->v_head * esize;
    const int64_t row_bytes = a->head_dim * esize;
    vf part[MAX_GROUP][8];
    float w[MAX_GROUP][8] __attribute__((aligned(32)));
    float corr[MAX_GROUP];
    for (int64_t p = 0; p < g;) { /* the first pass prefetches */
        const char *const *pf = p == 0 ? next_k : NULL;
        const vf *q = qv + (j0 + p) * nd;
        if (g - p >= 8) {
            scores_pass(kr, vr, pf, nnext, koff, voff, row_bytes, q, nd, dt, 8, part + p);
            p += 8;
        } else if (g - p >= 4) {
            scores_pass(kr, vr, pf, nnext, koff, voff, row_bytes, q, nd, dt, 4, part + p);
            p += 4;
        } else {
            scores_pass(kr, vr, pf, nnext, koff, voff, row_bytes, q, nd, dt, 1, part + p);
            p += 1;
        }
    }
    for (int64_t p = 0; p < g; p++) {
        const vf s = chunk_weights(a, reduce_lanes(part[p]), keep, &m[j0 + p], &lv[j0 + p], &corr[p]);
        const vf in_order = __builtin_shuffle(s, INVPERM);
        memcpy(w[p], &in_order, sizeof in_order);
    }
    for (int64_t p = 0; p < g;) {
        vf *out = acc + (j0 + p) * nd;
        if (g - p >= 4) {
            values_pass(vr, voff, ntok, w + p, corr + p, out, nd, dt, 4);
            p += 4;
        } else if (g - p >= 2) {
            values_pass(vr, voff, ntok, w + p, corr + p, out, nd, dt, 2);
            p += 2;
        } else {
            values_pass(vr, voff, ntok, w + p, corr + p, out, nd, dt, 1);
            p += 1;
        }
    }
}
#endif

#if DOT_BF16
/* bf16 by the dot instruction (vdpbf16ps, where the machine has it): q.k as sums of
 * exact products of bf16 pairs in fp32 (q unscaled; the scale applies to the score),
 * and the weights rounded to bf16 (their sum kept from the fp32 values: 2^-9 apart at
 * most, below the output's own rounding) times V rows taken two at a time, interleaved
 * (unpack), so lane 4L + j of accumulator 2c holds dim 32c + 8L + j and of 2c + 1
 * dim 32c + 8L + 4 + j (LANE_DIM); the final store puts the dims back in order.
 * head_dim a multiple of 32. */
static inline __m512bh load_bh(const char *p) { return (__m512bh)_mm512_loadu_si512(p); }

static inline __attribute__((always_inline)) void attend_chunk_dot(const struct decode_args *a, const char *const *kr,
                                                                  const char *const *vr, const char *const *next_k,
                                                                  int nnext, int64_t ntok, vi keep, int64_t h,
                                                                  int64_t j0, int np, const vf *qv, vf *acc,
                                                                  float *m, vf *lv, int N2)
{
    enum { MAXP = 4 };
    const int P = HEADS_PER_PASS(2 * N2);
    const int64_t n2 = N2 ? N2 : a->head_dim / 32, nd = 2 * n2;
    const int64_t koff = h * a->k_head * 2, voff = h * a->v_head * 2;
    vf part[MAXP][16];
    uint32_t w[MAXP][8] __attribute__((aligned(32)));
    float corr[MAXP];
    for (int t = 0; t < 16; t++) {
        const char *k = kr[t] + koff;
        if (next_k)
            prefetch_rows(vr[t] + voff, t < nnext ? next_k[t] + koff : NULL, n2 * 64);
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            if (p >= np)
                break;
            const __m512bh *q = (const __m512bh *)(qv + (j0 + p) * nd);
            __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], load_bh(k));
#pragma GCC unroll 8
            for (int64_t c = 1; c < n2; c++)
                x = _mm512_dpbf16_ps(x, q[c], load_bh(k + c * 64));
            part[p][t] = (vf)x;
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        if (p >= np)
            break;
        const int64_t j = j0 + p;
        const vf s = chunk_weights(a, reduce_lanes(part[p]) * a->scale, keep, &m[j], &lv[j], &corr[p]);
        const __m256bh rounded = _mm512_cvtneps_pbh((__m512)__builtin_shuffle(s, INVPERM));
        memcpy(w[p], &rounded, sizeof rounded);
    }
    vf o[MAXP][MAX_ND];
    outputs_in(acc, j0, np, P, nd, corr, o);
    for (int64_t tp = 0; 2 * tp < ntok; tp++) {
        const char *v0 = vr[2 * tp] + voff, *v1 = vr[2 * tp + 1] + voff;
        __m512bh lo[MAX_ND / 2], hi[MAX_ND / 2];
#pragma GCC unroll 8
        for (int64_t c = 0; c < n2; c++) {
            const __m512i r0 = _mm512_loadu_si512(v0 + c * 64), r1 = _mm512_loadu_si512(v1 + c * 64);
            lo[c] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
            hi[c] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        }
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            if (p >= np)
                break;
            const __m512bh weight = (__m512bh)_mm512_set1_epi32((int)w[p][tp]);
#pragma GCC unroll 8
            for (int64_t c = 0; c < n2; c++) {
                o[p][2 * c] = (vf)_mm512_dpbf16_ps((__m512)o[p][2 * c], weight, lo[c]);
                o[p][2 * c + 1] = (vf)_mm512_dpbf16_ps((__m512)o[p][2 * c + 1], weight, hi[c]);
            }
        }
    }
    outputs_out(acc, j0, np, P, nd, o);
}
/* 16 rows of 16 32-bit words -> 16 columns: r[c] lane t = word c of row t. 64 shuffles. */
static inline void transpose16(__m512i *r)
{
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + k], 128-bit lane L: word 4L + k of rows i..i+3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
        r[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[4 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* The chunk's 16 K rows of one KV head (koff), transposed: kt[16c + k] lane t holds
 * dims 32c + 2k and 32c + 2k + 1 of position t. Prefetches this chunk's V rows and
 * the next chunk's K rows (next_k, nnext of them) into L2 on the way. */
static inline __attribute__((always_inline)) void load_k_transposed(const struct decode_args *a,
                                                                   const char *const *kr, const char *const *vr,
                                                                   const char *const *next_k, int nnext,
                                                                   int64_t koff, int64_t voff, int64_t n2,
                                                                   __m512i *kt)
{
    (void)a;
    for (int t = 0; t < 16; t++) {
        if (next_k)
            prefetch_rows(vr[t] + voff, t < nnext ? next_k[t] + koff : NULL, n2 * 64);
        for (int64_t c = 0; c < n2; c++)
            kt[c * 16 + t] = _mm512_loadu_si512(kr[t] + koff + c * 64);
    }
    for (int64_t c = 0; c < n2; c++)
        transpose16(kt + c * 16);
}

/* The chunk's V rows of one KV head (voff) two at a time: vp[tp][2c] lane 4L + j holds
 * dim 32c + 8L + j of positions 2tp and 2tp + 1, vp[tp][2c + 1] dim 32c + 8L + 4 + j
 * (LANE_DIM order). All 8 pairs (padding rows repeat a real position). */
static inline __attribute__((always_inline)) void pair_v_rows(const char *const *vr, int64_t voff, int64_t n2,
                                                             __m512bh (*vp)[MAX_ND])
{
    for (int64_t tp = 0; tp < 8; tp++) {
        const char *v0 = vr[2 * tp] + voff, *v1 = vr[2 * tp + 1] + voff;
#pragma GCC unroll 8
        for (int64_t c = 0; c < n2; c++) {
            const __m512i r0 = _mm512_loadu_si512(v0 + c * 64), r1 = _mm512_loadu_si512(v1 + c * 64);
            vp[tp][2 * c] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
            vp[tp][2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        }
    }
}

#endif

#if AMX_BF16
/* bf16 on the tile unit (AMX), one chunk of 16 positions for the g <= 16 query heads of
 * KV head h: scores = Q (g x head_dim) times the transposed K (tiles of 32 dims), the
 * online softmax in vectors, then weights (g x 16, bf16) times the paired V rows, one
 * tile of 16 output lanes (LANE_DIM order) at a time, added to acc. The tiles are
 * configured per thread (amx_configure) before the first call. */
#define T_S 0 /* tile numbers: scores, q, K, weights, V, output (the tile macros take literals) */
#define T_Q 1
#define T_K 2
#define T_P 3
#define T_V 4
#define T_O 5
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory") /* tile loads read memory the compiler cannot see */

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void amx_configure(int g)
{
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int tiles[6][2] = {{T_S, 64}, {T_Q, 64}, {T_K, 64}, {T_P, 32}, {T_V, 64}, {T_O, 64}};
    for (int k = 0; k < 6; k++) {
        c.rows[tiles[k][0]] = (uint8_t)(tiles[k][0] == T_K ? 16 : tiles[k][0] == T_V ? 8 : g);
        c.colsb[tiles[k][0]] = (uint16_t)tiles[k][1];
    }
    _tile_loadconfig(&c);
}

/* Whether a call goes to the tiles: bf16, head_dim a multiple of 32, and 4 to 16 query heads
 * per KV head (fewer are served faster by the dot instruction; more do not fit a tile). */
static inline int tiles_for(const struct decode_args *a)
{
    return amx_ok && a->dtype == DT_BF16 && a->head_dim % 32 == 0 && a->group >= 4 && a->group <= 16;
}

static inline __attribute__((always_inline)) void attend_head_amx(const struct decode_args *a, const char *const *kr,
                                                                 const char *const *vr, const char *const *next_k,
                                                                 int nnext, vi keep, int64_t h, const vf *qv,
                                                                 vf *acc, float *m, vf *lv, int N2)
{
    const int64_t n2 = N2 ? N2 : a->head_dim / 32, nd = 2 * n2, g = a->group;
    const int64_t koff = h * a->k_head * 2, voff = h * a->v_head * 2;
    __m512i kt[16 * (MAX_ND / 2)];
    __m512bh vp[8][MAX_ND];
    float scores[16][16] __attribute__((aligned(64))), out[16][16] __attribute__((aligned(64)));
    uint16_t weights[16][16] __attribute__((aligned(64)));
    float corr[16];
    load_k_transposed(a, kr, vr, next_k, nnext, koff, voff, n2, kt);
    pair_v_rows(vr, voff, n2, vp);
    MEMORY_BARRIER();
    _tile_zero(T_S);
    for (int64_t c = 0; c < n2; c++) {
        _tile_loadd(T_Q, qv + h * g * nd + c, nd * 64);
        _tile_loadd(T_K, kt + 16 * c, 64);
        _tile_dpbf16ps(T_S, T_Q, T_K);
    }
    _tile_stored(T_S, scores, 64);
    for (int64_t r = 0; r < g; r++) {
        vf x;
        memcpy(&x, scores[r], sizeof x);
        x = chunk_weights(a, x * a->scale, keep, &m[h * g + r], &lv[h * g + r], &corr[r]);
        const __m256bh rounded = _mm512_cvtneps_pbh((__m512)x);
        memcpy(weights[r], &rounded, sizeof rounded);
    }
    MEMORY_BARRIER();
    _tile_loadd(T_P, weights, 32);
    for (int64_t c = 0; c < nd; c++) {
        _tile_zero(T_O);
        _tile_loadd(T_V, &vp[0][c], sizeof vp[0]);
        _tile_dpbf16ps(T_O, T_P, T_V);
        _tile_stored(T_O, out, 64);
        for (int64_t r = 0; r < g; r++) {
            vf y;
            memcpy(&y, out[r], sizeof y);
            acc[(h * g + r) * nd + c] = acc[(h * g + r) * nd + c] * corr[r] + y;
        }
    }
}
#endif

/* One sequence, every head. work: (2 * nd + 1) * heads vectors; ml: heads floats.
 * Returns -1 (nothing written) on a block id outside the cache. */
static inline __attribute__((always_inline)) int run_seq(const struct decode_args *a, int64_t i, vf *work,
                                                         float *ml, int dt, int ND, int dot)
{
    const int64_t nd = ND ? ND : a->head_dim / VW;
    const int64_t kvh = a->num_kv_heads, g = a->group, heads = kvh * g, bs = a->block_size;
    const int esize = dt == DT_F32 ? 4 : 2;
    const int64_t seq = a->seq_ids[i], len = a->seq_lens[seq];
    const int32_t *table = a->block_tables + seq * a->table_row;
    const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0;
    vf *qv = work, *acc = work + heads * nd;
    vf *lv = acc + heads * nd;
    float *m = ml;
    for (int64_t j = 0; j < heads; j++) {
        const int64_t q0 = a->rows[i] * a->query_row + j * a->query_head;
        for (int64_t c = 0; c < nd; c++) {
            if (!dot)
                qv[j * nd + c] = loadv(a->query, q0 + c * VW, dt) * a->scale;
            else if (2 * c < nd) /* bf16 as it is, 32 to a vector */
                memcpy(&qv[j * nd + c], (const uint16_t *)a->query + q0 + c * 32, sizeof(vf));
            acc[j * nd + c] = splat(0.f);
        }
        m[j] = -INFINITY;
        lv[j] = splat(0.f);
    }
    for (int64_t b = start / bs; len > 0 && b <= (len - 1) / bs; b++)
        if (table[b] < 0 || table[b] >= a->num_blocks)
            return -1;
    const char *kr[VW], *vr[VW], *next_k[VW], *next_v[VW];
    chunk_rows(a, table, start, len - start < VW ? len - start : VW, esize, kr, vr);
    for (int64_t t0 = start; t0 < len; t0 += VW) {
        const int64_t ntok = len - t0 < VW ? len - t0 : VW, nnext = len - t0 - VW < VW ? len - t0 - VW : VW;
        if (nnext > 0)
            chunk_rows(a, table, t0 + VW, nnext, esize, next_k, next_v);
        vi keep, keep_tok;
        for (int lane = 0; lane < VW; lane++) {
            keep[lane] = PERM[lane] < ntok ? -1 : 0;
            keep_tok[lane] = lane < ntok ? -1 : 0;
        }
        for (int64_t h = 0; h < kvh; h++) {
#if VW == 8
            attend_head8(a, kr, vr, next_k, (int)nnext, ntok, keep, h, qv, acc, m, lv, dt, ND);
            (void)keep_tok;
#else
            const int P = HEADS_PER_PASS(ND);
#if AMX_BF16
            if (dot && tiles_for(a)) {
                attend_head_amx(a, kr, vr, next_k, (int)nnext, keep_tok, h, qv, acc, m, lv, ND / 2);
                continue;
            }
#endif
            for (int64_t j0 = h * g; j0 < (h + 1) * g; j0 += P) { /* the first pass of a head prefetches */
                const int np = (int)((h + 1) * g - j0 < P ? (h + 1) * g - j0 : P);
#if DOT_BF16
                if (dot) {
                    attend_chunk_dot(a, kr, vr, j0 == h * g ? next_k : NULL, (int)nnext, ntok, keep, h, j0, np, qv,
                                     acc, m, lv, ND / 2);
                    continue;
                }
#endif
                attend_chunk(a, kr, vr, j0 == h * g ? next_k : NULL, (int)nnext, ntok, keep, h, j0, np, qv, acc, m,
                             lv, dt, ND);
            }
#endif
        }
        if (nnext > 0) {
            memcpy(kr, next_k, sizeof kr);
            memcpy(vr, next_v, sizeof vr);
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        const float sum = hsum(lv[j]), inv = sum > 0.f ? 1.f / sum : 0.f;
        vf *row = acc + j * nd;
#if DOT_BF16
        for (int64_t c = 0; dot && c < nd; c += 2) { /* the dot path's lanes back in dim order */
            const vf x = row[c], y = row[c + 1];
            row[c] = __builtin_shuffle(x, y, (vi){0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23});
            row[c + 1] = __builtin_shuffle(x, y, (vi){8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31});
        }
#endif
        for (int64_t c = 0; c < nd; c++)
            storev(a->out, a->rows[i] * a->out_row + j * a->out_head + c * VW, row[c] * inv, dt);
    }
    return 0;
}

typedef int (*seq_fn)(const struct decode_args *, int64_t, vf *, float *);

#define VARIANT(NAME, DT, ND, DOT)                                               \
    static int NAME(const struct decode_args *a, int64_t i, vf *w, float *ml) \
    {                                                                            \
        return run_seq(a, i, w, ml, DT, ND, DOT);                                \
    }
VARIANT(f32_any, DT_F32, 0, 0)
VARIANT(f32_d32, DT_F32, 32 / VW, 0)
VARIANT(f32_d64, DT_F32, 64 / VW, 0)
VARIANT(f32_d128, DT_F32, 128 / VW, 0)
VARIANT(bf16_any, DT_BF16, 0, 0)
VARIANT(bf16_dot_any, DT_BF16, 0, DOT_BF16)
VARIANT(bf16_d32, DT_BF16, 32 / VW, DOT_BF16)
VARIANT(bf16_d64, DT_BF16, 64 / VW, DOT_BF16)
VARIANT(bf16_d128, DT_BF16, 128 / VW, DOT_BF16)
VARIANT(f16_any, DT_F16, 0, 0)
VARIANT(f16_d32, DT_F16, 32 / VW, 0)
VARIANT(f16_d64, DT_F16, 64 / VW, 0)
VARIANT(f16_d128, DT_F16, 128 / VW, 0)

static seq_fn pick(int dt, int64_t head_dim)
{
    static const seq_fn table[3][4] = {{f32_any, f32_d32, f32_d64, f32_d128},
                                       {bf16_any, bf16_d32, bf16_d64, bf16_d128},
                                       {f16_any, f16_d32, f16_d64, f16_d128}};
    int which = head_dim == 32 ? 1 : head_dim == 64 ? 2 : head_dim == 128 ? 3 : 0;
    if (dt == DT_BF16 && which == 0 && head_dim % 32 == 0)
        return bf16_dot_any;
    return table[dt][which];
}

struct share {
    const struct decode_args *a;
    int64_t first, end;
    int status;
};

static void *run_share(void *arg)
{
    struct share *sh = arg;
    const struct decode_args *a = sh->a;
    const int64_t heads = a->num_kv_heads * a->group, nd = a->head_dim / VW;
    vf *work = aligned_alloc(64, sizeof(vf) * (size_t)((2 * nd + 1) * heads));
    float *ml = malloc(sizeof(float) * (size_t)heads);
    seq_fn fn = pick(a->dtype, a->head_dim);
    sh->status = work && ml ? 0 : -2;
#if AMX_BF16
    struct tile_config before;
    const int tiles = tiles_for(a) && sh->first < sh->end;
    if (tiles) {
        _tile_storeconfig(&before); /* all zero where the thread had none */
        amx_configure((int)a->group);
    }
#endif
    for (int64_t i = sh->first; i < sh->end && sh->status == 0; i++)
        sh->status = fn(a, i, work, ml);
#if AMX_BF16
    if (tiles) { /* the thread's tiles as they were (torch's kernels keep their configuration across calls) */
        if (before.palette)
            _tile_loadconfig(&before);
        else
            _tile_release();
    }
#endif
    free(work);
    free(ml);
    return NULL;
}

/* The process's OpenMP runtime (the one torch runs on), when the caller found it:
 * GOMP_parallel and omp_get_thread_num. Shares then run on torch's own threads,
 * which are already running (no thread start, no second pool competing for the
 * cores); otherwise each call starts its threads. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel;

struct team_job {
    struct share *shares;
    int num_shares;
    int next; /* the next share to claim (atomic) */
};

/* Every thread of the team claims shares until none is left, so a team smaller
 * than asked (nested, or a runtime that gave fewer threads) still runs them all. */
static void run_team(void *arg)
{
    struct team_job *job = arg;
    for (;;) {
        int k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (k >= job->num_shares)
            return;
        run_share(&job->shares[k]);
    }
}

void kvd_decode_init(void)
{
#if AMX_BF16
    amx_ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#endif
    vf a[VW];
    for (int t = 0; t < VW; t++) {
        a[t] = splat(0.f);
        a[t][0] = (float)t;
    }
    vf r = reduce_lanes(a);
    for (int lane = 0; lane < VW; lane++) {
        PERM[lane] = (int)r[lane];
        INVPERM[PERM[lane]] = lane;
    }
}


/* How bf16 is computed, as bits: 1 the dot instruction is built in (head_dim a multiple of
 * 32), 2 the tile path is built in, 4 the kernel let this process use the tiles. */
int kvd_decode_bf16_paths(void) { return DOT_BF16 | AMX_BF16 << 1 | amx_ok << 2; }

/* Lanes per vector this build computes with: 16 (AVX-512) or 8. */
int kvd_decode_lanes(void) { return VW; }

void kvd_decode_use_openmp(void *parallel)
{
    gomp_parallel = (gomp_parallel_fn)parallel;
}

/* 0 done; -1 a block id outside the cache; -2 out of memory (or a thread could not start). */
int kvd_decode(const struct decode_args *a)
{
    if (a->head_dim % 16 || a->head_dim / VW > MAX_ND || a->group > MAX_GROUP || a->dtype < 0 || a->dtype > 2)
        return -2;
    int64_t total = 0;
    for (int64_t i = 0; i < a->num_seqs; i++)
        total += a->seq_lens[a->seq_ids[i]];
    int num_threads = a->num_threads < 1 ? 1 : a->num_threads > MAX_THREADS ? MAX_THREADS : a->num_threads;
    if (num_threads > a->num_seqs)
        num_threads = (int)(a->num_seqs > 0 ? a->num_seqs : 1);
    struct share shares[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t i = 0, done = 0;
    for (int k = 0; k < num_threads; k++) { /* contiguous shares of about equal length */
        int64_t goal = total * (k + 1) / num_threads;
        shares[k] = (struct share){a, i, i, 0};
        while (i < a->num_seqs && (done < goal || k == num_threads - 1))
            done += a->seq_lens[a->seq_ids[i++]];
        shares[k].end = i;
    }
    if (gomp_parallel && num_threads > 1) {
        struct team_job job = {shares, num_threads, 0};
        gomp_parallel(run_team, &job, (unsigned)num_threads, 0);
    } else {
        for (int k = 1; k < num_threads; k++)
            started[k] = pthread_create(&threads[k], NULL, run_share, &shares[k]) == 0;
        run_share(&shares[0]);
        for (int k = 1; k < num_threads; k++)
            if (started[k])
                pthread_join(threads[k], NULL);
            else
                run_share(&shares[k]);
    }
    int status = 0;
    for (int k = 0; k < num_threads; k++)
        if (shares[k].status && !status)
            status = shares[k].status;
    return status;
}
