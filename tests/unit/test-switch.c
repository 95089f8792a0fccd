/* test-switch.c — the multi-turn protocol on tiny models (DESIGN.md "Translation").
 *
 * Two resident models share one tokenizer; a conversation alternates between them. At
 * every switch the spans translated into the incoming model's line must be exactly those
 * derived here, independently, from the transcript (which model wrote which position
 * natively, which positions each model's line already holds): never a translated
 * position as a source, the last prompt position always native, the new user turn
 * prefilled. With identity translators between a model and a copy of itself, the
 * alternating conversation must produce the single-model conversation token for token
 * (reference backend, fp32 KV). Also: stateless switching through the prefix indexes,
 * cascade and prefill handoffs, the untranslatable / declined accounting, and a random
 * stress of switches, edits, preemption and conversation shedding under the pool checker.
 */
#include "../kvl_test.h"
#include "../tiny_fingerprint.h"
#include "../tiny_model.h"
#include "kvl_error.h"
#include "kvl_sched.h"
#include "kvl_translator.h"

enum { MAXT = 1024, MAXGEN = 64 };

static kvl_model_t *g_m, *g_m2; /* g_m2: other weights, same layout */
static void *g_buf, *g_buf2;
static kvl_translator_t *g_id;   /* identity: layer l reads layer l */

struct run {
  int32_t toks[MAXGEN];
  int models[MAXGEN];
  int n;
  bool done;
  enum kvl_finish_reason why;
  struct kvl_usage usage;
};

static void on_token(void *ud, uint64_t id, const struct kvl_token_event *ev) {
  (void)id;
  struct run *o = ud;
  if (ev->token >= 0 && o->n < MAXGEN) { o->models[o->n] = ev->model; o->toks[o->n++] = ev->token; }
  if (ev->final) { o->done = true; o->why = ev->finish; o->usage = ev->usage; }
}

/* A scheduler with `n` models (model i = ms[i]), fp32 KV, `hot` blocks each. */
static kvl_sched_t *sched_of(kvl_model_t **ms, int n, int hot, int cold, int step_tokens) {
  kvl_sched_t *s;
  KVL_ASSERT(kvl_sched_new(&(struct kvl_sched_config){.step_tokens = step_tokens, .max_seqs = 16}, &s) == 0);
  for (int i = 0; i < n; i++) {
    struct kvl_kv_layout kl = kvl_model_kv_layout(ms[i], KVL_KV_F32);
    size_t bb = kvl_kv_block_bytes(&kl);
    static const char *const names[] = {"m0", "m1", "m2", "m3"}; /* the scheduler keeps the pointer */
    struct kvl_sched_model sm = {names[i], ms[i], kvl_backend_ref(), {kl, (size_t)hot * bb, (size_t)cold * bb, 0, NULL, 0, false}, 0};
    int mid;
    char err[256];
    KVL_ASSERT(kvl_sched_add_model(s, &sm, &mid, err, sizeof(err)) == 0 && mid == i);
  }
  return s;
}

static void link_all(kvl_sched_t *s, int n) {
  char err[256];
  for (int a = 0; a < n; a++)
    for (int b = 0; b < n; b++)
      if (a != b) KVL_ASSERT(kvl_sched_add_translator(s, a, b, g_id, NULL, err, sizeof(err)) == 0);
}

static void check_pools(kvl_sched_t *s, int n) {
  char err[512];
  for (int i = 0; i < n; i++) {
    int rc = kvl_pool_check(kvl_sched_pool(s, i), err, sizeof(err));
    if (rc) fprintf(stderr, "pool %d: %s\n", i, err);
    CHECK_EQ_INT(rc, 0);
  }
}

static int run_one(kvl_sched_t *s, struct kvl_request *r, struct run *o, int n_models) {
  memset(o, 0, sizeof(*o));
  uint64_t id;
  char err[256];
  int rc = kvl_sched_submit(s, r, on_token, o, &id, err, sizeof(err));
  if (rc) { fprintf(stderr, "submit: %s\n", err); return rc; }
  while (!kvl_sched_idle(s)) {
    rc = kvl_sched_step(s);
    if (rc < 0) return rc;
    check_pools(s, n_models);
  }
  return o->done ? 0 : KVL_EINVAL;
}

