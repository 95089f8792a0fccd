/* test-sched.c — continuous batching on a tiny synthetic model (reference backend, so
 * results do not depend on batch composition): batched greedy outputs equal solo runs;
 * a shared prefix is reported as cached and changes nothing; 200 requests against a
 * small pool all complete through preemption; impossible requests are refused with a
 * message; cancel frees blocks at once; a prefix on the disk tier is read back while its
 * request waits, and the overload runs with a disk tier too. */
#include <sys/stat.h>
#include <unistd.h>

#include "../kvl_test.h"
#include "../tiny_model.h"
#include "kvl_error.h"
#include "kvl_kvpool.h"
#include "kvl_sched.h"

enum { MAXR = 256, MAXT = 64 };

struct out {
  int32_t toks[MAXR][MAXT];
  int n[MAXR];
  bool done[MAXR];
  enum kvl_finish_reason why[MAXR];
  struct kvl_usage usage[MAXR];
};

static void on_token(void *ud, uint64_t id, const struct kvl_token_event *ev) {
  struct out *o = ud;
  int i = (int)(id - 1) % MAXR;
  if (ev->token >= 0 && o->n[i] < MAXT) o->toks[i][o->n[i]++] = ev->token;
  if (ev->final) { o->done[i] = true; o->why[i] = ev->finish; o->usage[i] = ev->usage; }
}

static kvl_model_t *tiny(void **buf) { return tiny_model_load(&(struct tiny_opts){.n_layer = 2}, buf); }

static char g_disk[64]; /* the disk tier's file of sched_disk's schedulers */

static kvl_sched_t *sched_disk(kvl_model_t *m, int hot_blocks, int cold_blocks, int disk_blocks, int step_tokens,
                               int *mid) {
  kvl_sched_t *s;
  KVL_ASSERT(kvl_sched_new(&(struct kvl_sched_config){.step_tokens = step_tokens, .max_seqs = 32}, &s) == 0);
  struct kvl_kv_layout kl = kvl_model_kv_layout(m, KVL_KV_F32);
  size_t bb = kvl_kv_block_bytes(&kl);
  snprintf(g_disk, sizeof(g_disk), "/tmp/kvl-sched-disk-%d", (int)getpid());
  struct kvl_sched_model sm = {"tiny", m, kvl_backend_ref(),
                               {.layout = kl, .hot_bytes = (size_t)hot_blocks * bb, .cold_bytes = (size_t)cold_blocks * bb,
                                .disk_bytes = (size_t)disk_blocks * bb, .disk_path = disk_blocks ? g_disk : NULL},
                               0};
  char err[256];
  int rc = kvl_sched_add_model(s, &sm, mid, err, sizeof(err));
  if (rc) fprintf(stderr, "%s\n", err);
  KVL_ASSERT(rc == 0);
  return s;
}

static kvl_sched_t *sched(kvl_model_t *m, int hot_blocks, int cold_blocks, int step_tokens, int *mid) {
  return sched_disk(m, hot_blocks, cold_blocks, 0, step_tokens, mid);
}

static void prompt_of(int i, int32_t *p, int n) {
  unsigned long long s = 1000 + (unsigned long long)i;
  for (int j = 0; j < n; j++) p[j] = (int32_t)(kvl_test_rand(&s) % 300);
  if (i % 3 == 0) for (int j = 0; j < n && j < 40; j++) p[j] = (int32_t)(j * 7 % 300); /* shared 40-token prefix */
}

static struct kvl_request req(int mid, const int32_t *p, int n, int max_tokens) {
  struct kvl_request r = {.model = mid, .prompt = p, .n_prompt = n, .max_tokens = max_tokens};
  kvl_sampler_params_init(&r.sampling);
  r.sampling.temperature = 0;
  return r;
}

