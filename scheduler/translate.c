/* translate.c — extending a line of one model's pool by translating a native span of
 * another model's line (kvl_kvpool.h, "translation"). */
#include <stdlib.h>

#include "kvl_error.h"
#include "kvl_kvpool.h"
#include "kvl_translator.h"

int kvl_line_translate(kvl_line_t *dst, const kvl_line_t *src, const struct kvl_translator *t, kvl_backend_t *be,
                       kvl_writer_t writer, int32_t from, int32_t to, const struct kvl_rope *src_rope,
                       const struct kvl_rope *dst_rope, char *err, size_t errlen) {
  if (!dst || !src || !t || !src_rope || !dst_rope)
    return kvl_errf(err, errlen, KVL_EINVAL, "translate: NULL line, translator or RoPE");
  if (writer == KVL_WRITER_NATIVE)
    return kvl_errf(err, errlen, KVL_EINVAL, "translate: writer 0 is reserved for native positions");
  if (from < 0 || to < from || to > kvl_line_len(src))
    return kvl_errf(err, errlen, KVL_EINVAL, "translate: span [%d, %d) outside the source line (%d positions)",
                    (int)from, (int)to, (int)kvl_line_len(src));
  if (kvl_line_len(dst) != from)
    return kvl_errf(err, errlen, KVL_EINVAL, "translate: target line has %d positions, the span starts at %d",
                    (int)kvl_line_len(dst), (int)from);
  if (from == to) return 0;
  if (kvl_line_native_span(src, from, to) < 0)
    return kvl_errf(err, errlen, KVL_EINVAL,
                    "translate: span [%d, %d) holds translated positions (only native ones are translated)",
                    (int)from, (int)to);
  if (!kvl_line_is_hot(src))
    return kvl_errf(err, errlen, KVL_EINVAL, "translate: the source line is offloaded (restore it first)");
  int rc = kvl_line_append(dst, kvl_line_tokens(src) + from, to - from, writer);
  if (rc < 0) return kvl_errf(err, errlen, rc, "translate: no room for %d positions in the target pool", (int)(to - from));
  int32_t n = to - from, *pos = malloc((size_t)n * sizeof(int32_t));
  if (!pos) {
    kvl_line_truncate(dst, from);
    return KVL_ENOMEM;
  }
  for (int32_t i = 0; i < n; i++) pos[i] = from + i;
  kvl_pool_t *ps = kvl_line_pool(src), *pd = kvl_line_pool(dst);
  kvl_pool_host_sync(ps, be); /* a backend other than the pools' reads and writes their host bytes */
  kvl_pool_host_sync(pd, be);
  kvl_line_written(dst, from, to); /* before: a device backend that writes its copy too takes the new stamps */
  struct kvl_translate_span sp = {.src_layout = kvl_pool_layout(ps), .src_base = kvl_pool_base(ps),
                                  .src_table = kvl_line_block_table(src), .src_rope = src_rope, .src_pos = pos,
                                  .dst_layout = kvl_pool_layout(pd), .dst_base = kvl_pool_base(pd),
                                  .dst_table = kvl_line_block_table(dst), .dst_rope = dst_rope, .dst_pos = pos,
                                  .n = n, .src_stamps = kvl_pool_stamps(ps), .dst_stamps = kvl_pool_stamps(pd),
                                  .src_blocks = kvl_pool_hot_blocks(ps), .dst_blocks = kvl_pool_hot_blocks(pd)};
  rc = kvl_translator_apply_on(t, be, &sp, err, errlen);
  free(pos);
  if (rc < 0) kvl_line_truncate(dst, from);
  return rc;
}
