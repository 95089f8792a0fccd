/* qmatmul_avx512.c — matmuls of several tokens (batched decode; prefill on the
 * "avx512vnnimm" level's exact twin) on the four int8 GGUF formats with AVX-512 VNNI, for
 * processors without AMX (AMD Zen 4/5, Intel before Sapphire Rapids): the AVX2 kernel's
 * plan (qmatmul_avx2.c) with 16 tokens per vector and vpdpbusd.
 *
 * Per block of RB weight rows and 16 tokens: per 4 elements and row, the row's 4 unsigned
 * codes are broadcast (vpbroadcastd) and vpdpbusd adds their products with 4 int8
 * activations of each token straight into 32-bit sums, one per token lane: no 16-bit
 * stage, so no depth limit and no sign trick (Q8_0's signed codes enter plus 128, with
 * offset 128 * scale, like Q5_0's 16). Per scale group and row, as in the AVX2 kernel:
 *
 *   acc[t] += S[t] * ws * xd[t] - go * xd[t] * sum(xq[t])
 *
 * The same quantities as the other int8 kernels summed in another order: results agree
 * to float rounding. A token's result depends on its own lane only, so a row is
 * bit-identical however the tokens were batched: the level's exact twin takes this
 * kernel for every size.
 *
 * Compiled with -mavx512f -mavx512bw -mavx512vnni (and AVX2, F16C for the unpacking);
 * called only when the processor has them. */
#include <immintrin.h>

#include "qmatmul_lanes.h"
#include "qunpack_avx512.h"

enum { TG = 16 }; /* tokens per vector */

/* Q6_K's 16-element scale groups (SB 16) taken two at a time, for H token groups (1 or 2;
 * the second's activations, scales and sums one group's size after the first's): the pair
 * shares its activation scale (one 32-block), so per row and token group its two integer
 * sums, one chain each, are scaled by their weight scales, added, and multiplied by the
 * activation scale once: acc += (S0 ws0 + S1 ws1) xd, 5 float operations per row and pair
 * where one group at a time took 8 (a chain merge, conversion, scale product and
 * multiply-add per group). RB = 4 rows: 8 or 16 integer sums in flight. Offsets as OFF
 * in block_more (32 x the tokens' code sums, per 16-element group). */
static inline __attribute__((always_inline)) void block_pairs16(const uint8_t *A, int64_t K, const float *ws,
                                                               int64_t ng, const int8_t *B0, const float *XD0,
                                                               const int32_t *XS0, const int RB, const int H,
                                                               const int OFF, const char *pf, int64_t pf_lines,
                                                               __m512 *acc) {
  const int64_t pf_per = kvl__lanes_pf_per(pf_lines, ng / 2);
  for (int64_t g = 0; g < ng; g += 2) {
    kvl__lanes_prefetch(pf, pf_lines, g / 2, pf_per);
    __m512i s[16]; /* s[(r * H + h) * 2 + c]: row r, token group h, group g + c */
#pragma GCC unroll 2
    for (int h = 0; h < H; h++)
#pragma GCC unroll 2
      for (int c = 0; c < 2; c++) {
        const int32_t *xs = XS0 + h * (K / 16) * TG + (g + c) * TG;
        const __m512i s0 = _mm512_mullo_epi32(_mm512_load_si512((const void *)xs), _mm512_set1_epi32(-OFF));
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) s[(r * H + h) * 2 + c] = s0;
      }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      __m512i x[2][2];
#pragma GCC unroll 2
      for (int h = 0; h < H; h++)
#pragma GCC unroll 2
        for (int c = 0; c < 2; c++) x[h][c] = _mm512_load_si512((const void *)(B0 + h * K * TG + ((g + c) * 4 + i) * 64));
#pragma GCC unroll 4
      for (int r = 0; r < RB; r++)
#pragma GCC unroll 2
        for (int c = 0; c < 2; c++) {
          int32_t wv;
          memcpy(&wv, A + r * K + (g + c) * 16 + 4 * i, 4);
          const __m512i wb = _mm512_set1_epi32(wv);
#pragma GCC unroll 2
          for (int h = 0; h < H; h++) s[(r * H + h) * 2 + c] = _mm512_dpbusd_epi32(s[(r * H + h) * 2 + c], wb, x[h][c]);
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < H; h++) {
      const __m512 xd = _mm512_load_ps(XD0 + h * (K / 16) * TG + g * TG);
#pragma GCC unroll 4
      for (int r = 0; r < RB; r++) {
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s[(r * H + h) * 2]), _mm512_set1_ps(ws[r * ng + g]));
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[(r * H + h) * 2 + 1]), _mm512_set1_ps(ws[r * ng + g + 1]), t);
        acc[h * RB + r] = _mm512_fmadd_ps(t, xd, acc[h * RB + r]);
      }
    }
  }
}