/* Each request alone in a fresh scheduler: the reference outputs. */
static void solo(kvl_model_t *m, int n_req, const int *plen, int max_tokens, struct out *ref) {
  memset(ref, 0, sizeof(*ref));
  for (int i = 0; i < n_req; i++) {
    int mid;
    kvl_sched_t *s = sched(m, 64, 0, 512, &mid);
    int32_t p[128];
    prompt_of(i, p, plen[i]);
    struct kvl_request r = req(mid, p, plen[i], max_tokens);
    uint64_t id;
    char err[256];
    struct out tmp = {0};
    KVL_ASSERT(kvl_sched_submit(s, &r, on_token, &tmp, &id, err, sizeof(err)) == 0);
    while (!kvl_sched_idle(s)) { int src = kvl_sched_step(s); if (src < 0) fprintf(stderr, "step: %s\n", kvl_strerror(src)); KVL_ASSERT(src >= 0); }
    memcpy(ref->toks[i], tmp.toks[0], sizeof(tmp.toks[0]));
    ref->n[i] = tmp.n[0];
    ref->usage[i] = tmp.usage[0];
    kvl_sched_free(s);
  }
}

static int compare(const struct out *a, const struct out *b, int n_req) {
  int bad = 0;
  for (int i = 0; i < n_req; i++)
    bad += a->n[i] != b->n[i] || memcmp(a->toks[i], b->toks[i], sizeof(int32_t) * (size_t)a->n[i]);
  return bad;
}

static void test_batched_equals_solo(void) {
  void *buf;
  kvl_model_t *m = tiny(&buf);
  enum { N = 24 };
  int plen[N];
  for (int i = 0; i < N; i++) plen[i] = 5 + (i * 37) % 90;
  struct out *ref = calloc(1, sizeof(*ref)), *got = calloc(1, sizeof(*got));
  solo(m, N, plen, 12, ref);
  int mid;
  kvl_sched_t *s = sched(m, 128, 0, 48, &mid); /* small step budget: long prompts are chunked */
  int32_t p[N][128];
  int steps = 0;
  for (int i = 0; i < N; i++) {
    prompt_of(i, p[i], plen[i]);
    struct kvl_request r = req(mid, p[i], plen[i], 12);
    uint64_t id;
    char err[256];
    CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, got, &id, err, sizeof(err)), 0);
    if (i % 4 == 3) { CHECK(kvl_sched_step(s) >= 0); steps++; } /* requests arrive while others run */
  }
  while (!kvl_sched_idle(s)) { CHECK(kvl_sched_step(s) >= 0); steps++; }
  int bad = compare(got, ref, N), cached = 0;
  for (int i = 0; i < N; i++) { CHECK(got->done[i] && got->why[i] == KVL_DONE_LENGTH); cached += got->usage[i].cached_native; }
  printf("  %d requests in %d steps: %d outputs differ from solo runs, %d prompt tokens served from the cache\n", N, steps,
         bad, cached);
  CHECK_EQ_INT(bad, 0);
  CHECK(cached > 0);
  kvl_sched_free(s);
  free(ref); free(got);
  kvl_model_free(m);
  free(buf);
}

static void test_shared_prefix(void) {
  void *buf;
  kvl_model_t *m = tiny(&buf);
  int mid;
  kvl_sched_t *s = sched(m, 64, 0, 512, &mid);
  int32_t p[70];
  prompt_of(3, p, 70);
  struct out *o = calloc(1, sizeof(*o));
  uint64_t id1, id2;
  char err[256];
  struct kvl_request r = req(mid, p, 70, 10);
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, o, &id1, err, sizeof(err)), 0);
  while (!kvl_sched_idle(s)) kvl_sched_step(s);
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, o, &id2, err, sizeof(err)), 0);
  while (!kvl_sched_idle(s)) kvl_sched_step(s);
  printf("  cold: prefilled %d; warm: cached %d native, prefilled %d\n", o->usage[0].prefilled, o->usage[1].cached_native,
         o->usage[1].prefilled);
  CHECK_EQ_INT(o->usage[0].cached_native, 0);
  CHECK_EQ_INT(o->usage[1].cached_native, 64);
  CHECK_EQ_INT(o->usage[1].prefilled, 6);
  CHECK(o->n[0] == 10 && o->n[1] == 10 && !memcmp(o->toks[0], o->toks[1], sizeof(int32_t) * 10));
  kvl_sched_free(s);
  free(o);
  kvl_model_free(m);
  free(buf);
}

