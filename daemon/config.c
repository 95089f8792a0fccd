/* config.c — kvlingod's configuration: defaults, a YAML file (libyaml's document API),
 * environment overrides. Unknown keys and bad values are refused with the key's path. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <yaml.h>

#include "daemon.h"
#include "kvl_error.h"

void kvld_model_cfg_default(struct kvld_model_cfg *m) {
  memset(m, 0, sizeof(*m));
  snprintf(m->kv_dtype, sizeof(m->kv_dtype), "bf16");
  m->hot_bytes = 1024ll << 20;
  m->cold_bytes = 2048ll << 20;
  m->max_model_len = 8192;
  snprintf(m->backend, sizeof(m->backend), "cpu");
}

void kvld_config_defaults(struct kvld_config *c, const char *source_root) {
  memset(c, 0, sizeof(*c));
  snprintf(c->listen, sizeof(c->listen), "127.0.0.1");
  c->grpc_port = 50051;
  c->http_port = 8000;
  c->max_prompt_tokens = 8192;
  c->max_new_tokens = 4096;
  c->default_max_tokens = 256;
  c->max_concurrent = 256;
  c->default_deadline_s = 0;
  c->drain_s = 30;
  c->step_tokens = 512;
  snprintf(c->log_level, sizeof(c->log_level), "info");
  snprintf(c->spill_dir, sizeof(c->spill_dir), "%s/.cache/kvlingo/spill", getenv("HOME") ? getenv("HOME") : "/tmp");
  static const char *const pair[2][2] = {{"qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"},
                                         {"qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}};
  for (int i = 0; i < 2; i++) {
    kvld_model_cfg_default(&c->models[i]);
    snprintf(c->models[i].name, sizeof(c->models[i].name), "%s", pair[i][0]);
    snprintf(c->models[i].path, sizeof(c->models[i].path), "%s", pair[i][1]);
  }
  c->n_models = 2;
  snprintf(c->default_model, sizeof(c->default_model), "%s", pair[0][0]);
  if (gethostname(c->replica_id, sizeof(c->replica_id)) != 0 || !c->replica_id[0])
    snprintf(c->replica_id, sizeof(c->replica_id), "kvlingod");
  c->replica_id[sizeof(c->replica_id) - 1] = 0;
  c->conversation_ttl_s = 1800;
  snprintf(c->router.policy, sizeof(c->router.policy), "fixed");
  snprintf(c->router.small, sizeof(c->router.small), "%s", pair[0][0]);
  snprintf(c->router.large, sizeof(c->router.large), "%s", pair[1][0]);
  c->cache_snapshot = true;
  c->kv_prefault = true;
  c->translate_native_tail = 1;
  c->translate_native_head = 32;
  snprintf(c->translation_precision, sizeof(c->translation_precision), "auto");
  c->router.cascade_window = 8;
  c->router.handoff_native_tail = 1;
  c->router.cascade_max_mean_entropy = 2.0;
  c->router.cascade_min_logprob = 0;
  c->router.prefill_offload_min_tokens = 256;
  c->gate.max_heldout_kl = 1.5;
  c->gate.shadow_fraction = 0.02;
  c->gate.max_online_kl = 1.5;
  c->gate.min_shadows = 8;
  if (source_root) {
    static const char *const maps[] = {"qwen2.5-coder-0.5b-to-qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-to-qwen2.5-coder-0.5b"};
    for (int i = 0; i < 2; i++)
      snprintf(c->translators[c->n_translators++], sizeof(c->translators[0]), "%s/translator/maps/%s.distilled.safetensors",
               source_root, maps[i]);
  }
}

/* ---- YAML walking ------------------------------------------------------------------- */

struct walk {
  yaml_document_t *doc;
  char *err;
  size_t errlen;
  int rc;
};

static int bad(struct walk *w, const char *path, const char *what) {
  if (w->rc == 0) w->rc = kvl_errf(w->err, w->errlen, KVL_EINVAL, "%s: %s", path, what);
  return w->rc;
}

static const char *scalar(struct walk *w, yaml_node_t *n, const char *path) {
  if (!n || n->type != YAML_SCALAR_NODE) {
    bad(w, path, "expected a single value");
    return NULL;
  }
  return (const char *)n->data.scalar.value;
}

