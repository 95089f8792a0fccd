/* kvl_quant.h — tensor data types (GGUF/ggml numbering), their block layouts, and
 * dequantisation to fp32.
 *
 * A quantised row of n elements is n / blck elements-per-block blocks of `type_size`
 * bytes each. The numbering is GGUF's own (`ggml_type`), so a type read from a file
 * is used as is.
 *
 *   const struct kvl_type_traits *tt = kvl_type_traits(KVL_TYPE_Q4_K);
 *   size_t bytes = kvl_row_size(KVL_TYPE_Q4_K, 4864);   // 19 blocks * 144 bytes
 *   float row[4864];
 *   kvl_dequant_row_ref(KVL_TYPE_Q4_K, src, row, 4864);
 *
 * The `_ref` functions are the scalar references (kernels/ref/): plain C, the same
 * operation order as the format's original implementation, so they agree bit for bit
 * with the `gguf` Python package (tests/unit/test-dequant-oracle.py checks it).
 */
#ifndef KVL_QUANT_H
#define KVL_QUANT_H

#include <stdbool.h>
#include <string.h>
#include <stddef.h>
#include <stdint.h>

enum kvl_type {
  KVL_TYPE_F32 = 0,
  KVL_TYPE_F16 = 1,
  KVL_TYPE_Q4_0 = 2,
  KVL_TYPE_Q4_1 = 3,
  /* 4 and 5 were Q4_2 / Q4_3, removed from the format */
  KVL_TYPE_Q5_0 = 6,
  KVL_TYPE_Q5_1 = 7,
  KVL_TYPE_Q8_0 = 8,
  KVL_TYPE_Q8_1 = 9,
  KVL_TYPE_Q2_K = 10,
  KVL_TYPE_Q3_K = 11,
  KVL_TYPE_Q4_K = 12,
  KVL_TYPE_Q5_K = 13,
  KVL_TYPE_Q6_K = 14,
  KVL_TYPE_Q8_K = 15,
  KVL_TYPE_I8 = 24,
  KVL_TYPE_I16 = 25,
  KVL_TYPE_I32 = 26,
  KVL_TYPE_I64 = 27,
  KVL_TYPE_F64 = 28,
  KVL_TYPE_BF16 = 30,
  KVL_TYPE_COUNT_ = 31 /* one past the largest id we know the layout of */
};

#define KVL_QK 32   /* elements per block of the legacy formats (Q4_0 .. Q8_1) */
#define KVL_QK_K 256 /* elements per super-block of the K-quants */

struct kvl_type_traits {
  const char *name;   /* "Q4_K", as llama.cpp and the gguf package print it */
  uint32_t blck;      /* elements per block (1 for plain types) */
  uint32_t type_size; /* bytes per block */
  bool can_dequant;   /* kvl_dequant_row_ref supports it */
};

/* Traits of a type id, or NULL when the id is not one whose layout we know. */
const struct kvl_type_traits *kvl_type_traits(uint32_t type);

/* The name of a type id, "type#N" (static buffer, not thread-safe) for unknown ones. */
const char *kvl_type_name(uint32_t type);

/* Bytes of a row of n elements, or 0 when n is not a multiple of the block size or
 * the type is unknown. */
size_t kvl_row_size(uint32_t type, uint64_t n);

/* fp16 / bf16 <-> fp32, exact where the format is (IEEE rounding to nearest even). */
float kvl_fp16_to_fp32(uint16_t h);
uint16_t kvl_fp32_to_fp16(float f);
/* bf16: inline and branch-free, so row loops over them vectorise (the KV cache stores
 * every forward's rows through these; translation loads and stores whole spans) */
static inline float kvl_bf16_to_fp32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t kvl_fp32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u; /* nan stays quiet */
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* Q4_K and Q5_K: the 12 scale bytes of a super-block hold 8 six-bit scales and 8 six-bit
 * minimums; those of sub-block j (0..7). Sub-blocks 0-3 keep theirs in the low 6 bits of
 * bytes j and j + 4; 4-7 take 4 bits from byte j + 4 and the top 2 from bytes j - 4 / j. */
static inline void kvl_q4_k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (uint8_t)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
    *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/* Dequantise n elements (a multiple of the type's block size) from src to dst.
 * Returns 0, KVL_EBADTYPE for a type without dequantisation, KVL_EINVAL when n is not
 * a multiple of the block size. Scalar reference: slow, exact. */
int kvl_dequant_row_ref(uint32_t type, const void *src, float *dst, int64_t n);

/* Quantise n fp32 values into `type` (reference quantisers, used by the GGUF writer to
 * make synthetic fixtures). Supports F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0;
 * the K-quants are written by tests from random blocks instead. */
int kvl_quant_row_ref(uint32_t type, const float *src, void *dst, int64_t n);

#endif /* KVL_QUANT_H */