/* A cached prefix pushed on to the disk tier: the request waits while the pool's I/O
 * thread reads it back, then reports it cached and answers exactly as the cold run did. */
static void test_disk_prefix(void) {
  void *buf;
  kvl_model_t *m = tiny(&buf);
  int mid;
  kvl_sched_t *s = sched_disk(m, 8, 4, 16, 512, &mid);
  kvl_pool_t *pool = kvl_sched_pool(s, mid);
  int32_t a[70], b[100], c[100];
  prompt_of(3, a, 70);
  prompt_of(4, b, 100);
  prompt_of(5, c, 100);
  struct out *o = calloc(1, sizeof(*o));
  uint64_t id;
  char err[256];
  struct kvl_request qa = req(mid, a, 70, 8), qb = req(mid, b, 100, 4), qc = req(mid, c, 100, 4);
  const struct kvl_request *order[] = {&qa, &qb, &qc, &qa};
  for (int i = 0; i < 4; i++) {
    if (i == 3) kvl_pool_io_drain(pool); /* every write landed: a's blocks are only on disk now */
    int rc = kvl_sched_submit(s, order[i], on_token, o, &id, err, sizeof(err));
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_EQ_INT(rc, 0);
    CHECK_EQ_INT(id, (uint64_t)i + 1);
    while (!kvl_sched_idle(s)) {
      CHECK(kvl_sched_step(s) >= 0);
      char perr[256];
      if (kvl_pool_check(pool, perr, sizeof(perr))) { fprintf(stderr, "%s\n", perr); kvl_test_failed++; break; }
    }
  }
  struct kvl_pool_stats st;
  kvl_pool_stats(pool, &st);
  printf("  first run: prefilled %d; after two 100-token requests: cached %d native, %llu blocks read back from "
         "disk, outputs %s\n", o->usage[0].prefilled, o->usage[3].cached_native, (unsigned long long)st.restored_from_disk,
         o->n[3] == 8 && !memcmp(o->toks[0], o->toks[3], sizeof(int32_t) * 8) ? "equal" : "DIFFER");
  CHECK_EQ_INT(o->usage[3].cached_native, 64);
  CHECK(st.restored_from_disk >= 4 && st.disk_errors == 0);
  CHECK(o->n[0] == 8 && o->n[3] == 8 && !memcmp(o->toks[0], o->toks[3], sizeof(int32_t) * 8));
  struct stat sb;
  CHECK(stat(g_disk, &sb) != 0); /* in use, the disk tier's file has no name (unlinked once open) */
  kvl_sched_free(s);
  free(o);
  kvl_model_free(m);
  free(buf);
}