static void get_str(struct walk *w, yaml_node_t *n, const char *path, char *out, size_t len) {
  const char *s = scalar(w, n, path);
  if (!s) return;
  if (strlen(s) >= len) {
    bad(w, path, "too long");
    return;
  }
  snprintf(out, len, "%s", s);
}

static void get_int(struct walk *w, yaml_node_t *n, const char *path, long long lo, long long hi, long long *out) {
  const char *s = scalar(w, n, path);
  if (!s) return;
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  char msg[128];
  if (errno || *end || end == s) {
    snprintf(msg, sizeof(msg), "expected an integer, got '%.40s'", s);
    bad(w, path, msg);
  } else if (v < lo || v > hi) {
    snprintf(msg, sizeof(msg), "%lld is out of range [%lld, %lld]", v, lo, hi);
    bad(w, path, msg);
  } else
    *out = v;
}

static void get_bool(struct walk *w, yaml_node_t *n, const char *path, bool *out) {
  const char *v = scalar(w, n, path);
  if (v && (!strcmp(v, "true") || !strcmp(v, "false"))) *out = !strcmp(v, "true");
  else if (v) bad(w, path, "expected true or false");
}

static void get_double(struct walk *w, yaml_node_t *n, const char *path, double lo, double hi, double *out) {
  const char *s = scalar(w, n, path);
  if (!s) return;
  char *end;
  double v = strtod(s, &end);
  char msg[128];
  if (*end || end == s) {
    snprintf(msg, sizeof(msg), "expected a number, got '%.40s'", s);
    bad(w, path, msg);
  } else if (!(v >= lo && v <= hi)) {
    snprintf(msg, sizeof(msg), "%g is out of range [%g, %g]", v, lo, hi);
    bad(w, path, msg);
  } else
    *out = v;
}

#define INT_FIELD(key, lo, hi, dst)                                                                            \
  if (!strcmp(k, key)) {                                                                                       \
    long long v_ = (dst);                                                                                      \
    get_int(w, vn, path, lo, hi, &v_);                                                                         \
    (dst) = v_;                                                                                                \
    continue;                                                                                                  \
  }

/* A mapping of scalars under `base`: calls fn(w, key, value node, path, ctx) per key. */
typedef void (*walk_fn)(struct walk *w, const char *k, yaml_node_t *vn, const char *path, void *ctx);
static void walk_map(struct walk *w, yaml_node_t *n, const char *base, walk_fn fn, void *ctx) {
  if (n->type != YAML_MAPPING_NODE) {
    bad(w, base, "expected a mapping");
    return;
  }
  for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top && !w->rc; p++) {
    yaml_node_t *kn = yaml_document_get_node(w->doc, p->key), *vn = yaml_document_get_node(w->doc, p->value);
    const char *k = scalar(w, kn, base);
    if (!k) return;
    char path[256];
    snprintf(path, sizeof(path), "%s.%s", base, k);
    fn(w, k, vn, path, ctx);
  }
}

static void walk_model_key(struct walk *w, const char *k, yaml_node_t *vn, const char *path, void *ctx) {
  struct kvld_model_cfg *m = ctx;
  if (!strcmp(k, "name")) { get_str(w, vn, path, m->name, sizeof(m->name)); return; }
  if (!strcmp(k, "path")) { get_str(w, vn, path, m->path, sizeof(m->path)); return; }
  if (!strcmp(k, "kv_dtype")) {
    get_str(w, vn, path, m->kv_dtype, sizeof(m->kv_dtype));
    if (!w->rc && strcmp(m->kv_dtype, "bf16") && strcmp(m->kv_dtype, "f32")) bad(w, path, "expected bf16 or f32");
    return;
  }
  if (!strcmp(k, "hot_mib") || !strcmp(k, "cold_mib") || !strcmp(k, "disk_mib")) {
    long long mib = 0;
    get_int(w, vn, path, !strcmp(k, "hot_mib") ? 1 : 0, 1 << 24, &mib);
    *(!strcmp(k, "hot_mib") ? &m->hot_bytes : !strcmp(k, "cold_mib") ? &m->cold_bytes : &m->disk_bytes) = mib << 20;
    return;
  }
  if (!strcmp(k, "max_model_len")) {
    long long v = m->max_model_len;
    get_int(w, vn, path, 16, 1 << 24, &v);
    m->max_model_len = (int32_t)v;
    return;
  }
  if (!strcmp(k, "backend")) {
    get_str(w, vn, path, m->backend, sizeof(m->backend));
    if (!w->rc && strcmp(m->backend, "cpu") && strcmp(m->backend, "cuda") && strcmp(m->backend, "cuda-sim"))
      bad(w, path, "expected cpu, cuda or cuda-sim");
    return;
  }
  bad(w, path, "unknown key (name, path, kv_dtype, hot_mib, cold_mib, disk_mib, max_model_len, backend)");
}