/* The rows of a block against one group of 16 tokens: acc[r] lane t (+)= row r . token t
 * (block: from zero; block_more: added to what acc holds). A: the rows' codes, K bytes
 * apart; ng groups. SB: elements per scale group (16: Q6_K, taken by block_pairs16). Each row's integer sum runs as two chains (even and odd
 * steps of 4 elements, added at the group's end): vpdpbusd's latency is several cycles,
 * and with one chain per row it waited (8 chains to 16 took the 32-element formats from
 * about 400 to 460 GOP/s on a Zen 4: bench/kernel-ab/qmatmul-ab; the sums are integers,
 * so the results are bit-identical).
 * OFF: where a format's group offset is OFF x its scale (Q8_0 +128, Q5_0 16, Q6_K 32), the
 * group's integer sum starts at -OFF x the tokens' code sums (XS), which takes the offset
 * off exactly and saves a multiply-add per row and group. OFF 0 (Q4_K, whose offset is its
 * own dmin x m): the offset go x CB is subtracted in floating point. */
static inline __attribute__((always_inline)) void block_more(const uint8_t *A, int64_t K, const float *ws, const float *go,
                                                            int64_t ng, const int8_t *Bj, const float *XDj,
                                                            const float *CBj, const int32_t *XSj, const int SB,
                                                            const int RB, const int OFF, const char *pf,
                                                            int64_t pf_lines, __m512 *acc) {
  if (SB == 16) {
    block_pairs16(A, K, ws, ng, Bj, XDj, XSj, RB, 1, OFF, pf, pf_lines, acc);
    return;
  }
  const int64_t pf_per = kvl__lanes_pf_per(pf_lines, ng);
  for (int64_t g = 0; g < ng; g++) {
    kvl__lanes_prefetch(pf, pf_lines, g, pf_per);
    const int64_t gi = g * SB / 16; /* the group's slot of XD, CB and XS (16-element slots) */
    const __m512i s0 = OFF ? _mm512_mullo_epi32(_mm512_load_si512((const void *)(XSj + gi * TG)), _mm512_set1_epi32(-OFF))
                           : _mm512_setzero_si512();
    __m512i s32[8], s32b[8]; /* RB <= 8, fixed sizes (not VLAs) that stay in registers */
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) s32[r] = s0, s32b[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int i = 0; i < SB / 4; i += 2) {
      const __m512i xb = _mm512_load_si512((const void *)(Bj + (g * SB / 4 + i) * 64));
      const __m512i xb1 = _mm512_load_si512((const void *)(Bj + (g * SB / 4 + i + 1) * 64));
#pragma GCC unroll 8
      for (int r = 0; r < RB; r++) {
        int32_t wv, wv1;
        memcpy(&wv, A + r * K + g * SB + 4 * i, 4);
        memcpy(&wv1, A + r * K + g * SB + 4 * i + 4, 4);
        s32[r] = _mm512_dpbusd_epi32(s32[r], _mm512_set1_epi32(wv), xb);
        s32b[r] = _mm512_dpbusd_epi32(s32b[r], _mm512_set1_epi32(wv1), xb1);
      }
    }
    const __m512 xd = _mm512_load_ps(XDj + gi * TG), cb = _mm512_load_ps(CBj + gi * TG);
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
      const __m512 sf = _mm512_cvtepi32_ps(_mm512_add_epi32(s32[r], s32b[r]));
      acc[r] = _mm512_fmadd_ps(sf, _mm512_mul_ps(_mm512_set1_ps(ws[r * ng + g]), xd), acc[r]);
      if (!OFF) acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(go[r * ng + g]), cb, acc[r]);
    }
  }
}

