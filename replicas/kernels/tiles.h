/* AMX's tile configuration, shared by the builds' tile paths (linear.c's bf16 linear,
   paged_attention.c's scores): palette 1, each of the eight tiles its own rows and bytes a row.
   A thread loads its configuration before its tile instructions and releases the tiles after
   (while in use their 8 KiB of state is saved at every context switch). */
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif
#if HAVE_TILES
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tile t: rows[t] rows of colsb[t] bytes; a tile of 0 rows is left unconfigured */
static inline void tiles_load(const int rows[8], const int colsb[8]) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++)
        if (rows[t]) c.rows[t] = (uint8_t)rows[t], c.colsb[t] = (uint16_t)colsb[t];
    /* not GCC 12's _tile_loadconfig: its asm tells the compiler it reads 8 bytes of the
       configuration, so the compiler dropped the stores of the rows and widths as dead (the
       tiles then left unconfigured: SIGILL at the first tile load). This operand is all 64. */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}
#endif
