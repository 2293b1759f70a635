/* Paged decode attention on the CPU: one new token per sequence, K/V read where they lie.
 *
 * Built and loaded by kvdaemon.client.cpu_decode (the system C compiler, first use,
 * -O3 -march=native); the Python side checks every shape, dtype and stride first.
 *
 * For each sequence (sequences are shared out over threads by their lengths; the
 * threads are torch's own OpenMP team where the caller passed its GOMP_parallel,
 * else started per call): positions are taken 16 at a time, and for each KV head
 * its query heads are served a few per pass (HEADS_PER_PASS: their query rows and
 * output rows stay in registers). Scores of the 16 positions are reduced together
 * (reduce16, no per-score horizontal sum), the online softmax keeps a running max
 * and sum per query head (fp32), and each V row is read once per pass and added to
 * every head of the pass. K and V are read in place, block by block; while a chunk
 * is computed, its V rows and the next chunk's K rows are prefetched into L2 a row
 * at a time (a burst of prefetches, or prefetches into L1, stall on the line-fill
 * buffers).
 *
 * Semantics match the torch path: scores = q.k * scale, then softcap * tanh(s / softcap)
 * when softcap > 0; only positions p with len - window <= p < len when window > 0;
 * softmax in fp32, output cast to the dtype (bf16 rounds to nearest even).
 *
 * Types: fp32, bf16, fp16 (GCC vector extensions; vectors of 16 floats, which GCC
 * lowers to whatever the machine has). head_dim a multiple of 16, at most 256;
 * query heads per KV head at most MAX_GROUP.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h16 __attribute__((vector_size(32)));
typedef _Float16 v16f16 __attribute__((vector_size(32)));

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
#define MAX_ND 16    /* head_dim <= 256 */
#define MAX_GROUP 32 /* query heads per KV head */
#define MAX_THREADS 64

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

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16 vmax(v16 a, v16 b)
{
    v16i m = a > b;
    return (v16)((m & (v16i)a) | (~m & (v16i)b));
}

static const v16i SWAP8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
static const v16i SWAP4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
static const v16i SWAP2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
static const v16i SWAP1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};

static inline float hsum(v16 v)
{
    v += __builtin_shuffle(v, SWAP8);
    v += __builtin_shuffle(v, SWAP4);
    v += __builtin_shuffle(v, SWAP2);
    v += __builtin_shuffle(v, SWAP1);
    return v[0];
}

static inline float hmax(v16 v)
{
    v = vmax(v, __builtin_shuffle(v, SWAP8));
    v = vmax(v, __builtin_shuffle(v, SWAP4));
    v = vmax(v, __builtin_shuffle(v, SWAP2));
    v = vmax(v, __builtin_shuffle(v, SWAP1));
    return v[0];
}

/* e^x for x <= 0 (clamped at -87): 2^n * e^f with |f| <= ln2/2, Taylor to degree 7
 * (relative error about 5e-9, below fp32's rounding). */
static inline v16 vexp(v16 x)
{
    x = vmax(x, splat(-87.f));
    v16 t = x * 1.4426950408889634f;
    v16 n = (t + 12582912.f) - 12582912.f; /* round to nearest */
    v16 f = (t - n) * 0.6931471805599453f;
    v16 p = splat(1.f / 5040.f);
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)e;
}

/* cap * tanh(x / cap), from e^(-2|x|/cap): never overflows. */
static inline v16 vsoftcap(v16 x, float cap)
{
    v16i sign = (v16i)x & (v16i)splat(-0.f);
    v16 ax = (v16)((v16i)x & ~(v16i)splat(-0.f));
    v16 e = vexp(ax * (-2.f / cap));
    v16 th = (1.f - e) / (1.f + e);
    return (v16)((v16i)th | sign) * cap;
}

