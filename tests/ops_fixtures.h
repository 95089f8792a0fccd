/* ops_fixtures.h — random inputs, quantised weights and the error measure shared by the
 * kernel harnesses (unit/test-backend-ops.c, gpu/test-cuda-ops.c). Static functions: include
 * from one test file each. */
#ifndef KVL_OPS_FIXTURES_H
#define KVL_OPS_FIXTURES_H

#include <stdlib.h>
#include <string.h>

#include "kvl_quant.h"
#include "kvl_test.h"

static unsigned long long seed = 1;

static void fill(float *x, size_t n, float scale) {
  for (size_t i = 0; i < n; i++) x[i] = kvl_test_randf(&seed) * scale;
}

/* Weight data of `type`: quantised random values; K-quants from random bytes with
 * sane scales (their quantisers are not needed for this). */
static void *make_weight(uint32_t type, int64_t rows, int64_t cols) {
  size_t rb = kvl_row_size(type, (uint64_t)cols);
  unsigned char *d = malloc(rb * (size_t)rows);
  float *tmp = malloc((size_t)cols * sizeof(float));
  for (int64_t r = 0; r < rows; r++) {
    unsigned char *row = d + (size_t)r * rb;
    if (type == KVL_TYPE_Q4_K || type == KVL_TYPE_Q5_K || type == KVL_TYPE_Q6_K) {
      for (size_t i = 0; i < rb; i++) row[i] = (unsigned char)kvl_test_rand(&seed);
      size_t bs = kvl_type_traits(type)->type_size;
      for (size_t b = 0; b < rb / bs; b++) {
        unsigned char *blk = row + b * bs;
        uint16_t h = kvl_fp32_to_fp16(0.002f * (1 + (float)(kvl_test_rand(&seed) % 100) / 100));
        uint16_t h2 = kvl_fp32_to_fp16(0.001f);
        if (type == KVL_TYPE_Q6_K) { memcpy(blk + 208, &h, 2); }
        else { memcpy(blk, &h, 2); memcpy(blk + 2, &h2, 2); }
      }
    } else {
      fill(tmp, (size_t)cols, 1.0f);
      kvl_quant_row_ref(type, tmp, row, cols);
    }
  }
  free(tmp);
  return d;
}

static double nmse(const float *a, const float *ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double e = (double)a[i] - ref[i];
    num += e * e;
    den += (double)ref[i] * ref[i];
  }
  return den > 0 ? num / den : num;
}

#endif