static inline __attribute__((always_inline)) void block(const uint8_t *A, int64_t K, const float *ws, const float *go,
                                                       int64_t ng, const int8_t *Bj, const float *XDj,
                                                       const float *CBj, const int32_t *XSj, const int SB,
                                                       const int RB, const int OFF, const char *pf, int64_t pf_lines,
                                                       __m512 *acc) {
  for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
  block_more(A, K, ws, go, ng, Bj, XDj, CBj, XSj, SB, RB, OFF, pf, pf_lines, acc);
}

/* The rows of a block against two groups of 16 tokens at once (the second group's
 * activations, scales and sums one group's size after the first's, as the driver lays them
 * out): each broadcast of a row's 4 codes feeds two vpdpbusd, one per group, which halves
 * the broadcast loads per product; 8 rows x 2 groups are 16 integer sums in flight, one
 * chain each, so block_more's chain merge goes. acc[h * RB + r]: row r, group h. The
 * same integer sums and the same floating-point steps per row and token as block_more:
 * bit-identical. SB 16 (Q6_K, 4 rows): block_pairs16. */
static inline __attribute__((always_inline)) void block2_more(const uint8_t *A, int64_t K, const float *ws,
                                                             const float *go, int64_t ng, const int8_t *B0,
                                                             const float *XD0, const float *CB0, const int32_t *XS0,
                                                             const int SB, const int RB, const int OFF, const char *pf,
                                                             int64_t pf_lines, __m512 *acc) {
  if (SB == 16) {
    block_pairs16(A, K, ws, ng, B0, XD0, XS0, RB, 2, OFF, pf, pf_lines, acc);
    return;
  }
  const int8_t *Bh[2] = {B0, B0 + K * TG};
  const float *XDh[2] = {XD0, XD0 + (K / 16) * TG}, *CBh[2] = {CB0, CB0 + (K / 16) * TG};
  const int32_t *XSh[2] = {XS0, XS0 + (K / 16) * TG};
  const int64_t pf_per = kvl__lanes_pf_per(pf_lines, ng);
  for (int64_t g = 0; g < ng; g++) {
    kvl__lanes_prefetch(pf, pf_lines, g, pf_per);
    const int64_t gi = g * SB / 16;
    __m512i s[2][8]; /* [group][row]; RB <= 8 */
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
      const __m512i s0 = OFF ? _mm512_mullo_epi32(_mm512_load_si512((const void *)(XSh[h] + gi * TG)), _mm512_set1_epi32(-OFF))
                             : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int r = 0; r < RB; r++) s[h][r] = s0;
    }
#pragma GCC unroll 8
    for (int i = 0; i < SB / 4; i++) {
      const __m512i x0 = _mm512_load_si512((const void *)(Bh[0] + (g * SB / 4 + i) * 64));
      const __m512i x1 = _mm512_load_si512((const void *)(Bh[1] + (g * SB / 4 + i) * 64));
#pragma GCC unroll 8
      for (int r = 0; r < RB; r++) {
        int32_t wv;
        memcpy(&wv, A + r * K + g * SB + 4 * i, 4);
        const __m512i wb = _mm512_set1_epi32(wv);
        s[0][r] = _mm512_dpbusd_epi32(s[0][r], wb, x0);
        s[1][r] = _mm512_dpbusd_epi32(s[1][r], wb, x1);
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
      const __m512 xd = _mm512_load_ps(XDh[h] + gi * TG), cb = _mm512_load_ps(CBh[h] + gi * TG);
#pragma GCC unroll 8
      for (int r = 0; r < RB; r++) {
        __m512 *a = acc + h * RB + r;
        *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[h][r]), _mm512_mul_ps(_mm512_set1_ps(ws[r * ng + g]), xd), *a);
        if (!OFF) *a = _mm512_fnmadd_ps(_mm512_set1_ps(go[r * ng + g]), cb, *a);
      }
    }
  }
}

/* RB rows per block: 8 for the 32-element groups; Q6_K's 16-element groups fold twice as
 * often, and 4 rows keep its sums and accumulators in registers (test-backend-ops --perf:
 * 8 rows cost it 15-20 % at 64 and 256 tokens; with two chains per row, the same as 4;
 * with block_pairs16's 16 sums per token group, 8 rows ran at 0.65-0.90 of 4 on an Intel
 * Xeon, qmatmul-ab --shape 1536x8960, 16-512 tokens) */