static void walk_cascade(struct walk *w, const char *k, yaml_node_t *vn, const char *path, void *ctx) {
  struct kvld_config *c = ctx;
  long long v = c->router.cascade_window;
  if (!strcmp(k, "window")) { get_int(w, vn, path, 1, 4096, &v); c->router.cascade_window = (int)v; return; }
  if (!strcmp(k, "max_mean_entropy")) { get_double(w, vn, path, 0, 100, &c->router.cascade_max_mean_entropy); return; }
  if (!strcmp(k, "min_logprob")) { get_double(w, vn, path, -1000, 0, &c->router.cascade_min_logprob); return; }
  bad(w, path, "unknown key (window, max_mean_entropy, min_logprob)");
}

static void walk_offload(struct walk *w, const char *k, yaml_node_t *vn, const char *path, void *ctx) {
  struct kvld_config *c = ctx;
  long long v = c->router.prefill_offload_min_tokens;
  if (!strcmp(k, "min_prompt_tokens")) { get_int(w, vn, path, 2, 1 << 24, &v); c->router.prefill_offload_min_tokens = (int)v; return; }
  bad(w, path, "unknown key (min_prompt_tokens)");
}

static void walk_router(struct walk *w, const char *k, yaml_node_t *vn, const char *path, void *ctx) {
  struct kvld_config *c = ctx;
  if (!strcmp(k, "policy")) {
    get_str(w, vn, path, c->router.policy, sizeof(c->router.policy));
    static const char *const ok[] = {"fixed", "cascade", "prefill-offload", "pinned"};
    bool found = false;
    for (int i = 0; i < 4; i++) found |= !strcmp(c->router.policy, ok[i]);
    if (!w->rc && !found) bad(w, path, "expected fixed, cascade, prefill-offload or pinned");
    return;
  }
  if (!strcmp(k, "small")) { get_str(w, vn, path, c->router.small, sizeof(c->router.small)); return; }
  if (!strcmp(k, "large")) { get_str(w, vn, path, c->router.large, sizeof(c->router.large)); return; }
  if (!strcmp(k, "cascade")) { walk_map(w, vn, path, walk_cascade, c); return; }
  if (!strcmp(k, "prefill_offload")) { walk_map(w, vn, path, walk_offload, c); return; }
  if (!strcmp(k, "handoff_native_tail")) {
    long long v = c->router.handoff_native_tail;
    get_int(w, vn, path, 1, 4096, &v);
    c->router.handoff_native_tail = (int)v;
    return;
  }
  bad(w, path, "unknown key (policy, small, large, cascade, prefill_offload, handoff_native_tail)");
}

static void walk_gate(struct walk *w, const char *k, yaml_node_t *vn, const char *path, void *ctx) {
  struct kvld_config *c = ctx;
  if (!strcmp(k, "max_heldout_kl")) { get_double(w, vn, path, 0, 1e6, &c->gate.max_heldout_kl); return; }
  if (!strcmp(k, "shadow_fraction")) { get_double(w, vn, path, 0, 1, &c->gate.shadow_fraction); return; }
  if (!strcmp(k, "max_online_kl")) { get_double(w, vn, path, 0, 1e6, &c->gate.max_online_kl); return; }
  long long v = c->gate.min_shadows;
  if (!strcmp(k, "min_shadows")) { get_int(w, vn, path, 1, 1 << 20, &v); c->gate.min_shadows = (int)v; return; }
  bad(w, path, "unknown key (max_heldout_kl, shadow_fraction, max_online_kl, min_shadows)");
}

