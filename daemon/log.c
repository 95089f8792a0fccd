/* log.c — structured logs: one JSON object per line on stderr, with a timestamp, level
 * and event name; request ids travel in the extra members. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "daemon.h"

static enum kvld_level g_level = KVLD_INFO;
static const char *const level_name[] = {"debug", "info", "warn", "error"};

void kvld_log_set_level(const char *level) {
  for (int i = 0; i < 4; i++)
    if (!strcmp(level, level_name[i])) g_level = (enum kvld_level)i;
}

void kvld_json_escape(const char *s, char *buf, size_t len) {
  size_t o = 0;
  for (; s && *s && o + 7 < len; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') {
      buf[o++] = '\\';
      buf[o++] = (char)ch;
    } else if (ch < 0x20)
      o += (size_t)snprintf(buf + o, len - o, "\\u%04x", ch);
    else
      buf[o++] = (char)ch;
  }
  buf[o] = 0;
}

void kvld_log(enum kvld_level lv, const char *event, const char *fmt, ...) {
  if (lv < g_level) return;
  struct timeval tv;
  gettimeofday(&tv, NULL);
  struct tm tm;
  gmtime_r(&tv.tv_sec, &tm);
  char ts[40], extra[2048] = "";
  strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%S", &tm);
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(extra, sizeof(extra), fmt, ap);
    va_end(ap);
  }
  fprintf(stderr, "{\"ts\":\"%s.%03dZ\",\"level\":\"%s\",\"event\":\"%s\"%s%s}\n", ts, (int)(tv.tv_usec / 1000),
          level_name[lv], event, extra[0] ? "," : "", extra);
}