static struct kvl_request greedy(int model, const int32_t *p, int32_t n, int32_t max_tokens, uint64_t conv) {
  struct kvl_request r = {.model = model, .prompt = p, .n_prompt = n, .max_tokens = max_tokens, .conversation = conv,
                          .reuse = KVL_REUSE_ANY};
  kvl_sampler_params_init(&r.sampling);
  r.sampling.temperature = 0;
  return r;
}

/* r escalates to model `to` once the mean entropy of `window` generated tokens passes `bar` */
static void cascade(struct kvl_request *r, int to, int32_t window, float bar) {
  r->cascade.on = true;
  r->cascade.to = to;
  r->cascade.window = window;
  r->cascade.max_mean_entropy = bar;
}

static void user_turn(int32_t *seq, int32_t *n, unsigned long long *rs) {
  int32_t len = 5 + (int32_t)(kvl_test_rand(rs) % 26);
  for (int32_t i = 0; i < len; i++) seq[(*n)++] = (int32_t)(kvl_test_rand(rs) % 300);
}

/* The transcript's bookkeeping, kept by the test alone. */
struct book {
  int32_t have[2];                 /* positions each model's line holds */
  bool native[2][MAXT];            /* ... of which written natively by that model */
};

/* Ten turns alternating a, b, a, ... in one conversation. Returns the conversation's
 * generated tokens per turn in out[turn]. With check set, verify each turn's spans. Every
 * request computes its first `head` positions natively (kvl_request.native_head). */
static void conversation(kvl_model_t *ma, kvl_model_t *mb, bool alternate, bool stateless, int32_t head,
                         struct run out[10], int32_t *seq_out, int32_t *n_out, bool check) {
  kvl_model_t *ms[2] = {ma, mb};
  kvl_sched_t *s = sched_of(ms, 2, 128, 0, 64);
  link_all(s, 2);
  int32_t seq[MAXT], n = 0;
  unsigned long long rs = 77;
  struct book bk = {{0, 0}, {{0}}};
  int total_translated = 0;
  for (int t = 0; t < 10; t++) {
    user_turn(seq, &n, &rs);
    int M = alternate ? t % 2 : 0, S = 1 - M;
    struct kvl_request r = greedy(M, seq, n, 6 + t % 3, stateless ? 0 : 42);
    r.native_head = head;
    CHECK_EQ_INT(run_one(s, &r, &out[t], 2), 0);
    /* the expected plan, from the transcript */
    int32_t exp_tr = 0, exp_pf = 0, from = bk.have[M];
    bool exp_native[MAXT];
    for (int32_t p = from; p < n - 1; p++) {
      bool src = p >= head && p < bk.have[S] && bk.native[S][p];
      exp_native[p] = !src;
      if (src) exp_tr++;
      else exp_pf++;
    }
    exp_native[n - 1] = true;
    exp_pf++;
    if (check) {
      CHECK_EQ_INT(out[t].usage.translated, exp_tr);
      CHECK_EQ_INT(out[t].usage.prefilled, exp_pf);
      CHECK_EQ_INT(out[t].usage.cached_native + out[t].usage.cached_translated, from);
      CHECK_EQ_INT(out[t].usage.untranslatable + out[t].usage.declined, 0);
      const kvl_line_t *l = kvl_sched_conversation_line(s, 42, M);
      CHECK(l != NULL);
      int32_t L = n + out[t].n - 1; /* the last sampled token has no KV */
      CHECK_EQ_INT(kvl_line_len(l), L);
      int wrong = 0;
      for (int32_t p = from; p < L; p++) {
        bool nat = p < n ? exp_native[p] : true;
        wrong += (kvl_line_writer(l, p) == KVL_WRITER_NATIVE) != nat;
      }
      CHECK_EQ_INT(wrong, 0);
      for (int32_t p = from; p < L; p++) bk.native[M][p] = p < n ? exp_native[p] : true;
      bk.have[M] = L;
      if (t > 0 && alternate && head == 0) CHECK(exp_tr > 0); /* every switch translated something */
    }
    total_translated += out[t].usage.translated;
    for (int i = 0; i < out[t].n; i++) seq[n++] = out[t].toks[i];
  }
  if (alternate) CHECK(total_translated > 0);
  if (seq_out) { memcpy(seq_out, seq, (size_t)n * sizeof(int32_t)); *n_out = n; }
  kvl_sched_free(s);
}