static void walk_root(struct walk *w, yaml_node_t *n, struct kvld_config *c) {
  if (n->type != YAML_MAPPING_NODE) {
    bad(w, "(top level)", "expected a mapping of keys");
    return;
  }
  bool set_models = false, set_translators = false, set_default = false;
  for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
    yaml_node_t *kn = yaml_document_get_node(w->doc, p->key);
    if (kn && kn->type == YAML_SCALAR_NODE) {
      const char *k = (const char *)kn->data.scalar.value;
      set_models |= !strcmp(k, "models");
      set_translators |= !strcmp(k, "translators");
      set_default |= !strcmp(k, "default_model");
    }
  }
  /* models of one's own: the default pair's translators and default model go with it */
  if (set_models && !set_translators) c->n_translators = 0;
  for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top && !w->rc; p++) {
    yaml_node_t *kn = yaml_document_get_node(w->doc, p->key), *vn = yaml_document_get_node(w->doc, p->value);
    const char *k = scalar(w, kn, "(top level)");
    if (!k) return;
    const char *path = k;
    if (!strcmp(k, "listen")) { get_str(w, vn, path, c->listen, sizeof(c->listen)); continue; }
    if (!strcmp(k, "auth_token")) { get_str(w, vn, path, c->auth_token, sizeof(c->auth_token)); continue; }
    if (!strcmp(k, "admin_token")) { get_str(w, vn, path, c->admin_token, sizeof(c->admin_token)); continue; }
    if (!strcmp(k, "tls_cert")) { get_str(w, vn, path, c->tls_cert, sizeof(c->tls_cert)); continue; }
    if (!strcmp(k, "tls_key")) { get_str(w, vn, path, c->tls_key, sizeof(c->tls_key)); continue; }
    if (!strcmp(k, "log_level")) { get_str(w, vn, path, c->log_level, sizeof(c->log_level)); continue; }
    if (!strcmp(k, "default_model")) { get_str(w, vn, path, c->default_model, sizeof(c->default_model)); continue; }
    if (!strcmp(k, "spill_dir")) { get_str(w, vn, path, c->spill_dir, sizeof(c->spill_dir)); continue; }
    if (!strcmp(k, "cache_snapshot")) { get_bool(w, vn, path, &c->cache_snapshot); continue; }
    if (!strcmp(k, "kv_prefault")) { get_bool(w, vn, path, &c->kv_prefault); continue; }
    if (!strcmp(k, "translate_warm_head")) { get_bool(w, vn, path, &c->translate_warm_head); continue; }
    if (!strcmp(k, "translation_precision")) {
      get_str(w, vn, path, c->translation_precision, sizeof(c->translation_precision));
      if (!w->rc && strcmp(c->translation_precision, "auto") && strcmp(c->translation_precision, "bf16") &&
          strcmp(c->translation_precision, "fp32"))
        bad(w, path, "expected auto, bf16 or fp32");
      continue;
    }
    if (!strcmp(k, "replica_id")) { get_str(w, vn, path, c->replica_id, sizeof(c->replica_id)); continue; }
    if (!strcmp(k, "conversation_ttl_s")) { get_double(w, vn, path, 1, 1e7, &c->conversation_ttl_s); continue; }
    if (!strcmp(k, "router")) { walk_map(w, vn, path, walk_router, c); continue; }
    if (!strcmp(k, "quality_gate")) { walk_map(w, vn, path, walk_gate, c); continue; }
    INT_FIELD("grpc_port", 0, 65535, c->grpc_port)
    INT_FIELD("http_port", -1, 65535, c->http_port)
    INT_FIELD("max_prompt_tokens", 1, 1 << 24, c->max_prompt_tokens)
    INT_FIELD("max_new_tokens", 1, 1 << 24, c->max_new_tokens)
    INT_FIELD("default_max_tokens", 1, 1 << 24, c->default_max_tokens)
    INT_FIELD("max_concurrent", 1, 1 << 20, c->max_concurrent)
    INT_FIELD("step_tokens", 16, 1 << 16, c->step_tokens)
    INT_FIELD("translate_native_tail", 1, 4096, c->translate_native_tail)
    INT_FIELD("translate_native_head", 0, 4096, c->translate_native_head)
    if (!strcmp(k, "default_deadline_s")) { get_double(w, vn, path, 0, 1e6, &c->default_deadline_s); continue; }
    if (!strcmp(k, "drain_s")) { get_double(w, vn, path, 0, 3600, &c->drain_s); continue; }
    if (!strcmp(k, "models")) {
      if (vn->type != YAML_SEQUENCE_NODE) {
        bad(w, path, "expected a list of models");
        continue;
      }
      c->n_models = 0;
      for (yaml_node_item_t *it = vn->data.sequence.items.start; it < vn->data.sequence.items.top && !w->rc; it++) {
        char mp[64];
        snprintf(mp, sizeof(mp), "models[%d]", c->n_models);
        if (c->n_models == KVLD_MAX_MODELS) {
          bad(w, mp, "too many models");
          break;
        }
        struct kvld_model_cfg *m = &c->models[c->n_models++];
        kvld_model_cfg_default(m);
        walk_map(w, yaml_document_get_node(w->doc, *it), mp, walk_model_key, m);
      }
      continue;
    }
    if (!strcmp(k, "translators")) {
      if (vn->type != YAML_SEQUENCE_NODE) {
        bad(w, path, "expected a list of translator files");
        continue;
      }
      c->n_translators = 0;
      for (yaml_node_item_t *it = vn->data.sequence.items.start; it < vn->data.sequence.items.top && !w->rc; it++) {
        char tp[64];
        snprintf(tp, sizeof(tp), "translators[%d]", c->n_translators);
        if (c->n_translators == KVLD_MAX_TRANSLATORS) {
          bad(w, tp, "too many translators");
          break;
        }
        get_str(w, yaml_document_get_node(w->doc, *it), tp, c->translators[c->n_translators],
                sizeof(c->translators[0]));
        c->n_translators++;
      }
      continue;
    }
    bad(w, path, "unknown key");
  }
  if (set_models && !set_default && c->n_models > 0)
    snprintf(c->default_model, sizeof(c->default_model), "%s", c->models[0].name);
  if (set_models) kvld_config_settle_router(c);
}

