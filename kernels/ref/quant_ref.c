/* quant_ref.c — scalar reference of every block format: layouts, fp16/bf16
 * conversion, dequantisation and the simple quantisers used for synthetic fixtures.
 *
 * The arithmetic follows the formats' original definitions operation for operation
 * (scale products first, then the multiply by the quant, then the offset), and this
 * file is compiled with -ffp-contract=off, so results are bit-identical to the `gguf`
 * Python package's numpy dequantisation. Keep it that way: fast paths live in cpu/.
 */
#include <math.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_quant.h"

/* Block layouts (little-endian, packed; all members are bytes or 16-bit halves). */
struct blk_q4_0 { uint16_t d; uint8_t qs[KVL_QK / 2]; };
struct blk_q4_1 { uint16_t d, m; uint8_t qs[KVL_QK / 2]; };
struct blk_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[KVL_QK / 2]; };
struct blk_q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[KVL_QK / 2]; };
struct blk_q8_0 { uint16_t d; int8_t qs[KVL_QK]; };
struct blk_q4_k { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[KVL_QK_K / 2]; };
struct blk_q5_k { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[KVL_QK_K / 8]; uint8_t qs[KVL_QK_K / 2]; };
struct blk_q6_k { uint8_t ql[KVL_QK_K / 2]; uint8_t qh[KVL_QK_K / 4]; int8_t scales[KVL_QK_K / 16]; uint16_t d; };

_Static_assert(sizeof(struct blk_q4_0) == 18, "Q4_0 layout");
_Static_assert(sizeof(struct blk_q4_1) == 20, "Q4_1 layout");
_Static_assert(sizeof(struct blk_q5_0) == 22, "Q5_0 layout");
_Static_assert(sizeof(struct blk_q5_1) == 24, "Q5_1 layout");
_Static_assert(sizeof(struct blk_q8_0) == 34, "Q8_0 layout");
_Static_assert(sizeof(struct blk_q4_k) == 144, "Q4_K layout");
_Static_assert(sizeof(struct blk_q5_k) == 176, "Q5_K layout");
_Static_assert(sizeof(struct blk_q6_k) == 210, "Q6_K layout");

/* Indexed by type id. Types we only know the size of (to bound-check files that hold
 * them) have can_dequant = false. */
static const struct kvl_type_traits traits[KVL_TYPE_COUNT_] = {
  [KVL_TYPE_F32]  = {"F32", 1, 4, true},
  [KVL_TYPE_F16]  = {"F16", 1, 2, true},
  [KVL_TYPE_Q4_0] = {"Q4_0", KVL_QK, 18, true},
  [KVL_TYPE_Q4_1] = {"Q4_1", KVL_QK, 20, true},
  [KVL_TYPE_Q5_0] = {"Q5_0", KVL_QK, 22, true},
  [KVL_TYPE_Q5_1] = {"Q5_1", KVL_QK, 24, true},
  [KVL_TYPE_Q8_0] = {"Q8_0", KVL_QK, 34, true},
  [KVL_TYPE_Q8_1] = {"Q8_1", KVL_QK, 36, false},
  [KVL_TYPE_Q2_K] = {"Q2_K", KVL_QK_K, 84, false},
  [KVL_TYPE_Q3_K] = {"Q3_K", KVL_QK_K, 110, false},
  [KVL_TYPE_Q4_K] = {"Q4_K", KVL_QK_K, 144, true},
  [KVL_TYPE_Q5_K] = {"Q5_K", KVL_QK_K, 176, true},
  [KVL_TYPE_Q6_K] = {"Q6_K", KVL_QK_K, 210, true},
  [KVL_TYPE_Q8_K] = {"Q8_K", KVL_QK_K, 292, false},
  [KVL_TYPE_I8]   = {"I8", 1, 1, false},
  [KVL_TYPE_I16]  = {"I16", 1, 2, false},
  [KVL_TYPE_I32]  = {"I32", 1, 4, false},
  [KVL_TYPE_I64]  = {"I64", 1, 8, false},
  [KVL_TYPE_F64]  = {"F64", 1, 8, false},
  [KVL_TYPE_BF16] = {"BF16", 1, 2, true},
};

const struct kvl_type_traits *kvl_type_traits(uint32_t type) {
  if (type >= KVL_TYPE_COUNT_ || traits[type].name == NULL) return NULL;
  return &traits[type];
}