static void overload(int disk_blocks) {
  void *buf;
  kvl_model_t *m = tiny(&buf);
  enum { N = 200 };
  int plen[N];
  for (int i = 0; i < N; i++) plen[i] = 3 + (i * 13) % 40;
  struct out *ref = calloc(1, sizeof(*ref)), *got = calloc(1, sizeof(*got));
  solo(m, N, plen, 8, ref);
  int mid;
  /* 12 hot blocks = 192 positions for 200 requests */
  kvl_sched_t *s = sched_disk(m, 12, disk_blocks ? 2 : 6, disk_blocks, 64, &mid);
  static int32_t p[N][64];
  char err[256];
  uint64_t id;
  for (int i = 0; i < N; i++) {
    prompt_of(i, p[i], plen[i]);
    struct kvl_request r = req(mid, p[i], plen[i], 8);
    CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, got, &id, err, sizeof(err)), 0);
  }
  /* one that can never fit is refused with the reason, the others are not affected */
  int32_t big[300] = {0};
  struct kvl_request r = req(mid, big, 300, 10);
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, got, &id, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "KV blocks");
  int steps = 0, preempt = 0;
  while (!kvl_sched_idle(s) && steps < 100000) {
    CHECK(kvl_sched_step(s) >= 0);
    steps++;
    char perr[256];
    if (kvl_pool_check(kvl_sched_pool(s, mid), perr, sizeof(perr))) { fprintf(stderr, "%s\n", perr); kvl_test_failed++; break; }
  }
  int done = 0;
  for (int i = 0; i < N; i++) { done += got->done[i]; preempt += got->usage[i].preemptions; }
  int bad = compare(got, ref, N);
  struct kvl_pool_stats st;
  kvl_pool_stats(kvl_sched_pool(s, mid), &st);
  printf("  %d/%d requests completed in %d steps against 12 hot blocks, %d preemptions, %d outputs differ", done, N,
         steps, preempt, bad);
  if (disk_blocks)
    printf("; disk tier: %llu spilled, %llu read back, %llu dropped for a full write-behind", (unsigned long long)st.spilled_to_disk,
           (unsigned long long)st.restored_from_disk, (unsigned long long)st.disk_busy);
  printf("\n");
  CHECK_EQ_INT(done, N);
  CHECK_EQ_INT(bad, 0);
  if (disk_blocks) CHECK(st.spilled_to_disk > 0 && st.disk_errors == 0); /* the disk tier was in play, and sound */
  kvl_sched_free(s);
  free(ref); free(got);
  kvl_model_free(m);
  free(buf);
}

static void test_overload(void) { overload(0); }
static void test_overload_disk(void) { overload(64); }

static void test_refusals_and_cancel(void) {
  void *buf;
  kvl_model_t *m = tiny(&buf);
  int mid;
  kvl_sched_t *s = sched(m, 16, 0, 32, &mid);
  struct out *o = calloc(1, sizeof(*o));
  char err[256];
  uint64_t id;
  int32_t p[20] = {1, 2, 3};
  struct kvl_request r = req(mid, p, 0, 4);
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, o, &id, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "empty");
  r = req(mid, p, 3, 5000);
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, o, &id, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "max_model_len");
  p[1] = 999;
  r = req(mid, p, 3, 4);
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, o, &id, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "outside the vocabulary");
  p[1] = 2;
  r = req(mid, p, 20, 30);
  r.sampling.top_p = 2.0f;
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, o, &id, err, sizeof(err)), KVL_EINVAL);
  r.sampling.top_p = 1.0f;
  CHECK_EQ_INT(kvl_sched_submit(s, &r, on_token, o, &id, err, sizeof(err)), 0);
  kvl_sched_step(s);
  kvl_sched_step(s);
  struct kvl_pool_stats st;
  kvl_pool_stats(kvl_sched_pool(s, mid), &st);
  CHECK(st.hot_used > 0);
  CHECK_EQ_INT(kvl_sched_cancel(s, id), 0);
  kvl_pool_stats(kvl_sched_pool(s, mid), &st);
  CHECK_EQ_INT(st.hot_used, 0); /* blocks released at once (committed ones stay cached) */
  int i = (int)(id - 1);
  CHECK(o->done[i] && o->why[i] == KVL_DONE_CANCELLED);
  CHECK_EQ_INT(kvl_sched_cancel(s, id), KVL_ENOENT);
  CHECK(kvl_sched_idle(s));
  kvl_sched_free(s);
  free(o);
  kvl_model_free(m);
  free(buf);
}

int main(void) {
  RUN(test_batched_equals_solo);
  RUN(test_shared_prefix);
  RUN(test_overload);
  RUN(test_overload_disk);
  RUN(test_disk_prefix);
  RUN(test_refusals_and_cancel);
  return TEST_EXIT();
}
