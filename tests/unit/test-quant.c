/* test-quant.c — half-precision conversions and block-format round trips. */
#include "../kvl_test.h"
#include "kvl_error.h"
#include "kvl_quant.h"

/* fp16 -> fp32 -> fp16 is the identity on every non-nan half; bf16 likewise. */
static void test_half_roundtrip(void) {
  int bad16 = 0, badbf = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = kvl_fp16_to_fp32((uint16_t)h);
    if (isnan(f)) continue;
    if (kvl_fp32_to_fp16(f) != h) bad16++;
    float g = kvl_bf16_to_fp32((uint16_t)h);
    if (!isnan(g) && kvl_fp32_to_bf16(g) != h) badbf++;
  }
  CHECK_EQ_INT(bad16, 0);
  CHECK_EQ_INT(badbf, 0);
}

/* Known values, including rounding to nearest even, subnormals and overflow. */
static void test_half_values(void) {
  CHECK(kvl_fp16_to_fp32(0x3c00) == 1.0f);
  CHECK(kvl_fp16_to_fp32(0xc000) == -2.0f);
  CHECK(kvl_fp16_to_fp32(0x7bff) == 65504.0f);
  CHECK(kvl_fp16_to_fp32(0x0001) == 0x1p-24f);
  CHECK(isinf(kvl_fp16_to_fp32(0x7c00)));
  CHECK_EQ_INT(kvl_fp32_to_fp16(1.0f + 0x1p-11f), 0x3c00);          /* tie -> even */
  CHECK_EQ_INT(kvl_fp32_to_fp16(1.0f + 3 * 0x1p-11f), 0x3c02);      /* tie -> even (up) */
  CHECK_EQ_INT(kvl_fp32_to_fp16(65520.0f), 0x7c00);                 /* overflow -> inf */
  CHECK_EQ_INT(kvl_fp32_to_fp16(0x1p-25f), 0x0000);                 /* tie -> even (0) */
  CHECK_EQ_INT(kvl_fp32_to_fp16(0x1p-25f * 3), 0x0002);
  CHECK_EQ_INT(kvl_fp32_to_bf16(1.0f), 0x3f80);
  CHECK_EQ_INT(kvl_fp32_to_bf16(1.00390625f), 0x3f80);              /* tie -> even */
}

static void test_traits(void) {
  CHECK_EQ_INT(kvl_row_size(KVL_TYPE_Q4_K, 4864), 19 * 144);
  CHECK_EQ_INT(kvl_row_size(KVL_TYPE_Q4_K, 896), 0);     /* not a multiple of 256 */
  CHECK_EQ_INT(kvl_row_size(KVL_TYPE_Q5_0, 896), 28 * 22);
  CHECK_EQ_INT(kvl_row_size(KVL_TYPE_F32, 7), 28);
  CHECK(kvl_type_traits(4) == NULL);                       /* removed Q4_2 */
  CHECK(kvl_type_traits(1000) == NULL);
  CHECK(!strcmp(kvl_type_name(KVL_TYPE_Q6_K), "Q6_K"));
  CHECK(!strcmp(kvl_type_name(99), "type#99"));
  float out[32];
  CHECK_EQ_INT(kvl_dequant_row_ref(KVL_TYPE_Q2_K, out, out, 256), KVL_EBADTYPE);
  CHECK_EQ_INT(kvl_dequant_row_ref(KVL_TYPE_Q8_0, out, out, 31), KVL_EINVAL);
}

/* Quantise random data, dequantise, and check the error against the format's step. */
static void test_quant_roundtrip(void) {
  static const struct { uint32_t type; float tol; } cases[] = {
    {KVL_TYPE_F32, 0.0f}, {KVL_TYPE_F16, 1e-3f}, {KVL_TYPE_BF16, 8e-3f},
    {KVL_TYPE_Q8_0, 1.0f / 127}, {KVL_TYPE_Q5_0, 1.0f / 15}, {KVL_TYPE_Q5_1, 2.0f / 31},
    {KVL_TYPE_Q4_0, 1.0f / 7}, {KVL_TYPE_Q4_1, 2.0f / 15},
  };
  unsigned long long s = 42;
  enum { N = 1024 };
  float x[N], y[N];
  unsigned char buf[N * 4];
  for (int i = 0; i < N; i++) x[i] = kvl_test_randf(&s);
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    CHECK_EQ_INT(kvl_quant_row_ref(cases[c].type, x, buf, N), 0);
    CHECK_EQ_INT(kvl_dequant_row_ref(cases[c].type, buf, y, N), 0);
    float maxerr = 0;
    for (int i = 0; i < N; i++) maxerr = fmaxf(maxerr, fabsf(x[i] - y[i]));
    if (maxerr > cases[c].tol)
      fprintf(stderr, "%s: max error %g > %g\n", kvl_type_name(cases[c].type), maxerr, cases[c].tol);
    CHECK(maxerr <= cases[c].tol);
  }
}

static void test_strerror(void) {
  CHECK(!strcmp(kvl_strerror(0), "success"));
  CHECK(!strcmp(kvl_strerror(KVL_EFORMAT), "malformed file"));
  CHECK(!strcmp(kvl_err_name(KVL_ENOMEM), "KVL_ENOMEM"));
  CHECK(!strcmp(kvl_strerror(-99999), "unknown error"));
}

int main(void) {
  RUN(test_half_roundtrip);
  RUN(test_half_values);
  RUN(test_traits);
  RUN(test_quant_roundtrip);
  RUN(test_strerror);
  return TEST_EXIT();
}
