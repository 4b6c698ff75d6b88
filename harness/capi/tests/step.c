/* Drives one whole RolloutPipe step through the C ABI and checks the counters.
 * Exits non-zero (naming the first mismatch) on any difference.
 *
 * The step: B = 4 groups of G = 4 samples, micro-batch 2, 2 optimizer steps, 8 slots,
 * frontier admission, pipelined dispatch. Every admitted request finishes in the tick it was
 * admitted, except that the first attempt of g1/s2 fails once (retried). Group 0 answers
 * 1.0 for every sample (zero variance: filtered), so a fifth prompt is drawn; the other groups
 * answer sample % 2. Expected: 5 drawn, 4 trained, 1 filtered, 0 aborted, 5 x 4 + 1 = 21
 * admissions, 1 failure and requeue, 2 micro-batches, 2 optimizer steps, every dispatched
 * group's rewards {0, 1, 0, 1}.
 *
 * The step runs twice: on library-owned storage (rp_scheduler_new) and on caller-owned memory
 * (rp_scheduler_new_in, placed one byte past an aligned address to show any alignment works).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "rolloutpipe.h"

static int failures = 0;
#define CHECK_EQ(what, got, want)                                                   \
    do {                                                                            \
        long long g_ = (long long)(got), w_ = (long long)(want);                    \
        if (g_ != w_) {                                                             \
            fprintf(stderr, "mismatch: %s = %lld, expected %lld\n", what, g_, w_);  \
            failures++;                                                             \
        }                                                                           \
    } while (0)
#define MUST(call)                                                                  \
    do {                                                                            \
        RpStatus st_ = (call);                                                      \
        if (st_ < 0) {                                                              \
            char msg_[256];                                                         \
            rp_last_error_message(msg_, sizeof msg_);                               \
            fprintf(stderr, "%s failed (%d): %s\n", #call, (int)st_, msg_);         \
            return 1;                                                               \
        }                                                                           \
    } while (0)

static int run_step(RpScheduler *s) {
    RpPlan plan;
    MUST(rp_plan_default(4, 4, &plan));
    plan.micro_batch = 2;
    plan.opt_steps = 2;
    plan.slots = 8;
    plan.draw_batch = 1;
    plan.admission = RP_ADMIT_FRONTIER;

    /* Errors come back as codes with a message and change nothing. */
    RpPlan bad = plan;
    bad.micro_batch = 3;
    CHECK_EQ("bad plan status", rp_begin_step(s, 0, 0, 7, &bad), RP_ERR_BEGIN);
    char msg[256];
    size_t len = rp_last_error_message(msg, sizeof msg);
    if (len == 0) { fprintf(stderr, "no error message for a bad plan\n"); failures++; }
    bad.admission = 9;
    CHECK_EQ("unknown admission code", rp_begin_step(s, 0, 0, 7, &bad), RP_ERR_ARG);
    CHECK_EQ("null handle", rp_audit(NULL), RP_ERR_NULL);

    MUST(rp_begin_step(s, 0, 0, 7, &plan));
    int failed_once = 0, micro_batches = 0, opt_steps = 0, dispatched = 0;
    RpStepSummary sum;
    RpAdmission adm[8];
    RpRequestId first_done = {0};
    int have_done = 0;
    uint64_t t = 0;
    while (rp_poll_step_done(s, &sum) == RP_EMPTY) {
        if (++t > 1000) { fprintf(stderr, "step did not finish\n"); return 1; }
        uint32_t n;
        if (rp_poll_draw(s, t, &n) == RP_OK) MUST(rp_on_prompts_drawn(s, t, n, 0, NULL));
        size_t k = 0;
        MUST(rp_poll_admit_batch(s, t, adm, 8, &k));
        for (size_t i = 0; i < k; i++) {
            RpRequestId id = adm[i].request;
            if (id.group == 1 && id.sample == 2 && !failed_once) {
                RpFailure f;
                MUST(rp_on_request_failed(s, t, id, adm[i].version, &f));
                CHECK_EQ("failure kind", f.kind, RP_FAILURE_RETRIED);
                CHECK_EQ("retry attempt", f.attempt, 1);
                failed_once = 1;
                continue;
            }
            float reward = id.group == 0 ? 1.0f : (float)(id.sample % 2);
            RpCompletion c;
            MUST(rp_on_request_finished(s, t, id, adm[i].version, 10 + id.sample, reward, &c));
            CHECK_EQ("completion accepted", c.accepted, 1);
            if (!have_done) { first_done = id; have_done = 1; }
        }
        RpRequestId ab;
        while (rp_poll_abort(s, t, &ab) == RP_OK) MUST(rp_on_abort_acked(s, t, ab));
        RpDispatch d;
        while (rp_poll_dispatch(s, t, &d) == RP_OK) {
            float r[8];
            size_t nr = 0;
            MUST(rp_group_rewards(s, d.group, r, 8, &nr));
            CHECK_EQ("dispatched group size", nr, 4);
            for (size_t i = 0; i < nr; i++) CHECK_EQ("reward", (int)r[i], (int)(i % 2));
            CHECK_EQ("dispatch seq", d.seq, dispatched);
            dispatched++;
        }
        RpMicroBatch mb;
        while (rp_poll_micro_batch(s, t, &mb) == RP_OK) {
            CHECK_EQ("micro-batch index", mb.index, micro_batches);
            CHECK_EQ("micro-batch len", mb.len, 2);
            MUST(rp_on_micro_batch_consumed(s, t, NULL));
            micro_batches++;
            uint32_t idx;
            if (rp_poll_optimizer_step(s, t, &idx) == RP_OK) {
                CHECK_EQ("optimizer step index", idx, opt_steps);
                MUST(rp_on_optimizer_step_done(s, t));
                opt_steps++;
            }
        }
        MUST(rp_audit(s));
    }

    /* A duplicate completion is refused with a message; the counters do not move. */
    CHECK_EQ("duplicate completion", rp_on_request_finished(s, t, first_done, 7, 1, 0.0f, NULL),
             RP_ERR_REQUEST);
    RpCounters c;
    MUST(rp_counters(s, &c));
    CHECK_EQ("drawn", c.drawn, 5);
    CHECK_EQ("trained", c.trained, 4);
    CHECK_EQ("filtered_zero_variance", c.filtered_zero_variance, 1);
    CHECK_EQ("aborted", c.aborted, 0);
    CHECK_EQ("conservation", c.drawn, c.trained + c.filtered_zero_variance + c.filtered_non_finite +
                                          c.filtered_attempts + c.filtered_skipped + c.aborted);
    CHECK_EQ("requests_admitted", c.requests_admitted, 21);
    CHECK_EQ("requests_failed", c.requests_failed, 1);
    CHECK_EQ("requests_rewarded", c.requests_rewarded, 20);
    CHECK_EQ("in_flight", c.in_flight, 0);
    CHECK_EQ("summary.trained", sum.counters.trained, 4);
    CHECK_EQ("summary.step", sum.step, 0);
    CHECK_EQ("summary.version", sum.version, 7);
    CHECK_EQ("summary.short", sum.is_short, 0);
    CHECK_EQ("dispatched", dispatched, 4);
    CHECK_EQ("micro-batches", micro_batches, 2);
    CHECK_EQ("optimizer steps", opt_steps, 2);
    return 0;
}