#define RUN(NAME, RB, SB, OFF)                                                                                     \
  static void NAME(uint32_t type, const uint8_t *A, int64_t K, const float *ws, const float *go, int64_t ng,      \
                   const int8_t *Bj, const float *XD, const float *CB, const int32_t *XS, float *v,              \
                   const char *pf, int64_t pf_lines) {                                                           \
    (void)type;                                                                                                  \
    __m512 acc[RB];                                                                                              \
    block(A, K, ws, go, ng, Bj, XD, CB, XS, SB, RB, OFF, pf, pf_lines, acc);                                     \
    for (int r = 0; r < RB; r++) _mm512_store_ps(v + r * TG, acc[r]);                                            \
  }
RUN(run_q4_k, 8, 32, 0)
RUN(run_q8_0, 8, 32, 128)
RUN(run_q5_0, 8, 32, 16)
RUN(run_q6_k, 4, 16, 32)

/* The same for two token groups (kvl__lanes_fn; results of the second group at v + RB x TG) */
#define RUN2(NAME, RB, SB, OFF)                                                                                    \
  static void NAME(uint32_t type, const uint8_t *A, int64_t K, const float *ws, const float *go, int64_t ng,      \
                   const int8_t *Bj, const float *XD, const float *CB, const int32_t *XS, float *v,              \
                   const char *pf, int64_t pf_lines) {                                                           \
    (void)type;                                                                                                  \
    __m512 acc[2 * RB];                                                                                          \
    for (int r = 0; r < 2 * RB; r++) acc[r] = _mm512_setzero_ps();                                               \
    block2_more(A, K, ws, go, ng, Bj, XD, CB, XS, SB, RB, OFF, pf, pf_lines, acc);                               \
    for (int r = 0; r < 2 * RB; r++) _mm512_store_ps(v + r * TG, acc[r]);                                        \
  }
RUN2(run2_q4_k, 8, 32, 0)
RUN2(run2_q8_0, 8, 32, 128)
RUN2(run2_q5_0, 8, 32, 16)
RUN2(run2_q6_k, 4, 16, 32)

/* Q4_K rows straight from the packed blocks, one group of 16 tokens (kvl__lanes_direct_fn):
 * a 32-bit load of codes holds 4 low nibbles (elements of sub-block 2j) and 4 high ones
 * (the same places in sub-block 2j+1); AND 0x0f gives the first as bytes, AND 0xf0 the
 * second times 16 (the 1/16 goes into their scale, exact), each into its own integer sum,
 * which are the row's two chains. No unpacked copy to write and read back, which a single
 * token group does not reuse (bench/kernel-ab/qmatmul-ab -T 16 on a Zen 4, eight runs:
 * new / old 0.95-1.24, median 1.12; neutral at 32 tokens, so two groups keep the copy). The same integer
 * sums, each group's scale times 16 / 16 exactly: bit-identical to run_q4_k. */