static void test_spans_from_transcript(void) {
  struct run single[10], alt[10], other[10];
  int32_t seq1[MAXT], seq2[MAXT], n1, n2;
  conversation(g_m, g_m, false, false, 0, single, seq1, &n1, false);
  conversation(g_m, g_m, true, false, 0, alt, seq2, &n2, true);
  CHECK_EQ_INT(n1, n2);
  int differ = memcmp(seq1, seq2, (size_t)n1 * sizeof(int32_t)) != 0;
  printf("  10 turns alternating a copy of the model through identity translators: %d tokens, %s the single-model run\n",
         n1, differ ? "DIFFERS from" : "equal to");
  CHECK_EQ_INT(differ, 0);
  /* ... with a native head of 16: each switch computes the head in the same forward as the
   * prefill after the translated span; still the single-model run token for token */
  struct run alt16[10];
  int32_t seq3[MAXT], n3;
  conversation(g_m, g_m, true, false, 16, alt16, seq3, &n3, true);
  CHECK(n3 == n1 && memcmp(seq1, seq3, (size_t)n1 * sizeof(int32_t)) == 0);
  /* two different models: the spans still follow the transcript */
  conversation(g_m, g_m2, true, false, 0, other, NULL, NULL, true);
  int tr = 0;
  for (int t = 0; t < 10; t++) tr += other[t].usage.translated;
  printf("  10 turns alternating two different models: %d positions translated, spans as derived\n", tr);
  /* ... with the first 16 positions always native (the daemon's default native head) */
  conversation(g_m, g_m2, true, false, 16, other, NULL, NULL, true);
  int tr16 = 0;
  for (int t = 0; t < 10; t++) tr16 += other[t].usage.translated;
  printf("  ... with a native head of 16: %d positions translated, spans as derived\n", tr16);
  CHECK(tr16 > 0 && tr16 < tr);
}

static void test_stateless(void) {
  struct run single[10], alt[10];
  int32_t seq1[MAXT], seq2[MAXT], n1, n2;
  conversation(g_m, g_m, false, true, 0, single, seq1, &n1, false);
  conversation(g_m, g_m, true, true, 0, alt, seq2, &n2, false);
  int tr = 0, switches_translated = 0;
  for (int t = 1; t < 10; t++) {
    tr += alt[t].usage.translated;
    switches_translated += alt[t].usage.translated > 0;
  }
  /* only full blocks are indexed: a switch right after a short first turn finds nothing */
  CHECK(switches_translated >= 7);
  CHECK_EQ_INT(n1, n2);
  CHECK(memcmp(seq1, seq2, (size_t)n1 * sizeof(int32_t)) == 0);
  printf("  stateless (history resent, prefix indexes): %d positions translated, output equal to the single-model run\n", tr);
}

/* A cascade from model 0 to model 1 (two copies, identity translators) after 3 tokens,
 * with the given native tail and head: the answer equals `ref` token for token; returns
 * the positions model 1 translated. */
static int32_t cascade_run(kvl_model_t **ms, const int32_t *p, const struct run *ref, int32_t tail, int32_t head) {
  kvl_sched_t *s = sched_of(ms, 2, 64, 0, 64);
  link_all(s, 2);
  struct kvl_request r = greedy(0, p, 40, 12, 0);
  cascade(&r, 1, 3, 1e-3f);
  r.native_tail = tail;
  r.native_head = head;
  struct run o;
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
  CHECK_EQ_INT(o.usage.handoffs, 1);
  CHECK(o.n == ref->n && memcmp(o.toks, ref->toks, sizeof(int32_t) * (size_t)o.n) == 0);
  CHECK_EQ_INT(o.usage.untranslatable + o.usage.declined, 0);
  kvl_sched_free(s);
  return o.usage.translated;
}

