/* Built by test_cpu_decode with cpu_decode.c included ahead (-include): sets a tile
 * configuration of its own, decodes one bf16 sequence on the tiles, and prints whether
 * the thread's configuration is the one it set; then the same from a released state. */
#include <stdio.h>

static int same_config(const struct tile_config *want)
{
    struct tile_config now;
    _tile_storeconfig(&now);
    return memcmp(want, &now, sizeof now) == 0;
}

int main(void)
{
    enum { BS = 16, NB = 4, KVH = 1, G = 8, HD = 64 };
    static uint16_t k[NB * BS * KVH * HD], v[NB * BS * KVH * HD], q[G * HD], out[G * HD];
    int32_t table[NB] = {0, 1, 2, 3}, lens[1] = {50};
    int64_t ids[1] = {0}, rows[1] = {0};
    for (int i = 0; i < NB * BS * KVH * HD; i++)
        k[i] = v[i] = 0x3f80; /* 1.0 */
    for (int i = 0; i < G * HD; i++)
        q[i] = 0x3c00;
    struct decode_args a = {q, G * HD, HD, k, v, BS * KVH * HD, KVH * HD, HD, BS * KVH * HD, KVH * HD, HD,
                            table, NB, NB, lens, ids, rows, 1, out, G * HD, HD, BS, KVH, G, HD, 0,
                            0.125f, 0.f, DT_BF16, 1};
    kvd_decode_init();
    struct tile_config mine, none;
    memset(&mine, 0, sizeof mine);
    memset(&none, 0, sizeof none);
    mine.palette = 1;
    mine.rows[0] = 7;
    mine.colsb[0] = 48;
    _tile_loadconfig(&mine);
    int status = kvd_decode(&a);
    printf("paths %d status %d out %04x kept %d\n", kvd_decode_bf16_paths(), status, out[0], same_config(&mine));
    _tile_release();
    status = kvd_decode(&a);
    printf("released status %d kept %d\n", status, same_config(&none));
    return 0;
}