static inline __attribute__((always_inline)) void direct_q4_k_rows(const uint8_t *w, size_t row_bytes, int nr, int64_t K,
                                                                   const int8_t *Bj, const float *XD, const float *CB,
                                                                   const int RB, float *v, const char *pf,
                                                                   int64_t pf_lines) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f), hi4 = _mm512_set1_epi8((char)0xf0);
  const uint8_t *row[8];
  for (int r = 0; r < RB; r++) row[r] = w + (size_t)(r < nr ? r : nr - 1) * row_bytes;
  __m512 acc[8];
  for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
  const int64_t pf_per = kvl__lanes_pf_per(pf_lines, K / 256);
  for (int64_t b = 0; b < K / 256; b++) {
    kvl__lanes_prefetch(pf, pf_lines, b, pf_per);
    float ws[8][8], go[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) kvl__q4_k_group_scales(row[r] + 144 * b, ws[r], go[r]);
    for (int j = 0; j < 4; j++) {
      const int64_t g = 8 * b + 2 * j; /* the low nibbles' 32-element group; g + 1 the high's */
      __m512i slo[8], shi[8];
#pragma GCC unroll 8
      for (int r = 0; r < RB; r++) slo[r] = _mm512_setzero_si512(), shi[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++) {
        const __m512i xl = _mm512_load_si512((const void *)(Bj + (g * 8 + i) * 64));
        const __m512i xh = _mm512_load_si512((const void *)(Bj + (g * 8 + 8 + i) * 64));
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) {
          int32_t c;
          memcpy(&c, row[r] + 144 * b + 16 + 32 * j + 4 * i, 4);
          const __m512i cv = _mm512_set1_epi32(c);
          slo[r] = _mm512_dpbusd_epi32(slo[r], _mm512_and_si512(cv, lo4), xl);
          shi[r] = _mm512_dpbusd_epi32(shi[r], _mm512_and_si512(cv, hi4), xh);
        }
      }
      const __m512 xdl = _mm512_load_ps(XD + 2 * g * TG), xdh = _mm512_load_ps(XD + 2 * (g + 1) * TG);
      const __m512 cbl = _mm512_load_ps(CB + 2 * g * TG), cbh = _mm512_load_ps(CB + 2 * (g + 1) * TG);
#pragma GCC unroll 8
      for (int r = 0; r < RB; r++) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(slo[r]), _mm512_mul_ps(_mm512_set1_ps(ws[r][2 * j]), xdl), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(go[r][2 * j]), cbl, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(shi[r]),
                                 _mm512_mul_ps(_mm512_set1_ps(ws[r][2 * j + 1] * 0.0625f), xdh), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(go[r][2 * j + 1]), cbh, acc[r]);
      }
    }
  }
  for (int r = 0; r < RB; r++) _mm512_store_ps(v + r * TG, acc[r]);
}

static void direct_q4_k(uint32_t type, const uint8_t *w, size_t row_bytes, int nr, int64_t K, const int8_t *Bj,
                        const float *XD, const float *CB, const int32_t *XS, float *v, const char *pf,
                        int64_t pf_lines) {
  (void)type, (void)XS;
  direct_q4_k_rows(w, row_bytes, nr, K, Bj, XD, CB, 8, v, pf, pf_lines);
}

/* Q6_K rows straight from the packed blocks, one group of 16 tokens (kvl__lanes_direct_fn):
 * each 256-element block of the 4 rows unpacked into 1 KiB that stays in L1 (AVX-512:
 * 64 codes per select, where the driver's AVX2 unpacking built 32) just before run_q6_k's
 * own operations take it, group by group in the same order: bit-identical to run_q6_k.
 * The driver unpacked whole rows first, 35 KiB for 4 rows of the 1.5B's down projection
 * (K = 8960), more than a Zen 4's L1. */
static void direct_q6_k(uint32_t type, const uint8_t *w, size_t row_bytes, int nr, int64_t K, const int8_t *Bj,
                        const float *XD, const float *CB, const int32_t *XS, float *v, const char *pf,
                        int64_t pf_lines) {
  (void)type;
  enum { RB = 4 };
  uint8_t A[RB * 256] __attribute__((aligned(64)));
  float ws[RB * 16];
  __m512 acc[RB];
  for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
  const int64_t pf_per = kvl__lanes_pf_per(pf_lines, K / 256);
  for (int64_t c = 0; c < K / 256; c++) {
    kvl__lanes_prefetch(pf, pf_lines, c, pf_per);
    for (int r = 0; r < RB; r++) {
      const uint8_t *b = w + (size_t)(r < nr ? r : nr - 1) * row_bytes + 210 * c;
      __m512i u[2];
      for (int n = 0; n < 2; n++) {
        kvl__q6_k_half(b, n, u);
        _mm512_store_si512((void *)(A + 256 * r + 128 * n), u[0]);
        _mm512_store_si512((void *)(A + 256 * r + 128 * n + 64), u[1]);
      }
      _mm512_storeu_ps(ws + 16 * r, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
                                                  _mm512_set1_ps(kvl__h2f(b + 208))));
    }
    block_more(A, 256, ws, NULL, 16, Bj + 4096 * c, XD + 16 * TG * c, CB + 16 * TG * c, XS + 16 * TG * c, 16, RB, 32, NULL, 0, acc);
  }
  for (int r = 0; r < RB; r++) _mm512_store_ps(v + r * TG, acc[r]);
}

/* kvl__lanes_store_fn for 16 tokens and 4 or 8 rows: the rows' vectors (16 tokens each)
 * transposed in registers, so that each token's 4 or 8 results go to y as one store. The
 * same additions (result + bias, + 0 without one) as the scalar loop: bit-identical. */
