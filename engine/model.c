/* model.c — loading a model from GGUF: hyper-parameters from the metadata, every tensor
 * checked for presence, shape and type before anything runs. Architectures: qwen2. */
#include <dirent.h>
#include <unistd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "model-impl.h"

/* Integer hyper-parameter "<arch>.<key>", required and within [lo, hi]. */
static int hp_int(const kvl_gguf_t *g, const char *arch, const char *key, int lo, int hi, int *out, char *err,
                  size_t errlen) {
  char k[128];
  snprintf(k, sizeof(k), "%s.%s", arch, key);
  int64_t v;
  int rc = kvl_gguf_get_int(g, k, &v);
  if (rc == KVL_ENOENT) return kvl_errf(err, errlen, KVL_EFORMAT, "missing metadata key '%s'", k);
  if (rc < 0) return kvl_errf(err, errlen, KVL_EFORMAT, "metadata key '%s' is not an integer", k);
  if (v < lo || v > hi) return kvl_errf(err, errlen, KVL_EFORMAT, "metadata '%s' = %lld is out of range [%d, %d]", k, (long long)v, lo, hi);
  *out = (int)v;
  return 0;
}

static int hp_float(const kvl_gguf_t *g, const char *arch, const char *key, float def, float *out, char *err,
                    size_t errlen) {
  char k[128];
  snprintf(k, sizeof(k), "%s.%s", arch, key);
  double v;
  int rc = kvl_gguf_get_float(g, k, &v);
  if (rc == KVL_ENOENT) { *out = def; return 0; }
  if (rc < 0 || !(v > 0)) return kvl_errf(err, errlen, KVL_EFORMAT, "metadata key '%s' must be a positive number", k);
  *out = (float)v;
  return 0;
}

/* Look up a tensor and check it: 2-d weight of rows x cols (cols = ne[0]), or a 1-d
 * fp32 vector when rows == 0. */
static int get_tensor(const kvl_gguf_t *g, const char *name, int64_t cols, int64_t rows, struct kvl_weight *w,
                      const float **vec, char *err, size_t errlen) {
  const struct kvl_gguf_tensor *t = kvl_gguf_find_tensor(g, name);
  if (!t) return kvl_errf(err, errlen, KVL_EFORMAT, "missing tensor '%s'", name);
  if (rows == 0) {
    if (t->n_dims != 1 || t->ne[0] != (uint64_t)cols)
      return kvl_errf(err, errlen, KVL_EMISMATCH, "tensor '%s' has shape [%llu%s], expected [%lld]", name,
                  (unsigned long long)t->ne[0], t->n_dims > 1 ? ", ..." : "", (long long)cols);
    if (t->type != KVL_TYPE_F32)
      return kvl_errf(err, errlen, KVL_EBADTYPE, "tensor '%s' is %s, expected F32", name, kvl_type_name(t->type));
    *vec = t->data;
    return 0;
  }
  if (t->n_dims != 2 || t->ne[0] != (uint64_t)cols || t->ne[1] != (uint64_t)rows)
    return kvl_errf(err, errlen, KVL_EMISMATCH, "tensor '%s' has shape [%llu, %llu%s], expected [%lld, %lld]", name,
                (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], t->n_dims > 2 ? ", ..." : "",
                (long long)cols, (long long)rows);
  const struct kvl_type_traits *tt = kvl_type_traits(t->type);
  if (!tt || !tt->can_dequant)
    return kvl_errf(err, errlen, KVL_EBADTYPE, "tensor '%s' has type %s, which kvlingo cannot compute with yet", name,
                kvl_type_name(t->type));
  *w = (struct kvl_weight){t->type, cols, rows, t->data, NULL, NULL};
  return 0;
}

