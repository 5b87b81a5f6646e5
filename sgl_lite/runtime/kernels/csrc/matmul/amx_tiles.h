// AMX tile basics for sgl_lite's tile kernels (amx_extend_attention.cpp, amx_w8a8_gemm.cpp): the process's permission to use
// the tile state, one tile configuration, and a 16 x 16 transpose of 32-bit words (VNNI operands).
// Included only where the compiler targets AMX (__AMX_TILE__) on Linux.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace sgl_lite {

// Linux grants the AMX tile state (XTILEDATA) per process, on request; false where it refuses.
inline bool tiles_granted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Every tile is 16 rows x 64 bytes: in bf16, A 16 x 32, B 16 pairs x 16 x 2, C 16 x 16 float32; in int8,
// A 16 x 64 bytes, B 16 quads x 16 x 4 bytes, C 16 x 16 int32.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// dst[c * ldd + r] = src[r * lds + c] for a 16 x 16 block of 32-bit words: 32- then 64-bit interleaves
// within 128-bit lanes, then two rounds of 128-bit lane shuffles.
inline void transpose16x16(const uint32_t* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c]: in lane l, column 4l + c of rows 4g..4g+3
    const __m512i* s = t + 4 * g;
    r[4 * g + 0] = _mm512_unpacklo_epi64(s[0], s[2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(s[0], s[2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(s[1], s[3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(s[1], s[3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), w1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(dst + (c + 0) * ldd, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(dst + (c + 4) * ldd, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(dst + (c + 8) * ldd, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(dst + (c + 12) * ldd, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

}  // namespace sgl_lite
