/* error.c — kvl_strerror and kvl_err_name from the KVL_ERRNO_MAP table. */
#include <stdarg.h>

#include "kvl_error.h"

const char *kvl_strerror(int code) {
  if (code == 0) return "success";
  switch (code) {
#define KVL__ERR_MSG(name, val, msg) case (val): return msg;
    KVL_ERRNO_MAP(KVL__ERR_MSG)
#undef KVL__ERR_MSG
  }
  return "unknown error";
}

const char *kvl_err_name(int code) {
  if (code == 0) return "OK";
  switch (code) {
#define KVL__ERR_NAME(name, val, msg) case (val): return "KVL_E" #name;
    KVL_ERRNO_MAP(KVL__ERR_NAME)
#undef KVL__ERR_NAME
  }
  return "KVL_E?";
}

int kvl_errf(char *err, size_t errlen, int code, const char *fmt, ...) {
  if (err && errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return code;
}