static inline __attribute__((always_inline)) void store_rows(const float *v, const float *b, float *y, int64_t N,
                                                             const int RB) {
  /* q[i] (rows 0-3) and p[i] (rows 4-7): 128-bit lane l holds the rows of token 4l + i */
  __m512 q[4], p[4];
  for (int h = 0; h < RB / 4; h++) {
    const float *u = v + 4 * h * TG;
    const __m512 r0 = _mm512_load_ps(u), r1 = _mm512_load_ps(u + TG), r2 = _mm512_load_ps(u + 2 * TG),
                 r3 = _mm512_load_ps(u + 3 * TG);
    const __m512 a = _mm512_unpacklo_ps(r0, r1), c = _mm512_unpackhi_ps(r0, r1);
    const __m512 e = _mm512_unpacklo_ps(r2, r3), g = _mm512_unpackhi_ps(r2, r3);
    __m512 *o = h ? p : q;
    o[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(e)));
    o[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(e)));
    o[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c), _mm512_castps_pd(g)));
    o[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c), _mm512_castps_pd(g)));
  }
  if (RB == 4) {
    const __m128 bv = b ? _mm_loadu_ps(b) : _mm_setzero_ps();
    for (int i = 0; i < 4; i++) {
      _mm_storeu_ps(y + (int64_t)i * N, _mm_add_ps(_mm512_extractf32x4_ps(q[i], 0), bv));
      _mm_storeu_ps(y + (int64_t)(4 + i) * N, _mm_add_ps(_mm512_extractf32x4_ps(q[i], 1), bv));
      _mm_storeu_ps(y + (int64_t)(8 + i) * N, _mm_add_ps(_mm512_extractf32x4_ps(q[i], 2), bv));
      _mm_storeu_ps(y + (int64_t)(12 + i) * N, _mm_add_ps(_mm512_extractf32x4_ps(q[i], 3), bv));
    }
    return;
  }
  /* [q lane l, p lane l] is token 4l + i's eight results */
  const __m512 bv = b ? _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)b))) : _mm512_setzero_ps();
  for (int i = 0; i < 4; i++) {
    const __m512 x01 = _mm512_shuffle_f32x4(q[i], p[i], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 x23 = _mm512_shuffle_f32x4(q[i], p[i], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x01, _MM_SHUFFLE(3, 1, 2, 0)), bv);
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(x23, x23, _MM_SHUFFLE(3, 1, 2, 0)), bv);
    _mm256_storeu_ps(y + (int64_t)i * N, _mm512_castps512_ps256(y01));
    _mm256_storeu_ps(y + (int64_t)(4 + i) * N, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y01), 1)));
    _mm256_storeu_ps(y + (int64_t)(8 + i) * N, _mm512_castps512_ps256(y23));
    _mm256_storeu_ps(y + (int64_t)(12 + i) * N, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y23), 1)));
  }
}

static void store_8(const float *v, const float *b, float *y, int64_t N) { store_rows(v, b, y, N, 8); }
static void store_4(const float *v, const float *b, float *y, int64_t N) { store_rows(v, b, y, N, 4); }

int kvl__qmatmul_avx512vnni(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                            const float *xd, const int32_t *xs, int T, const float *bias, float *y) {
  switch (type) {
  case KVL_TYPE_Q6_K: return kvl__qmatmul_lanes(type, w, row_bytes, N, K, xq, xd, xs, T, bias, y, TG, 4, true, run_q6_k, run2_q6_k, direct_q6_k, store_4);
  case KVL_TYPE_Q8_0: return kvl__qmatmul_lanes(type, w, row_bytes, N, K, xq, xd, xs, T, bias, y, TG, 8, true, run_q8_0, run2_q8_0, NULL, store_8);
  case KVL_TYPE_Q5_0: return kvl__qmatmul_lanes(type, w, row_bytes, N, K, xq, xd, xs, T, bias, y, TG, 8, true, run_q5_0, run2_q5_0, NULL, store_8);
  default: return kvl__qmatmul_lanes(type, w, row_bytes, N, K, xq, xd, xs, T, bias, y, TG, 8, true, run_q4_k, run2_q4_k, direct_q4_k, store_8);
  }
}
