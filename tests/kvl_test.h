/* kvl_test.h — the few macros every C test program uses.
 *
 * A test program is one process (meson runs each with a timeout); it runs its cases,
 * prints one line per failed check with file:line, and exits 1 if any failed, 77 to be
 * counted as skipped.
 */
#ifndef KVL_TEST_H
#define KVL_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int kvl_test_failed __attribute__((unused));

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
      kvl_test_failed++;                                                         \
    }                                                                            \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                       \
  do {                                                                           \
    long long va_ = (long long)(a), vb_ = (long long)(b);                        \
    if (va_ != vb_) {                                                            \
      fprintf(stderr, "%s:%d: CHECK failed: %s == %s (%lld vs %lld)\n",          \
              __FILE__, __LINE__, #a, #b, va_, vb_);                             \
      kvl_test_failed++;                                                         \
    }                                                                            \
  } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                          \
  do {                                                                           \
    if (!strstr((hay), (needle))) {                                              \
      fprintf(stderr, "%s:%d: '%s' does not contain '%s'\n", __FILE__, __LINE__, \
              (hay), (needle));                                                  \
      kvl_test_failed++;                                                         \
    }                                                                            \
  } while (0)

#define RUN(fn)                                                                  \
  do {                                                                           \
    int before_ = kvl_test_failed;                                               \
    fn();                                                                        \
    printf("%s %s\n", kvl_test_failed == before_ ? "ok  " : "FAIL", #fn);        \
  } while (0)

#define TEST_EXIT() (kvl_test_failed ? 1 : 0)

/* xorshift64*: deterministic test data */
static inline unsigned long long kvl_test_rand(unsigned long long *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}
static inline float kvl_test_randf(unsigned long long *s) { /* uniform in [-1, 1) */
  return (float)((kvl_test_rand(s) >> 40) * (1.0 / 8388608.0) - 1.0);
}

#endif
