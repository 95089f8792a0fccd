/* kvl_error.h — the one error-code table of kvlingo, and assertions.
 *
 * Every action in kvlingo returns 0 on success or a negative KVL_E* code; predicates
 * return bool. The codes are negative errno values where one fits (libuv's rule), so a
 * code that crossed a system call needs no translation. Map to gRPC / HTTP status only
 * at the API edge (daemon/).
 *
 *   int rc = kvl_gguf_open(path, &g, err, sizeof(err));
 *   if (rc < 0) fprintf(stderr, "%s: %s (%s)\n", path, err, kvl_strerror(rc));
 *
 * This header lives in kernels/ because kernels/ is the bottom of the dependency graph
 * (DESIGN.md "Modules"): every other module may include it.
 */
#ifndef KVL_ERROR_H
#define KVL_ERROR_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

/* X(name, value, message). Values are negative; the errno-backed ones keep errno's
 * number so strerror-style tools agree, the kvlingo-specific ones start at -4000. */
#define KVL_ERRNO_MAP(X)                                                      \
  X(NOMEM,    -ENOMEM,    "out of memory")                                    \
  X(INVAL,    -EINVAL,    "invalid argument")                                 \
  X(IO,       -EIO,       "input/output error")                               \
  X(NOENT,    -ENOENT,    "no such file or entry")                            \
  X(NOTSUP,   -ENOTSUP,   "operation not supported")                          \
  X(RANGE,    -ERANGE,    "value out of range")                               \
  X(OVERFLOW, -EOVERFLOW, "size overflow")                                    \
  X(CANCELED, -ECANCELED, "operation canceled")                               \
  X(BUSY,     -EBUSY,     "resource busy")                                    \
  X(AGAIN,    -EAGAIN,    "resource temporarily unavailable")                 \
  X(EXIST,    -EEXIST,    "already exists")                                   \
  X(FORMAT,   -4001,      "malformed file")                                   \
  X(TRUNC,    -4002,      "file truncated")                                   \
  X(BADTYPE,  -4003,      "unknown or unsupported data type")                 \
  X(MISMATCH, -4004,      "shapes or models do not match")                    \
  X(FULL,     -4005,      "pool full")

enum kvl_errno {
#define KVL__ERR_ENUM(name, val, msg) KVL_E##name = (val),
  KVL_ERRNO_MAP(KVL__ERR_ENUM)
#undef KVL__ERR_ENUM
};

/* A static English message for a code (0 gives "success"; unknown codes say so). */
const char *kvl_strerror(int code);

/* Write a printf-style message into err (when errlen > 0) and return `code`: the one
 * way actions report a failure with its reason ("tensor 'x' has shape ..."). */
int kvl_errf(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The symbolic name of a code ("KVL_EFORMAT"), for logs and tests. */
const char *kvl_err_name(int code);

/* Programmer misuse: abort with file:line, in every build type (STYLE.md §4). */
#define KVL_ASSERT(cond)                                                      \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "%s:%d: %s: assertion '%s' failed\n", __FILE__,         \
              __LINE__, __func__, #cond);                                     \
      abort();                                                                \
    }                                                                         \
  } while (0)

#endif /* KVL_ERROR_H */