static int load_qwen2(struct kvl_model *m, char *err, size_t errlen) {
  const kvl_gguf_t *g = m->gguf;
  struct kvl_model_hparams *hp = &m->hp;
  const char *a = "qwen2";
  int rc;
  if ((rc = hp_int(g, a, "block_count", 1, 1024, &hp->n_layer, err, errlen)) ||
      (rc = hp_int(g, a, "embedding_length", 1, 1 << 16, &hp->n_embd, err, errlen)) ||
      (rc = hp_int(g, a, "feed_forward_length", 1, 1 << 18, &hp->n_ff, err, errlen)) ||
      (rc = hp_int(g, a, "attention.head_count", 1, 1024, &hp->n_head, err, errlen)) ||
      (rc = hp_int(g, a, "attention.head_count_kv", 1, 1024, &hp->n_kv_head, err, errlen)) ||
      (rc = hp_int(g, a, "context_length", 1, 1 << 24, &hp->n_ctx_train, err, errlen)) ||
      (rc = hp_float(g, a, "rope.freq_base", 10000.0f, &hp->rope_theta, err, errlen)) ||
      (rc = hp_float(g, a, "attention.layer_norm_rms_epsilon", 1e-6f, &hp->rms_eps, err, errlen)))
    return rc;
  if (hp->n_embd % hp->n_head)
    return kvl_errf(err, errlen, KVL_EFORMAT, "embedding width %d is not a multiple of the %d heads", hp->n_embd, hp->n_head);
  if (hp->n_head % hp->n_kv_head)
    return kvl_errf(err, errlen, KVL_EFORMAT, "%d query heads cannot be grouped over %d KV heads", hp->n_head, hp->n_kv_head);
  hp->head_dim = hp->n_embd / hp->n_head;
  if ((rc = kvl_rope_init(&m->rope, hp->head_dim, hp->rope_theta)) < 0)
    return kvl_errf(err, errlen, KVL_EFORMAT, "unsupported head dimension %d for RoPE", hp->head_dim);
  const struct kvl_gguf_tensor *emb = kvl_gguf_find_tensor(g, "token_embd.weight");
  if (!emb) return kvl_errf(err, errlen, KVL_EFORMAT, "missing tensor 'token_embd.weight'");
  if (emb->n_dims != 2 || emb->ne[1] < 1 || emb->ne[1] > (1u << 24))
    return kvl_errf(err, errlen, KVL_EMISMATCH, "tensor 'token_embd.weight' is not a [n_embd, n_vocab] matrix");
  hp->n_vocab = (int)emb->ne[1];
  const int E = hp->n_embd, KV = hp->n_kv_head * hp->head_dim, F = hp->n_ff, V = hp->n_vocab;
  const float *dummy;
  if ((rc = get_tensor(g, "token_embd.weight", E, V, &m->tok_embd, &dummy, err, errlen)) ||
      (rc = get_tensor(g, "output_norm.weight", E, 0, NULL, &m->output_norm, err, errlen)))
    return rc;
  hp->tied_output = kvl_gguf_find_tensor(g, "output.weight") == NULL;
  if (hp->tied_output) m->output = m->tok_embd;
  else if ((rc = get_tensor(g, "output.weight", E, V, &m->output, &dummy, err, errlen))) return rc;

  m->layers = calloc((size_t)hp->n_layer, sizeof(*m->layers));
  if (!m->layers) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  for (int i = 0; i < hp->n_layer; i++) {
    struct kvl_layer *L = &m->layers[i];
    char n[20][64];
    const char *suffix[] = {"attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias",
                            "attn_v.weight", "attn_v.bias", "attn_output.weight", "ffn_norm.weight",
                            "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"};
    for (int j = 0; j < 12; j++) snprintf(n[j], sizeof(n[j]), "blk.%d.%s", i, suffix[j]);
    if ((rc = get_tensor(g, n[0], E, 0, NULL, &L->attn_norm, err, errlen)) ||
        (rc = get_tensor(g, n[1], E, E, &L->wq, NULL, err, errlen)) ||
        (rc = get_tensor(g, n[2], E, 0, NULL, &L->wq.bias, err, errlen)) ||
        (rc = get_tensor(g, n[3], E, KV, &L->wk, NULL, err, errlen)) ||
        (rc = get_tensor(g, n[4], KV, 0, NULL, &L->wk.bias, err, errlen)) ||
        (rc = get_tensor(g, n[5], E, KV, &L->wv, NULL, err, errlen)) ||
        (rc = get_tensor(g, n[6], KV, 0, NULL, &L->wv.bias, err, errlen)) ||
        (rc = get_tensor(g, n[7], E, E, &L->wo, NULL, err, errlen)) ||
        (rc = get_tensor(g, n[8], E, 0, NULL, &L->ffn_norm, err, errlen)) ||
        (rc = get_tensor(g, n[9], E, F, &L->w_gate, NULL, err, errlen)) ||
        (rc = get_tensor(g, n[10], E, F, &L->w_up, NULL, err, errlen)) ||
        (rc = get_tensor(g, n[11], F, E, &L->w_down, NULL, err, errlen)))
      return rc;
  }
  /* a slot per product weight for a backend's repacked copy (kvl_wpack), and one for the
   * embedding table (a device backend keeps its copy there: without one it would copy
   * the whole table in for every batch). A tied table shares the output head's slot:
   * one copy serves both, on a backend whose copy fits both uses (the CPU backend's embed
   * reads the GGUF rows and never its slot). */
  m->n_packs = 7 * hp->n_layer + 2;
  m->packs = calloc((size_t)m->n_packs, sizeof(*m->packs));
  if (!m->packs) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  for (int i = 0; i < hp->n_layer; i++) {
    struct kvl_layer *L = &m->layers[i];
    struct kvl_weight *ws[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
    for (int j = 0; j < 7; j++) ws[j]->pack = &m->packs[7 * i + j];
  }
  m->output.pack = &m->packs[7 * hp->n_layer];
  m->tok_embd.pack = hp->tied_output ? m->output.pack : &m->packs[7 * hp->n_layer + 1];
  return 0;
}

int kvl_model_from_gguf(kvl_gguf_t *g, const char *name, kvl_model_t **out, char *err, size_t errlen) {
  *out = NULL;
  if (err && errlen) err[0] = '\0';
  const char *arch;
  if (kvl_gguf_get_str(g, "general.architecture", &arch) < 0)
    return kvl_errf(err, errlen, KVL_EFORMAT, "missing metadata key 'general.architecture'");
  struct kvl_model *m = calloc(1, sizeof(*m));
  if (!m) return KVL_ENOMEM;
  pthread_mutex_init(&m->sinks.mu, NULL);
  pthread_mutex_init(&m->land.mu, NULL);
  m->gguf = g;
  snprintf(m->hp.arch, sizeof(m->hp.arch), "%s", arch);
  const char *gname;
  snprintf(m->hp.name, sizeof(m->hp.name), "%s", kvl_gguf_get_str(g, "general.name", &gname) == 0 ? gname : name ? name : "");
  int rc;
  if (!strcmp(arch, "qwen2")) {
    rc = load_qwen2(m, err, errlen);
  } else {
    rc = kvl_errf(err, errlen, KVL_ENOTSUP, "unsupported architecture '%s' (supported: qwen2)", arch);
  }
  if (rc < 0) {
    m->gguf = NULL; /* the caller keeps g on failure */
    kvl_model_free(m);
    return rc;
  }
  *out = m;
  return 0;
}

int kvl_model_open(const char *path, kvl_model_t **out, char *err, size_t errlen) {
  kvl_gguf_t *g;
  char e[256];
  const char *how = getenv("KVL_WEIGHTS");
  int rc = kvl_gguf_open_with(path, how && !strcmp(how, "mmap") ? KVL_GGUF_MMAP : KVL_GGUF_HUGEPAGES, &g, e,
                              sizeof(e));
  if (rc < 0) return kvl_errf(err, errlen, rc, "%s", e);
  rc = kvl_model_from_gguf(g, path, out, e, sizeof(e));
  if (rc < 0) {
    kvl_gguf_free(g);
    return kvl_errf(err, errlen, rc, "%s: %s", path, e);
  }
  return 0;
}

void kvl_model_free(kvl_model_t *m) {
  if (!m) return;
  for (int i = 0; i < m->n_packs; i++) kvl_wpack_release(&m->packs[i]);
  free(m->packs);
  free(m->layers);
  for (int i = 0; i < 16; i++) free(m->sinks.kv[i]);
  pthread_mutex_destroy(&m->sinks.mu);
  if (m->land.pinned_by) kvl_backend_host_unregister(m->land.pinned_by, m->land.p);
  if (m->land.p) kvl_huge_free(m->land.p, m->land.mapped);
  pthread_mutex_destroy(&m->land.mu);
  kvl_gguf_free(m->gguf);
  free(m);
}

const struct kvl_model_hparams *kvl_model_hparams(const kvl_model_t *m) { return &m->hp; }
const kvl_gguf_t *kvl_model_gguf(const kvl_model_t *m) { return m->gguf; }
const struct kvl_rope *kvl_model_rope(const kvl_model_t *m) { return &m->rope; }

size_t kvl_model_prepare(kvl_model_t *m, kvl_backend_t *be) {
  for (int i = 0; i < m->hp.n_layer; i++) {
    struct kvl_layer *L = &m->layers[i];
    const struct kvl_weight *ws[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
    for (int j = 0; j < 7; j++) kvl_backend_prepare(be, ws[j]);
  }
  kvl_backend_prepare(be, &m->output);
  size_t bytes = 0; /* this model's slots, not the process's counter: other models load and free meanwhile */
  for (int i = 0; i < m->n_packs; i++) bytes += m->packs[i].bytes;
  return bytes;
}

uint64_t kvl_model_sink_hits(const kvl_model_t *m) {
  pthread_mutex_lock((pthread_mutex_t *)&m->sinks.mu);
  uint64_t n = m->sinks.hits;
  pthread_mutex_unlock((pthread_mutex_t *)&m->sinks.mu);
  return n;
}

struct kvl_kv_layout kvl_model_kv_layout(const kvl_model_t *m, enum kvl_kv_dtype dtype) {
  return (struct kvl_kv_layout){m->hp.n_layer, m->hp.n_kv_head, m->hp.head_dim, dtype};
}

/* MODEL as given if it is a file, else the first *.gguf in the models directory whose
 * name starts with MODEL. Returns a malloc'd path or NULL. */
char *kvl_model_resolve(const char *m) {
  if (access(m, R_OK) == 0) return strdup(m);
  const char *dir = getenv("KVLINGO_MODELS");
  char def[4096];
  if (!dir || !*dir) {
    snprintf(def, sizeof(def), "%s/.cache/kvlingo/models", getenv("HOME") ? getenv("HOME") : ".");
    dir = def;
  }
  DIR *d = opendir(dir);
  if (!d) return NULL;
  struct dirent *e;
  char *found = NULL;
  size_t ml = strlen(m);
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l > 5 && !strcmp(e->d_name + l - 5, ".gguf") && !strncmp(e->d_name, m, ml) &&
        (!found || strcmp(e->d_name, strrchr(found, '/') + 1) < 0)) {
      free(found);
      size_t n = strlen(dir) + l + 2;
      found = malloc(n);
      snprintf(found, n, "%s/%s", dir, e->d_name);
    }
  }
  closedir(d);
  return found;
}