const char *kvl_type_name(uint32_t type) {
  static char buf[24];
  const struct kvl_type_traits *t = kvl_type_traits(type);
  if (t) return t->name;
  snprintf(buf, sizeof(buf), "type#%u", type);
  return buf;
}

size_t kvl_row_size(uint32_t type, uint64_t n) {
  const struct kvl_type_traits *t = kvl_type_traits(type);
  if (!t || n % t->blck) return 0;
  uint64_t nb = n / t->blck;
  if (nb > SIZE_MAX / t->type_size) return 0;
  return (size_t)(nb * t->type_size);
}

/* ---- half precision ---------------------------------------------------------- */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float kvl_fp16_to_fp32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return u2f(sign | 0x7f800000u | (man << 13)); /* inf / nan */
  if (exp == 0) {
    if (man == 0) return u2f(sign);
    /* subnormal: value = man * 2^-24, exact in fp32 */
    float v = (float)man * 0x1p-24f;
    return sign ? -v : v;
  }
  return u2f(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t kvl_fp32_to_fp16(float f) {
  uint32_t u = f2u(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) /* inf or nan (keep nan quiet) */
    return sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0);
  if (a >= 0x477ff000u) return sign | 0x7c00; /* rounds to >= 65520: overflow */
  if (a < 0x38800000u) {                       /* below the smallest normal: subnormal */
    /* scale so that one fp16 subnormal ulp (2^-24) is 1.0, round to nearest even */
    float v = u2f(a) * 0x1p24f;
    return sign | (uint16_t)lrintf(v); /* lrintf rounds half to even by default */
  }
  uint32_t mant_odd = (a >> 13) & 1;
  a += 0xfff + mant_odd; /* round to nearest even on the 13 dropped bits */
  return sign | (uint16_t)((a - 0x38000000u) >> 13);
}

/* ---- dequantisation ----------------------------------------------------------- */

#define H(x) kvl_fp16_to_fp32(x)

static void deq_q4_0(const struct blk_q4_0 *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += KVL_QK) {
    float d = H(b[i].d);
    for (int j = 0; j < KVL_QK / 2; j++) {
      y[j] = (float)((b[i].qs[j] & 0x0f) - 8) * d;
      y[j + KVL_QK / 2] = (float)((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

static void deq_q4_1(const struct blk_q4_1 *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += KVL_QK) {
    float d = H(b[i].d), m = H(b[i].m);
    for (int j = 0; j < KVL_QK / 2; j++) {
      y[j] = (float)(b[i].qs[j] & 0x0f) * d + m;
      y[j + KVL_QK / 2] = (float)(b[i].qs[j] >> 4) * d + m;
    }
  }
}

static inline uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void deq_q5_0(const struct blk_q5_0 *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += KVL_QK) {
    float d = H(b[i].d);
    uint32_t qh = le32(b[i].qh);
    for (int j = 0; j < KVL_QK / 2; j++) {
      int x0 = (int)((b[i].qs[j] & 0x0f) | (((qh >> j) << 4) & 0x10)) - 16;
      int x1 = (int)((b[i].qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
      y[j] = (float)x0 * d;
      y[j + KVL_QK / 2] = (float)x1 * d;
    }
  }
}

static void deq_q5_1(const struct blk_q5_1 *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += KVL_QK) {
    float d = H(b[i].d), m = H(b[i].m);
    uint32_t qh = le32(b[i].qh);
    for (int j = 0; j < KVL_QK / 2; j++) {
      int x0 = (int)((b[i].qs[j] & 0x0f) | (((qh >> j) << 4) & 0x10));
      int x1 = (int)((b[i].qs[j] >> 4) | ((qh >> (j + 12)) & 0x10));
      y[j] = (float)x0 * d + m;
      y[j + KVL_QK / 2] = (float)x1 * d + m;
    }
  }
}

static void deq_q8_0(const struct blk_q8_0 *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += KVL_QK) {
    float d = H(b[i].d);
    for (int j = 0; j < KVL_QK; j++) y[j] = (float)b[i].qs[j] * d;
  }
}

static void deq_q4_k(const struct blk_q4_k *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    float d = H(b[i].d), dmin = H(b[i].dmin);
    const uint8_t *q = b[i].qs;
    for (int j = 0, is = 0; j < KVL_QK_K; j += 64, is += 2, q += 32) {
      uint8_t sc, m;
      kvl_q4_k_scale_min(is, b[i].scales, &sc, &m);
      float d1 = d * (float)sc, m1 = dmin * (float)m;
      kvl_q4_k_scale_min(is + 1, b[i].scales, &sc, &m);
      float d2 = d * (float)sc, m2 = dmin * (float)m;
      for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0x0f) - m1;
      for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
    }
  }
}

