/* model.c — a resident model's daemon side: open (weights, tokenizer, chat template,
 * end-of-generation ids, metrics), its scheduler configuration, close; and the daemon's
 * clock. Kept apart from main.c so that the request decoders' fuzz target links the
 * same code kvlingod runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon.h"
#include "kvl_error.h"
#include "kvl_sched.h"
#include "sim-ops.h" /* kvl_backend_cuda_sim */

double kvld_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int kvld_model_open(struct kvld_model *m, const struct kvld_model_cfg *mc, char *err, size_t errlen) {
  if (!strncmp(mc->backend, "cuda", 4)) { /* before the weights are read: a machine without a GPU says so at once */
    char why[256];
    const bool sim = !strcmp(mc->backend, "cuda-sim");
    if (!(m->be = sim ? kvl_backend_cuda_sim(why, sizeof(why)) : kvl_backend_cuda(why, sizeof(why))))
      return kvl_errf(err, errlen, KVL_ENOTSUP, "model '%s': backend %s: %s", mc->name, mc->backend, why);
  } else {
    m->be = kvl_backend_cpu();
  }
  char *path = kvl_model_resolve(mc->path);
  if (!path) return kvl_errf(err, errlen, KVL_ENOENT, "model '%s': %s not found (scripts/fetch-models)", mc->name, mc->path);
  snprintf(m->path, sizeof(m->path), "%s", path);
  free(path);
  snprintf(m->name, sizeof(m->name), "%s", mc->name);
  snprintf(m->kv_dtype, sizeof(m->kv_dtype), "%s", mc->kv_dtype);
  int rc = kvl_model_open(m->path, &m->m, err, errlen);
  if (rc == 0) rc = kvl_tokenizer_from_gguf(kvl_model_gguf(m->m), &m->tk, err, errlen);
  if (rc == 0) m->repacked_bytes = kvl_model_prepare(m->m, m->be); /* not on the first request */
  if (rc < 0) {
    kvld_model_close(m);
    return rc;
  }
  const char *tsrc;
  char terr[256];
  if (kvl_gguf_get_str(kvl_model_gguf(m->m), "tokenizer.chat_template", &tsrc) == 0 &&
      kvl_template_parse(tsrc, &m->tmpl, terr, sizeof(terr)) < 0)
    m->tmpl = NULL; /* chat input will be refused for this model */
  struct kvl_model_fingerprint fp;
  char ferr[256];
  if (kvl_fingerprint_from_gguf(kvl_model_gguf(m->m), &fp, ferr, sizeof(ferr)) == 0)
    snprintf(m->tok_hash, sizeof(m->tok_hash), "%s", fp.tokenizer_hash);
  const struct kvl_model_hparams *hp = kvl_model_hparams(m->m);
  m->max_model_len = mc->max_model_len < hp->n_ctx_train ? mc->max_model_len : hp->n_ctx_train;
  m->n_eog = 0; /* once here, not per request: a scan of the vocabulary */
  for (int32_t id = 0; id < hp->n_vocab && m->n_eog < 8; id++)
    if (kvl_tokenizer_is_eog(m->tk, id)) m->eog[m->n_eog++] = id;
  kvld_hist_init(&m->mx.ttft, kvld_ttft_buckets, kvld_n_ttft_buckets);
  kvld_hist_init(&m->mx.itl, kvld_itl_buckets, kvld_n_itl_buckets);
  kvld_hist_init(&m->mx.e2e, kvld_e2e_buckets, kvld_n_e2e_buckets);
  kvld_hist_init(&m->mx.queue, kvld_e2e_buckets, kvld_n_e2e_buckets);
  return 0;
}

void kvld_model_sched_cfg(const struct kvld_model *m, const struct kvld_model_cfg *mc, bool prefault,
                          struct kvl_sched_model *sm) {
  memset(sm, 0, sizeof(*sm));
  sm->name = m->name;
  sm->model = m->m;
  sm->backend = m->be ? m->be : kvl_backend_cpu();
  sm->max_model_len = m->max_model_len;
  sm->pool.layout = kvl_model_kv_layout(m->m, !strcmp(mc->kv_dtype, "f32") ? KVL_KV_F32 : KVL_KV_BF16);
  sm->pool.hot_bytes = (size_t)mc->hot_bytes;
  sm->pool.cold_bytes = (size_t)mc->cold_bytes;
  sm->pool.prefault = prefault;
  if (mc->disk_bytes > 0 && m->disk_path[0]) {
    sm->pool.disk_bytes = (size_t)mc->disk_bytes;
    sm->pool.disk_path = m->disk_path;
  }
}

void kvld_model_close(struct kvld_model *m) {
  kvl_template_free(m->tmpl);
  kvl_tokenizer_free(m->tk);
  kvl_model_free(m->m);
  m->tmpl = NULL;
  m->tk = NULL;
  m->m = NULL;
}