int main(void) {
    CHECK_EQ("rp_abi_version()", rp_abi_version(), RP_ABI_VERSION);

    RpScheduler *s = NULL;
    MUST(rp_scheduler_new(16, 64, &s));
    if (run_step(s)) return 1;
    rp_scheduler_free(s);

    /* Caller-owned storage: the scheduler allocates nothing; freeing it leaves `mem` to us. */
    size_t need = rp_scheduler_storage_size(16, 64);
    if (need == 0) { fprintf(stderr, "rp_scheduler_storage_size refused 16/64\n"); return 1; }
    unsigned char *mem = malloc(need + 1);
    if (!mem) return 1;
    CHECK_EQ("short memory refused", rp_scheduler_new_in(mem + 1, need - 1, 16, 64, &s), RP_ERR_ARG);
    CHECK_EQ("null memory refused", rp_scheduler_new_in(NULL, need, 16, 64, &s), RP_ERR_NULL);
    MUST(rp_scheduler_new_in(mem + 1, need, 16, 64, &s));
    if ((unsigned char *)s < mem + 1 || (unsigned char *)s >= mem + 1 + need) {
        fprintf(stderr, "the handle is not inside the caller's memory\n");
        failures++;
    }
    if (run_step(s)) return 1;
    rp_scheduler_free(s);
    free(mem);

    /* Allocation policies: VIGOR configures the plan (n0 samples, the budget, held groups); a
     * bad parameter is refused with its name and leaves the plan as it was. */
    RpPlan plan;
    MUST(rp_plan_default(4, 8, &plan));
    RpAllocPolicy vigor = {0};
    vigor.kind = RP_POLICY_VIGOR;
    vigor.n0 = 4; vigor.rounds = 2; vigor.increment = 4; vigor.budget = 48; vigor.batch_groups = 4;
    MUST(rp_plan_apply_policy(&vigor, &plan));
    CHECK_EQ("VIGOR group_size", plan.group_size, 4);
    CHECK_EQ("VIGOR sample_budget", plan.sample_budget, 48);
    CHECK_EQ("VIGOR hold_scored", plan.hold_scored, 1);
    vigor.n0 = 1;
    CHECK_EQ("VIGOR n0 = 1 refused", rp_plan_apply_policy(&vigor, &plan), RP_ERR_ALLOC_PARAM);
    char msg[256];
    rp_last_error_message(msg, sizeof msg);
    if (!strstr(msg, "n0")) { fprintf(stderr, "message does not name n0: %s\n", msg); failures++; }
    /* Pilot-Commit: n_pilot samples first, and each prompt's commit reserved in the budget. */
    MUST(rp_plan_default(4, 8, &plan));
    RpAllocPolicy pc = {0};
    pc.kind = RP_POLICY_PILOT_COMMIT;
    pc.n_pilot = 4; pc.n_commit = 4; pc.lower = 0.125f; pc.upper = 0.25f;
    MUST(rp_plan_apply_policy(&pc, &plan));
    CHECK_EQ("Pilot-Commit group_size", plan.group_size, 4);
    CHECK_EQ("Pilot-Commit commit_reserve", plan.commit_reserve, 4);

    if (failures) {
        fprintf(stderr, "%d mismatches\n", failures);
        return 1;
    }
    printf("step.c: one step driven through the C ABI, counters match\n");
    return 0;
}