static void test_handoffs(void) {
  kvl_model_t *ms[2] = {g_m, g_m};
  int32_t p[40];
  unsigned long long rs = 5;
  for (int i = 0; i < 40; i++) p[i] = (int32_t)(kvl_test_rand(&rs) % 300);
  struct run ref, o;
  kvl_sched_t *s = sched_of(ms, 2, 64, 0, 64);
  link_all(s, 2);
  struct kvl_request r = greedy(0, p, 40, 12, 0);
  CHECK_EQ_INT(run_one(s, &r, &ref, 2), 0);
  kvl_sched_free(s);

  /* cascade: the bar is passed after the 3rd token; the rest comes from model 1 */
  s = sched_of(ms, 2, 64, 0, 64);
  link_all(s, 2);
  r = greedy(0, p, 40, 12, 0);
  cascade(&r, 1, 3, 1e-3f); /* any real distribution passes the bar */
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
  CHECK_EQ_INT(o.usage.handoffs, 1);
  CHECK_EQ_INT(o.n, ref.n);
  CHECK(memcmp(o.toks, ref.toks, sizeof(int32_t) * (size_t)o.n) == 0);
  CHECK(o.models[0] == 0 && o.models[2] == 0 && o.models[3] == 1 && o.models[o.n - 1] == 1);
  /* model 1 translated the prompt and the two generated tokens model 0 fed back */
  CHECK_EQ_INT(o.usage.translated, 40 + 2);
  printf("  cascade after 3 tokens: %d tokens equal to model 0 alone, %d positions translated\n", o.n, o.usage.translated);
  kvl_sched_free(s);

  /* a native tail of 8: model 1 translates all but the last 8 positions and computes
   * those itself (the tokens are the same: identity translators between copies) */
  CHECK_EQ_INT(cascade_run(ms, p, &ref, 8, 0), 40 + 3 - 8);
  /* ... and a native head of 16 (the attention sink's block): model 1 computes positions
   * 0..15 in the same forward as the tail and translates what lies between */
  int32_t tr = cascade_run(ms, p, &ref, 8, 16);
  CHECK_EQ_INT(tr, 40 + 3 - 8 - 16);
  printf("  cascade with a native head of 16 and tail of 8: %d positions translated\n", tr);
  /* a head that covers the whole sequence: nothing is translated */
  CHECK_EQ_INT(cascade_run(ms, p, &ref, 1, 64), 0);

  /* a bar the distribution never passes: no handoff, every token from model 0 */
  s = sched_of(ms, 2, 64, 0, 64);
  link_all(s, 2);
  r = greedy(0, p, 40, 12, 0);
  cascade(&r, 1, 3, 1e6f);
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
  CHECK_EQ_INT(o.usage.handoffs, 0);
  CHECK_EQ_INT(o.usage.translated, 0);
  CHECK(o.n == ref.n && o.models[o.n - 1] == 0);
  kvl_sched_free(s);

  /* prefill_on: model 0 prefills, model 1 translates and decodes */
  s = sched_of(ms, 2, 64, 0, 16);
  link_all(s, 2);
  r = greedy(1, p, 40, 12, 0);
  r.prefill_on.on = true;
  r.prefill_on.model = 0;
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
  CHECK_EQ_INT(o.usage.handoffs, 1);
  CHECK_EQ_INT(o.usage.translated, 39);
  CHECK_EQ_INT(o.usage.prefilled, 40);
  CHECK(memcmp(o.toks, ref.toks, sizeof(int32_t) * (size_t)o.n) == 0);
  CHECK(o.models[0] == 1);
  kvl_sched_free(s);
  s = sched_of(ms, 2, 64, 0, 16); /* ... with a native tail of 8 */
  link_all(s, 2);
  r = greedy(1, p, 40, 12, 0);
  r.prefill_on.on = true;
  r.prefill_on.model = 0;
  r.native_tail = 8;
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
  CHECK_EQ_INT(o.usage.translated, 32);
  CHECK(memcmp(o.toks, ref.toks, sizeof(int32_t) * (size_t)o.n) == 0);
  kvl_sched_free(s);
  s = sched_of(ms, 2, 64, 0, 16); /* ... and a native head of 16: model 1 prefills 0..15 */
  link_all(s, 2);
  r = greedy(1, p, 40, 12, 0);
  r.prefill_on.on = true;
  r.prefill_on.model = 0;
  r.native_tail = 8;
  r.native_head = 16;
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
  CHECK_EQ_INT(o.usage.translated, 16);
  CHECK_EQ_INT(o.usage.prefilled, 39 + 16 + 8);
  CHECK(memcmp(o.toks, ref.toks, sizeof(int32_t) * (size_t)o.n) == 0);
  kvl_sched_free(s);

  /* refusals: a handoff target that is not there */
  s = sched_of(ms, 2, 64, 0, 64);
  r = greedy(0, p, 40, 12, 0);
  cascade(&r, 5, 2, 0);
  uint64_t id;
  char err[256];
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, &o, &id, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "cascade");
  r.cascade.to = 1;
  r.cascade.window = 0;
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, &o, &id, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "window");
  kvl_sched_free(s);
}