static void deq_q5_k(const struct blk_q5_k *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    float d = H(b[i].d), dmin = H(b[i].dmin);
    const uint8_t *ql = b[i].qs, *qh = b[i].qh;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < KVL_QK_K; j += 64, is += 2, ql += 32) {
      uint8_t sc, m;
      kvl_q4_k_scale_min(is, b[i].scales, &sc, &m);
      float d1 = d * (float)sc, m1 = dmin * (float)m;
      kvl_q4_k_scale_min(is + 1, b[i].scales, &sc, &m);
      float d2 = d * (float)sc, m2 = dmin * (float)m;
      for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 0x0f) + (qh[l] & u1 ? 16 : 0)) - m1;
      for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
      u1 = (uint8_t)(u1 << 2);
      u2 = (uint8_t)(u2 << 2);
    }
  }
}

static void deq_q6_k(const struct blk_q6_k *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    float d = H(b[i].d);
    const uint8_t *ql = b[i].ql, *qh = b[i].qh;
    const int8_t *sc = b[i].scales;
    for (int n = 0; n < KVL_QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; l++) {
        int is = l / 16;
        int q1 = (int)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
        int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
        int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * (float)sc[is + 0] * (float)q1;
        y[l + 32] = d * (float)sc[is + 2] * (float)q2;
        y[l + 64] = d * (float)sc[is + 4] * (float)q3;
        y[l + 96] = d * (float)sc[is + 6] * (float)q4;
      }
    }
  }
}

int kvl_dequant_row_ref(uint32_t type, const void *src, float *dst, int64_t n) {
  const struct kvl_type_traits *t = kvl_type_traits(type);
  if (!t || !t->can_dequant) return KVL_EBADTYPE;
  if (n < 0 || n % t->blck) return KVL_EINVAL;
  int64_t nb = n / t->blck;
  switch (type) {
  case KVL_TYPE_F32: memcpy(dst, src, (size_t)n * 4); break;
  case KVL_TYPE_F16: {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) dst[i] = kvl_fp16_to_fp32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
    break;
  }
  case KVL_TYPE_BF16: {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) dst[i] = kvl_bf16_to_fp32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
    break;
  }
  case KVL_TYPE_Q4_0: deq_q4_0(src, dst, nb); break;
  case KVL_TYPE_Q4_1: deq_q4_1(src, dst, nb); break;
  case KVL_TYPE_Q5_0: deq_q5_0(src, dst, nb); break;
  case KVL_TYPE_Q5_1: deq_q5_1(src, dst, nb); break;
  case KVL_TYPE_Q8_0: deq_q8_0(src, dst, nb); break;
  case KVL_TYPE_Q4_K: deq_q4_k(src, dst, nb); break;
  case KVL_TYPE_Q5_K: deq_q5_k(src, dst, nb); break;
  case KVL_TYPE_Q6_K: deq_q6_k(src, dst, nb); break;
  default: return KVL_EBADTYPE;
  }
  return 0;
}

/* ---- reference quantisers (synthetic fixtures) ------------------------------- */

/* Symmetric formats: d = max|x| / qmax with the sign of the extreme value, so the
 * extreme maps to the format's most negative code exactly (the classic scheme). */
static void q_sym(const float *x, float *d_out, float *id_out, float qdiv) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < KVL_QK; j++)
    if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
  float d = max / qdiv;
  *d_out = d;
  *id_out = d != 0.0f ? 1.0f / d : 0.0f;
}