/* 16 vectors -> one vector of their 16 sums; lane i holds the sum of a[PERM[i]]. */
static inline v16 reduce16(const v16 *a)
{
    v16 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++)
        b[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], (v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(a[2 * k], a[2 * k + 1], (v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int k = 0; k < 4; k++)
        c[k] = __builtin_shuffle(b[2 * k], b[2 * k + 1], (v16i){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
               __builtin_shuffle(b[2 * k], b[2 * k + 1], (v16i){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    for (int k = 0; k < 2; k++)
        d[k] = __builtin_shuffle(c[2 * k], c[2 * k + 1], (v16i){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
               __builtin_shuffle(c[2 * k], c[2 * k + 1], (v16i){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    return __builtin_shuffle(d[0], d[1], (v16i){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
           __builtin_shuffle(d[0], d[1], (v16i){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

static int PERM[16];    /* filled once by kvd_decode_init */
static v16i INVPERM;    /* lane of token t in reduce16's result */

static inline __attribute__((always_inline)) v16 load16(const void *base, int64_t i, int dt)
{
    if (dt == DT_F32) {
        v16 x;
        memcpy(&x, (const float *)base + i, sizeof x);
        return x;
    }
    if (dt == DT_BF16) {
        v16h16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        return (v16)(__builtin_convertvector(h, v16u) << 16);
    }
    v16f16 h;
    memcpy(&h, (const _Float16 *)base + i, sizeof h);
    return __builtin_convertvector(h, v16);
}

static inline __attribute__((always_inline)) void store16(void *base, int64_t i, v16 x, int dt)
{
    if (dt == DT_F32) {
        memcpy((float *)base + i, &x, sizeof x);
    } else if (dt == DT_BF16) {
        v16u bits = (v16u)x;
        bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
        v16h16 h = __builtin_convertvector(bits >> 16, v16h16);
        memcpy((uint16_t *)base + i, &h, sizeof h);
    } else {
        v16f16 h = __builtin_convertvector(x, v16f16);
        memcpy((_Float16 *)base + i, &h, sizeof h);
    }
}

/* Rows of one chunk of 16 positions from t0 (ntok of them real; the others repeat
 * position t0, so every row read is one of the sequence's): block and slot found by
 * counting, not dividing. */
static inline void chunk_rows(const struct decode_args *a, const int32_t *table, int64_t t0, int64_t ntok, int esize,
                              const char **kr, const char **vr)
{
    const int64_t bs = a->block_size;
    int64_t b = t0 / bs, slot = t0 % bs;
    for (int t = 0; t < 16; t++) {
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

/* One chunk of 16 positions for query heads [j0, j0 + np) of KV head h: scores, the
 * online softmax update of m, l and acc, and the weighted V rows added to acc. */
static inline __attribute__((always_inline)) void attend_chunk(const struct decode_args *a, const char *const *kr,
                                                              const char *const *vr, const char *const *next_k,
                                                              int nnext, int64_t ntok, v16i keep,
                                                              int64_t h, int64_t j0, int np, const v16 *qv, v16 *acc,
                                                              float *m, float *l, int dt, int ND)
{
    enum { MAXP = 4 };
    const int P = HEADS_PER_PASS(ND);
    const int64_t nd = ND ? ND : a->head_dim / 16;
    const int64_t esize = dt == DT_F32 ? 4 : 2, koff = h * a->k_head * esize, voff = h * a->v_head * esize;
    v16 part[MAXP][16];
    float w[MAXP][16] __attribute__((aligned(64)));
    float corr[MAXP];
    for (int t = 0; t < 16; t++) {
        const char *k = kr[t] + koff;
        if (next_k) { /* this chunk's V row and the next chunk's K row, a token at a time */
            for (int64_t off = 0; off < a->head_dim * esize; off += 64) {
                __builtin_prefetch(vr[t] + voff + off, 0, 2); /* to L2: an L1 prefetch holds a fill buffer */
                if (t < nnext)
                    __builtin_prefetch(next_k[t] + koff + off, 0, 2);
            }
        }
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            if (p >= np)
                break;
            const v16 *q = qv + (j0 + p) * nd;
            v16 x = q[0] * load16(k, 0, dt);
#pragma GCC unroll 16
            for (int64_t c = 1; c < nd; c++)
                x += q[c] * load16(k, c * 16, dt);
            part[p][t] = x;
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        if (p >= np)
            break;
        const int64_t j = j0 + p;
        v16 s = reduce16(part[p]);
        if (a->softcap > 0.f)
            s = vsoftcap(s, a->softcap);
        const float top_chunk = hmax((v16)(((v16i)s & keep) | (~keep & (v16i)splat(-INFINITY))));
        const float top = top_chunk > m[j] ? top_chunk : m[j];
        corr[p] = vexp(splat(m[j] - top))[0]; /* m = -inf: e^-87, times acc = 0 */
        m[j] = top;
        s = (v16)((v16i)vexp(s - top) & keep);
        l[j] = l[j] * corr[p] + hsum(s);
        s = __builtin_shuffle(s, INVPERM);
        memcpy(w[p], &s, sizeof s);
    }
    v16 o[MAXP][MAX_ND];
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        if (p >= np)
            break;
#pragma GCC unroll 16
        for (int64_t c = 0; c < nd; c++)
            o[p][c] = acc[(j0 + p) * nd + c] * corr[p];
    }
    for (int64_t t = 0; t < ntok; t++) {
        const char *v = vr[t] + voff;
        v16 vv[MAX_ND];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nd; c++)
            vv[c] = load16(v, c * 16, dt);
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            if (p >= np)
                break;
            const v16 weight = splat(w[p][t]);
#pragma GCC unroll 16
            for (int64_t c = 0; c < nd; c++)
                o[p][c] += weight * vv[c];
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        if (p >= np)
            break;
#pragma GCC unroll 16
        for (int64_t c = 0; c < nd; c++)
            acc[(j0 + p) * nd + c] = o[p][c];
    }
}

/* One sequence, every head. work: 2 * heads * nd vectors; ml: 2 * heads floats.
 * Returns -1 (nothing written) on a block id outside the cache. */
static inline __attribute__((always_inline)) int run_seq(const struct decode_args *a, int64_t i, v16 *work,
                                                         float *ml, int dt, int ND)
{
    const int64_t nd = ND ? ND : a->head_dim / 16;
    const int64_t kvh = a->num_kv_heads, g = a->group, heads = kvh * g, bs = a->block_size;
    const int esize = dt == DT_F32 ? 4 : 2;
    const int P = HEADS_PER_PASS(ND);
    const int64_t seq = a->seq_ids[i], len = a->seq_lens[seq];
    const int32_t *table = a->block_tables + seq * a->table_row;
    const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0;
    v16 *qv = work, *acc = work + heads * nd;
    float *m = ml, *l = ml + heads;
    for (int64_t j = 0; j < heads; j++) {
        for (int64_t c = 0; c < nd; c++) {
            qv[j * nd + c] = load16(a->query, a->rows[i] * a->query_row + j * a->query_head + c * 16, dt) * a->scale;
            acc[j * nd + c] = splat(0.f);
        }
        m[j] = -INFINITY;
        l[j] = 0.f;
    }
    for (int64_t b = start / bs; len > 0 && b <= (len - 1) / bs; b++)
        if (table[b] < 0 || table[b] >= a->num_blocks)
            return -1;
    const char *kr[16], *vr[16], *next_k[16], *next_v[16];
    chunk_rows(a, table, start, len - start < 16 ? len - start : 16, esize, kr, vr);
    for (int64_t t0 = start; t0 < len; t0 += 16) {
        const int64_t ntok = len - t0 < 16 ? len - t0 : 16, nnext = len - t0 - 16 < 16 ? len - t0 - 16 : 16;
        if (nnext > 0)
            chunk_rows(a, table, t0 + 16, nnext, esize, next_k, next_v);
        v16i keep;
        for (int lane = 0; lane < 16; lane++)
            keep[lane] = PERM[lane] < ntok ? -1 : 0;
        for (int64_t h = 0; h < kvh; h++)
            for (int64_t j0 = h * g; j0 < (h + 1) * g; j0 += P) /* the first pass of a head prefetches */
                attend_chunk(a, kr, vr, j0 == h * g ? next_k : NULL, (int)nnext, ntok, keep, h, j0,
                             (int)((h + 1) * g - j0 < P ? (h + 1) * g - j0 : P), qv, acc, m, l, dt, ND);
        if (nnext > 0) {
            memcpy(kr, next_k, sizeof kr);
            memcpy(vr, next_v, sizeof vr);
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t c = 0; c < nd; c++)
            store16(a->out, a->rows[i] * a->out_row + j * a->out_head + c * 16, acc[j * nd + c] * inv, dt);
    }
    return 0;
}

typedef int (*seq_fn)(const struct decode_args *, int64_t, v16 *, float *);

#define VARIANT(NAME, DT, ND) \
    static int NAME(const struct decode_args *a, int64_t i, v16 *w, float *ml) { return run_seq(a, i, w, ml, DT, ND); }
VARIANT(f32_any, DT_F32, 0)
VARIANT(f32_d32, DT_F32, 2)
VARIANT(f32_d64, DT_F32, 4)
VARIANT(f32_d128, DT_F32, 8)
VARIANT(bf16_any, DT_BF16, 0)
VARIANT(bf16_d32, DT_BF16, 2)
VARIANT(bf16_d64, DT_BF16, 4)
VARIANT(bf16_d128, DT_BF16, 8)
VARIANT(f16_any, DT_F16, 0)
VARIANT(f16_d32, DT_F16, 2)
VARIANT(f16_d64, DT_F16, 4)
VARIANT(f16_d128, DT_F16, 8)

static seq_fn pick(int dt, int64_t head_dim)
{
    static const seq_fn table[3][4] = {{f32_any, f32_d32, f32_d64, f32_d128},
                                       {bf16_any, bf16_d32, bf16_d64, bf16_d128},
                                       {f16_any, f16_d32, f16_d64, f16_d128}};
    int which = head_dim == 32 ? 1 : head_dim == 64 ? 2 : head_dim == 128 ? 3 : 0;
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
    const int64_t heads = a->num_kv_heads * a->group, nd = a->head_dim / 16;
    v16 *work = aligned_alloc(64, sizeof(v16) * (size_t)(2 * heads * nd));
    float *ml = malloc(sizeof(float) * (size_t)(2 * heads));
    seq_fn fn = pick(a->dtype, a->head_dim);
    sh->status = work && ml ? 0 : -2;
    for (int64_t i = sh->first; i < sh->end && sh->status == 0; i++)
        sh->status = fn(a, i, work, ml);
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
    v16 a[16];
    for (int t = 0; t < 16; t++) {
        a[t] = splat(0.f);
        a[t][0] = (float)t;
    }
    v16 r = reduce16(a);
    for (int lane = 0; lane < 16; lane++) {
        PERM[lane] = (int)r[lane];
        INVPERM[PERM[lane]] = lane;
    }
}


void kvd_decode_use_openmp(void *parallel)
{
    gomp_parallel = (gomp_parallel_fn)parallel;
}

/* 0 done; -1 a block id outside the cache; -2 out of memory (or a thread could not start). */
int kvd_decode(const struct decode_args *a)
{
    if (a->head_dim % 16 || a->head_dim / 16 > MAX_ND || a->group > MAX_GROUP || a->dtype < 0 || a->dtype > 2)
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