/* Without a translator the other model's span is prefilled and counted; a request that
 * declines translation (the quality gate's fallback) likewise. */
static void test_fallbacks(void) {
  kvl_model_t *ms[2] = {g_m, g_m};
  int32_t p[200];
  unsigned long long rs = 9;
  for (int i = 0; i < 200; i++) p[i] = (int32_t)(kvl_test_rand(&rs) % 300);
  for (int pass = 0; pass < 2; pass++) {
    kvl_sched_t *s = sched_of(ms, 2, 64, 0, 64);
    if (pass == 1) link_all(s, 2);
    struct run o, o2;
    struct kvl_request r = greedy(0, p, 100, 4, 9);
    CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
    int32_t n = 100;
    int32_t q[200];
    memcpy(q, p, sizeof(q));
    for (int i = 0; i < o.n; i++) q[n++] = o.toks[i];
    n += 10; /* a user turn */
    r = greedy(1, q, n, 4, 9);
    r.no_translate = pass == 1;
    CHECK_EQ_INT(run_one(s, &r, &o2, 2), 0);
    int32_t held = 100 + o.n - 1; /* what model 0 holds natively */
    CHECK_EQ_INT(o2.usage.translated, 0);
    CHECK_EQ_INT(pass == 0 ? o2.usage.untranslatable : o2.usage.declined, held);
    CHECK_EQ_INT(o2.usage.prefilled, n);
    kvl_sched_free(s);
  }
}

/* The quality gate: shadows re-prefill translated requests natively and measure the KL
 * of the next-token distributions; identity between copies of one model measures ~0 and
 * stays open, identity between two different models measures a lot and closes the gate,
 * after which requests prefill instead (declined). `off` declines from the start. */
static void test_gate(void) {
  int32_t p[64];
  unsigned long long rs = 31;
  for (int i = 0; i < 64; i++) p[i] = (int32_t)(kvl_test_rand(&rs) % 300);
  for (int pass = 0; pass < 3; pass++) {
    kvl_model_t *ms[2] = {g_m, pass == 1 ? g_m2 : g_m};
    kvl_sched_t *s = sched_of(ms, 2, 64, 0, 64);
    struct kvl_translator_gate gate = {.off = pass == 2, .shadow_fraction = 1, .max_kl = 0.05, .min_shadows = 2};
    char err[256];
    CHECK_EQ_INT(kvl_sched_add_translator(s, 0, 1, g_id, &gate, err, sizeof(err)), 0);
    int declined_turns = 0;
    for (int t = 0; t < 4; t++) {
      struct run o;
      p[0] = t; /* a different conversation each time */
      struct kvl_request r = greedy(0, p, 40, 2, 0);
      CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
      r = greedy(1, p, 60, 2, 0);
      CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
      declined_turns += o.usage.declined > 0;
      CHECK(o.usage.translated > 0 || o.usage.declined > 0);
    }
    struct kvl_translator_stats st;
    kvl_sched_translator_stats(s, 0, 1, &st);
    printf("  gate %s: %llu shadows, online KL %.3g, %s, %d of 4 requests declined\n",
           pass == 0 ? "copy of the model" : pass == 1 ? "different models" : "off", (unsigned long long)st.shadows,
           st.kl_mean, st.gated ? "closed" : "open", declined_turns);
    if (pass == 0) CHECK(!st.gated && st.shadows == 4 && st.kl_mean < 1e-6 && declined_turns == 0);
    if (pass == 1) CHECK(st.gated && st.shadows == 2 && st.kl_mean > 0.05 && declined_turns == 2);
    if (pass == 2) CHECK(st.gated && st.shadows == 0 && declined_turns == 4);
    struct kvl_sched_model_stats ms1;
    kvl_sched_model_stats(s, 1, &ms1);
    CHECK(ms1.from[0].registered && ms1.from[0].shadows == st.shadows);
    kvl_sched_free(s);
  }
}

/* warm_head: after model 0 serves a request, model 1 (which it translates into) computes
 * the sequence's head in the background; a switch to model 1 then finds the head in its
 * prefix cache and prefills only what follows the translated span, with the same output
 * as a run on model 1 alone (identity translator between copies of one model). Already
 * warm: no second warm-up; a head below one block: none. */