void kvld_config_settle_router(struct kvld_config *c) {
  /* the router's defaults follow models of one's own: the first is small, the last large */
  if (c->n_models > 0) {
    bool small = false, large = false;
    for (int i = 0; i < c->n_models; i++) {
      small |= !strcmp(c->models[i].name, c->router.small);
      large |= !strcmp(c->models[i].name, c->router.large);
    }
    if (!small) snprintf(c->router.small, sizeof(c->router.small), "%s", c->models[0].name);
    if (!large) snprintf(c->router.large, sizeof(c->router.large), "%s", c->models[c->n_models - 1].name);
  }
}

int kvld_config_load_mem(struct kvld_config *c, const void *data, size_t len, const char *name, char *err,
                         size_t errlen) {
  yaml_parser_t ps;
  yaml_document_t doc;
  if (!yaml_parser_initialize(&ps)) return kvl_errf(err, errlen, KVL_ENOMEM, "config %s: out of memory", name);
  yaml_parser_set_input_string(&ps, data, len);
  int rc = 0;
  if (!yaml_parser_load(&ps, &doc)) {
    rc = kvl_errf(err, errlen, KVL_EFORMAT, "config %s:%zu:%zu: %s", name, ps.problem_mark.line + 1,
                  ps.problem_mark.column + 1, ps.problem ? ps.problem : "YAML syntax error");
  } else {
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (root) {
      struct walk w = {&doc, err, errlen, 0};
      char inner[400];
      w.err = inner;
      w.errlen = sizeof(inner);
      walk_root(&w, root, c);
      if (w.rc) rc = kvl_errf(err, errlen, w.rc, "config %s: %s", name, inner);
    }
    yaml_document_delete(&doc);
  }
  yaml_parser_delete(&ps);
  return rc;
}

int kvld_config_load(struct kvld_config *c, const char *path, char *err, size_t errlen) {
  FILE *f = fopen(path, "rb");
  if (!f) return kvl_errf(err, errlen, KVL_ENOENT, "config %s: %s", path, strerror(errno));
  /* a configuration is a few kilobytes; 1 MiB is far more than any */
  enum { MAX = 1 << 20 };
  char *buf = malloc(MAX + 1);
  if (!buf) {
    fclose(f);
    return kvl_errf(err, errlen, KVL_ENOMEM, "config %s: out of memory", path);
  }
  size_t n = fread(buf, 1, MAX + 1, f);
  int rd = ferror(f);
  fclose(f);
  int rc;
  if (rd) rc = kvl_errf(err, errlen, KVL_EIO, "config %s: read error", path);
  else if (n > MAX) rc = kvl_errf(err, errlen, KVL_EFORMAT, "config %s: larger than 1 MiB", path);
  else rc = kvld_config_load_mem(c, buf, n, path, err, errlen);
  free(buf);
  return rc;
}