static void q_asym(const float *x, float *d_out, float *id_out, float *min_out, float levels) {
  float lo = x[0], hi = x[0];
  for (int j = 1; j < KVL_QK; j++) { lo = fminf(lo, x[j]); hi = fmaxf(hi, x[j]); }
  float d = (hi - lo) / levels;
  *d_out = d;
  *id_out = d != 0.0f ? 1.0f / d : 0.0f;
  *min_out = lo;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

int kvl_quant_row_ref(uint32_t type, const float *x, void *dst, int64_t n) {
  const struct kvl_type_traits *t = kvl_type_traits(type);
  if (!t) return KVL_EBADTYPE;
  if (n < 0 || n % t->blck) return KVL_EINVAL;
  int64_t nb = n / t->blck;
  uint8_t *o = dst;
  switch (type) {
  case KVL_TYPE_F32: memcpy(dst, x, (size_t)n * 4); return 0;
  case KVL_TYPE_F16:
  case KVL_TYPE_BF16:
    for (int64_t i = 0; i < n; i++) {
      uint16_t h = type == KVL_TYPE_F16 ? kvl_fp32_to_fp16(x[i]) : kvl_fp32_to_bf16(x[i]);
      o[2 * i] = (uint8_t)h;
      o[2 * i + 1] = (uint8_t)(h >> 8);
    }
    return 0;
  case KVL_TYPE_Q8_0:
    for (int64_t i = 0; i < nb; i++, x += KVL_QK) {
      struct blk_q8_0 *b = (struct blk_q8_0 *)dst + i;
      float amax = 0.0f;
      for (int j = 0; j < KVL_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
      float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      b->d = kvl_fp32_to_fp16(d);
      for (int j = 0; j < KVL_QK; j++) b->qs[j] = (int8_t)lrintf(x[j] * id);
    }
    return 0;
  case KVL_TYPE_Q4_0:
  case KVL_TYPE_Q5_0: {
    bool five = type == KVL_TYPE_Q5_0;
    for (int64_t i = 0; i < nb; i++, x += KVL_QK) {
      float d, id;
      q_sym(x, &d, &id, five ? -16.0f : -8.0f);
      int off = five ? 16 : 8, top = five ? 31 : 15;
      uint8_t qs[KVL_QK / 2];
      uint32_t qh = 0;
      for (int j = 0; j < KVL_QK / 2; j++) {
        int a = clampi((int)(x[j] * id + (float)off + 0.5f), 0, top);
        int c = clampi((int)(x[j + KVL_QK / 2] * id + (float)off + 0.5f), 0, top);
        qs[j] = (uint8_t)((a & 0x0f) | (c & 0x0f) << 4);
        qh |= (uint32_t)((a >> 4) & 1) << j;
        qh |= (uint32_t)((c >> 4) & 1) << (j + 16);
      }
      if (five) {
        struct blk_q5_0 *b = (struct blk_q5_0 *)dst + i;
        b->d = kvl_fp32_to_fp16(d);
        for (int k = 0; k < 4; k++) b->qh[k] = (uint8_t)(qh >> (8 * k));
        memcpy(b->qs, qs, sizeof(qs));
      } else {
        struct blk_q4_0 *b = (struct blk_q4_0 *)dst + i;
        b->d = kvl_fp32_to_fp16(d);
        memcpy(b->qs, qs, sizeof(qs));
      }
    }
    return 0;
  }
  case KVL_TYPE_Q4_1:
  case KVL_TYPE_Q5_1: {
    bool five = type == KVL_TYPE_Q5_1;
    for (int64_t i = 0; i < nb; i++, x += KVL_QK) {
      float d, id, mn;
      q_asym(x, &d, &id, &mn, five ? 31.0f : 15.0f);
      int top = five ? 31 : 15;
      uint8_t qs[KVL_QK / 2];
      uint32_t qh = 0;
      for (int j = 0; j < KVL_QK / 2; j++) {
        int a = clampi((int)((x[j] - mn) * id + 0.5f), 0, top);
        int c = clampi((int)((x[j + KVL_QK / 2] - mn) * id + 0.5f), 0, top);
        qs[j] = (uint8_t)((a & 0x0f) | (c & 0x0f) << 4);
        qh |= (uint32_t)((a >> 4) & 1) << j;
        qh |= (uint32_t)((c >> 4) & 1) << (j + 16);
      }
      if (five) {
        struct blk_q5_1 *b = (struct blk_q5_1 *)dst + i;
        b->d = kvl_fp32_to_fp16(d);
        b->m = kvl_fp32_to_fp16(mn);
        for (int k = 0; k < 4; k++) b->qh[k] = (uint8_t)(qh >> (8 * k));
        memcpy(b->qs, qs, sizeof(qs));
      } else {
        struct blk_q4_1 *b = (struct blk_q4_1 *)dst + i;
        b->d = kvl_fp32_to_fp16(d);
        b->m = kvl_fp32_to_fp16(mn);
        memcpy(b->qs, qs, sizeof(qs));
      }
    }
    return 0;
  }
  default:
    return KVL_ENOTSUP;
  }
}