static void test_warm_head(void) {
  int32_t p[64];
  unsigned long long rs = 77;
  for (int i = 0; i < 64; i++) p[i] = (int32_t)(kvl_test_rand(&rs) % 300);
  kvl_model_t *ms[2] = {g_m, g_m};
  struct run ref, o;
  kvl_sched_t *s = sched_of(ms, 2, 64, 0, 64);
  struct kvl_request r = greedy(1, p, 64, 4, 0);
  CHECK_EQ_INT(run_one(s, &r, &ref, 2), 0); /* model 1 alone */
  kvl_sched_free(s);

  s = sched_of(ms, 2, 64, 0, 64);
  link_all(s, 2);
  r = greedy(0, p, 56, 2, 0); /* model 0's prefix cache keeps 48 positions: 16 past the head */
  r.native_head = 32;
  r.warm_head = true;
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0); /* runs until idle: the warm-up included */
  struct kvl_translator_stats st;
  kvl_sched_translator_stats(s, 0, 1, &st);
  CHECK(st.head_warmups == 1);
  kvl_sched_translator_stats(s, 1, 0, &st);
  CHECK(st.head_warmups == 0);
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0); /* model 1 holds the head already */
  kvl_sched_translator_stats(s, 0, 1, &st);
  CHECK(st.head_warmups == 1);
  r = greedy(1, p, 64, 4, 0);
  r.native_head = 32;
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
  printf("  switch after a warm-up: %d cached native, %d translated, %d prefilled\n", o.usage.cached_native,
         o.usage.translated, o.usage.prefilled);
  CHECK(o.usage.cached_native == 32 && o.usage.translated > 0 && o.usage.prefilled == 64 - 32 - o.usage.translated);
  CHECK(o.n == ref.n);
  for (int i = 0; i < o.n && i < ref.n; i++) CHECK_EQ_INT(o.toks[i], ref.toks[i]);
  kvl_sched_free(s);

  s = sched_of(ms, 2, 64, 0, 64);
  link_all(s, 2);
  r = greedy(0, p, 40, 2, 0);
  r.native_head = 8; /* less than a block: nothing to keep */
  r.warm_head = true;
  CHECK_EQ_INT(run_one(s, &r, &o, 2), 0);
  kvl_sched_translator_stats(s, 0, 1, &st);
  CHECK(st.head_warmups == 0);
  kvl_sched_free(s);
}

/* Random conversations over three models (two different weights), random switches, edits
 * (regenerate: history cut back), cascades, cancellations, a pool small enough to
 * preempt and shed kept lines, expiry — the pool checker after every step. */