static int env_int(const char *name, int lo, int hi, int *out, char *err, size_t errlen) {
  const char *v = getenv(name);
  if (!v || !*v) return 0;
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || x < lo || x > hi) return kvl_errf(err, errlen, KVL_EINVAL, "%s=%s: expected an integer in [%d, %d]", name, v, lo, hi);
  *out = (int)x;
  return 0;
}

static void env_str(const char *name, char *out, size_t len) {
  const char *v = getenv(name);
  if (v && *v) snprintf(out, len, "%s", v);
}

int kvld_config_env(struct kvld_config *c, char *err, size_t errlen) {
  int rc = env_int("KVLINGO_GRPC_PORT", 0, 65535, &c->grpc_port, err, errlen);
  if (rc == 0) rc = env_int("KVLINGO_HTTP_PORT", -1, 65535, &c->http_port, err, errlen);
  env_str("KVLINGO_AUTH_TOKEN", c->auth_token, sizeof(c->auth_token));
  env_str("KVLINGO_ADMIN_TOKEN", c->admin_token, sizeof(c->admin_token));
  env_str("KVLINGO_LOG_LEVEL", c->log_level, sizeof(c->log_level));
  env_str("KVLINGO_LISTEN", c->listen, sizeof(c->listen));
  env_str("KVLINGO_REPLICA_ID", c->replica_id, sizeof(c->replica_id));
  return rc;
}

int kvld_config_check(const struct kvld_config *c, char *err, size_t errlen) {
  static const char *const levels[] = {"debug", "info", "warn", "error"};
  bool lv = false;
  for (int i = 0; i < 4; i++) lv |= !strcmp(c->log_level, levels[i]);
  if (!lv) return kvl_errf(err, errlen, KVL_EINVAL, "log_level: '%s' is not debug, info, warn or error", c->log_level);
  if (c->n_models == 0) return kvl_errf(err, errlen, KVL_EINVAL, "models: at least one model is needed");
  for (int i = 0; i < c->n_models; i++) {
    if (!c->models[i].name[0] || !c->models[i].path[0])
      return kvl_errf(err, errlen, KVL_EINVAL, "models[%d]: name and path are required", i);
    for (int j = 0; j < i; j++)
      if (!strcmp(c->models[i].name, c->models[j].name))
        return kvl_errf(err, errlen, KVL_EINVAL, "models[%d].name: '%s' is used twice", i, c->models[i].name);
  }
  bool dm = false;
  for (int i = 0; i < c->n_models; i++) dm |= !strcmp(c->models[i].name, c->default_model);
  if (!dm) return kvl_errf(err, errlen, KVL_EINVAL, "default_model: '%s' is not one of the models", c->default_model);
  if (strcmp(c->router.policy, "fixed")) {
    bool small = false, large = false;
    for (int i = 0; i < c->n_models; i++) {
      small |= !strcmp(c->models[i].name, c->router.small);
      large |= !strcmp(c->models[i].name, c->router.large);
    }
    if (!small || !large || !strcmp(c->router.small, c->router.large))
      return kvl_errf(err, errlen, KVL_EINVAL, "router: policy %s needs two different models as small ('%s') and large ('%s')",
                      c->router.policy, c->router.small, c->router.large);
  }
  if (!c->replica_id[0]) return kvl_errf(err, errlen, KVL_EINVAL, "replica_id: empty");
  if (!!c->tls_cert[0] != !!c->tls_key[0])
    return kvl_errf(err, errlen, KVL_EINVAL, "tls_cert and tls_key go together");
  if (c->default_max_tokens > c->max_new_tokens)
    return kvl_errf(err, errlen, KVL_EINVAL, "default_max_tokens %d is over max_new_tokens %d", c->default_max_tokens,
                    c->max_new_tokens);
  return 0;
}