static void test_stress(void) {
  kvl_model_t *ms[3] = {g_m, g_m2, g_m};
  kvl_sched_t *s = sched_of(ms, 3, 40, 24, 48);
  link_all(s, 3);
  enum { NC = 12 };
  static int32_t conv[NC][MAXT];
  int32_t len[NC] = {0};
  unsigned long long rs = 1234;
  struct run outs[NC];
  int turns = 0, translated = 0, handoffs = 0, preempt = 0, done = 0;
  for (int round = 0; round < 30; round++) {
    uint64_t ids[NC];
    bool live[NC] = {0};
    for (int c = 0; c < NC; c++) {
      if (kvl_test_rand(&rs) % 4 == 0) continue;
      if (len[c] > 20 && kvl_test_rand(&rs) % 5 == 0) len[c] -= (int32_t)(kvl_test_rand(&rs) % (unsigned)(len[c] / 2)); /* edit */
      if (len[c] > 300) len[c] = 0; /* a new conversation in the slot */
      user_turn(conv[c], &len[c], &rs);
      int M = (int)(kvl_test_rand(&rs) % 3);
      struct kvl_request r = greedy(M, conv[c], len[c], 1 + (int32_t)(kvl_test_rand(&rs) % 8), (uint64_t)(c + 1));
      if (kvl_test_rand(&rs) % 6 == 0) {
        cascade(&r, (M + 1) % 3, 2, 1e-3f);
      }
      if (kvl_test_rand(&rs) % 7 == 0) r.reuse = KVL_REUSE_NATIVE_ONLY;
      if (kvl_test_rand(&rs) % 2 == 0) {
        r.native_head = 16; /* the head computed with the translated step */
        r.warm_head = kvl_test_rand(&rs) % 2 == 0; /* ... or ahead of it, in the background */
      }
      memset(&outs[c], 0, sizeof(outs[c]));
      char err[256];
      CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, &outs[c], &ids[c], err, sizeof(err)), 0);
      live[c] = true;
    }
    int steps = 0;
    while (!kvl_sched_idle(s)) {
      int rc = kvl_sched_step(s);
      if (rc < 0) { fprintf(stderr, "step: %s\n", kvl_strerror(rc)); CHECK(rc >= 0); break; }
      check_pools(s, 3);
      if (steps > 2000) {
        fprintf(stderr, "round %d: no progress after %d steps\n", round, steps);
        for (int i = 0; i < 3; i++) {
          struct kvl_sched_model_stats ms;
          struct kvl_pool_stats ps;
          kvl_sched_model_stats(s, i, &ms);
          kvl_pool_stats(kvl_sched_pool(s, i), &ps);
          fprintf(stderr, "  model %d: running %d waiting %d; hot %d used %d cached %d; cold %d used %d\n", i, ms.running,
                  ms.waiting, ps.hot_blocks, ps.hot_used, ps.hot_cached, ps.cold_blocks, ps.cold_used);
        }
        CHECK(0);
        return;
      }
      if (++steps == 3 && round % 5 == 4) kvl_sched_cancel(s, ids[round % NC]);
    }
    for (int c = 0; c < NC; c++) {
      if (!live[c]) continue;
      CHECK(outs[c].done);
      turns++;
      done += outs[c].why == KVL_DONE_LENGTH || outs[c].why == KVL_DONE_CANCELLED;
      translated += outs[c].usage.translated;
      handoffs += outs[c].usage.handoffs;
      preempt += outs[c].usage.preemptions;
      for (int i = 0; i < outs[c].n && len[c] < MAXT - 64; i++) conv[c][len[c]++] = outs[c].toks[i];
    }
    if (round == 20) kvl_sched_conversations_expire(s, 0); /* everything idle goes */
  }
  CHECK_EQ_INT(done, turns);
  uint64_t warmups = 0;
  for (int a = 0; a < 3; a++)
    for (int b = 0; b < 3; b++) {
      struct kvl_translator_stats st;
      kvl_sched_translator_stats(s, a, b, &st);
      warmups += st.head_warmups;
    }
  printf("  %d turns over %d conversations: %d positions translated, %d handoffs, %d preemptions, %d conversations "
         "kept, %llu heads warmed\n", turns, NC, translated, handoffs, preempt, (int)kvl_sched_conversations(s),
         (unsigned long long)warmups);
  CHECK(translated > 0 && handoffs > 0 && warmups > 0);
  /* dropping a conversation frees its lines (the checker sees no lost block) and forgets it */
  int32_t kept = kvl_sched_conversations(s);
  int drc = kvl_sched_conversation_drop(s, 1);
  CHECK(drc == 0 || drc == KVL_ENOENT);
  CHECK_EQ_INT(kvl_sched_conversations(s), kept - (drc == 0));
  CHECK_EQ_INT(kvl_sched_conversation_drop(s, 1), KVL_ENOENT);
  for (int i = 0; i < 3; i++) CHECK(kvl_sched_conversation_line(s, 1, i) == NULL);
  check_pools(s, 3);
  CHECK_EQ_INT(kvl_sched_conversations_expire(s, -1), kept - (drc == 0));
  CHECK_EQ_INT(kvl_sched_conversations(s), 0);
  check_pools(s, 3);
  kvl_sched_free(s);
}

int main(void) {
  g_m = tiny_model_load(&(struct tiny_opts){.n_layer = 2}, &g_buf);
  g_m2 = tiny_model_load(&(struct tiny_opts){.n_layer = 2, .seed = 99}, &g_buf2);
  struct kvl_model_fingerprint fp;
  tiny_fingerprint(g_m, &fp);
  char err[256];
  KVL_ASSERT(kvl_translator_identity(&fp, false, &g_id, err, sizeof(err)) == 0);
  RUN(test_spans_from_transcript);
  RUN(test_stateless);
  RUN(test_handoffs);
  RUN(test_fallbacks);
  RUN(test_gate);
  RUN(test_warm_head);
  RUN(test_stress);
  kvl_translator_free(g_id);
  kvl_model_free(g_m);
  kvl_model_free(g_m2);
  free(g_buf);
  free(g_buf2);
  return TEST_EXIT();
}
