/* The grouped product of a mixture of experts' step: every active expert's rows of x times that
 * expert's weight, in one call on the pool (forge.models.llama.mixture calls it twice a layer: gate/up,
 * then down).
 *
 * A layer's experts of one projection are the file's 3-D tensor [experts, rows, bytes per row], one per
 * part (gate and up: two parts stacked along the rows, as a BlockMatrix stacks them); expert e's rows of
 * part p start at parts[p].data + e * parts[p].rows * row_bytes, read in place. The step's rows come
 * grouped by expert (the caller sorts them): group g is expert experts[g] over rows [starts[g],
 * starts[g + 1]) of x and of out.
 *
 *   out[r][col] = sum_k x[r][k] * W_e[col][k]   for r in group g, e = experts[g]
 *
 * The work is every group's weight rows cut into slabs of SLAB rows (each part apart), each slab costing
 * its rows times (ROW_COST + the group's rows of x): the weights' bytes, read once, and the products.
 * Thread i of n takes the slabs whose cost falls in its n-th of the total, in order, so that each
 * thread streams long runs of one expert's rows, and runs each run of slabs of one group and part as
 * one forge_qmatmul over those weight rows (qmatmul.c: its own call on the pool finds the pool busy and
 * computes alone, on this thread). A row's out is then exactly what forge_qmatmul computes for the
 * expert's whole matrix and the group's rows (its paths depend on the rows of x, the types and K,
 * not on which of W's rows a call covers): the grouped product has the bits of one product per expert.
 */
#include "pool.h"
#include "qmatmul.h"

#include <stdatomic.h>

/* qmatmul.c's entry (exported for ctypes; its own declaration lives there). */
int forge_qmatmul(const float *x, int64_t T, int64_t K, int64_t ldx, const qpart *parts, int64_t num_parts,
                  float *out, int64_t ldo, int64_t fast);

#define SLAB 64                /* rows of W per unit of work: whole panels, and whole 16- and 32-row groups */
#define ROW_COST 4             /* a weight row read costs about as much as this many rows of x multiplied */

typedef struct {
    const float *x;
    int64_t K, ldx;
    const int64_t *experts, *starts;
    int64_t num_groups;
    const qpart *parts;        /* data: expert 0's rows; rows: per expert */
    int64_t num_parts;
    int64_t slabs[MAX_PARTS];  /* slabs of each part, per expert */
    int64_t row_bytes[MAX_PARTS];    /* a packed part's: a group's of 16 rows */
    float *out;
    int64_t ldo, fast;
    _Atomic int error;         /* the first forge_qmatmul failure, else 0 */
} moe_job;

static inline int64_t slab_rows(const moe_job *jb, int64_t p, int64_t s) {
    const int64_t left = jb->parts[p].rows - s * SLAB;
    return left < SLAB ? left : SLAB;
}

/* Group g's part p, weight rows [r0, r1), into out's columns col0 + r0 .. */
static void run(const moe_job *jb, int64_t g, int64_t p, int64_t col0, int64_t r0, int64_t r1) {
    const int64_t lo = jb->starts[g], rows = jb->starts[g + 1] - lo;
    const qpart *pt = &jb->parts[p];
    const int64_t row = jb->experts[g] * pt->rows + r0;            /* packed: a multiple of 16, row_bytes a group's */
    const qpart sub = {pt->data + ((pt->type & DET_PACKED) ? row / 16 : row) * jb->row_bytes[p], r1 - r0, pt->type};
    const int rc = forge_qmatmul(jb->x + lo * jb->ldx, rows, jb->K, jb->ldx, &sub, 1, jb->out + lo * jb->ldo + col0 + r0,
                                 jb->ldo, jb->fast);
    if (rc != 0) {
        int none = 0;
        atomic_compare_exchange_strong((_Atomic int *)&jb->error, &none, rc);
    }
}

static void moe_part(const void *ctx, int index, int count) {
    const moe_job *jb = ctx;
    int64_t per_expert = 0, total = 0;
    for (int64_t p = 0; p < jb->num_parts; p++) per_expert += jb->parts[p].rows;
    for (int64_t g = 0; g < jb->num_groups; g++) total += per_expert * (ROW_COST + jb->starts[g + 1] - jb->starts[g]);
    /* this thread's share of the cost: the slabs whose middle falls in [lo, hi) (doubled: no halves) */
    const int64_t lo = 2 * (total * index / count), hi = 2 * (total * (index + 1) / count);
    int64_t done = 0;
    for (int64_t g = 0; g < jb->num_groups; g++) {
        const int64_t unit = ROW_COST + jb->starts[g + 1] - jb->starts[g];
        if (2 * (done + per_expert * unit) <= lo) {            /* the whole group lies before the share */
            done += per_expert * unit;
            continue;
        }
        if (2 * done >= hi) break;
        int64_t col0 = 0;
        for (int64_t p = 0; p < jb->num_parts; col0 += jb->parts[p].rows, p++) {
            int64_t run_lo = -1, run_hi = -1;                  /* the run of this part's slabs taken */
            for (int64_t s = 0; s < jb->slabs[p]; s++) {
                const int64_t cost = slab_rows(jb, p, s) * unit, middle = 2 * done + cost;
                done += cost;
                if (middle >= lo && middle < hi) {
                    if (run_lo < 0) run_lo = s * SLAB;
                    run_hi = s * SLAB + slab_rows(jb, p, s);
                }
            }
            if (run_lo >= 0) run(jb, g, p, col0, run_lo, run_hi);
        }
    }
}

/* The grouped product (see the top). x [N, ldx] float32 (the first K used), out [N, ldo]; every part of
 * a type forge_qmatmul reads, K whole blocks of each. The caller checks the experts and starts (ids
 * below the tensors' count, starts rising from 0 to N). Returns 0, or forge_qmatmul's error. */
int forge_moe_matmul(const float *x, int64_t K, int64_t ldx, const int64_t *experts, const int64_t *starts,
                     int64_t num_groups, const qpart *parts, int64_t num_parts, float *out, int64_t ldo, int64_t fast) {
    if (num_parts < 1 || num_parts > MAX_PARTS || K <= 0 || K % 32) return -1;
    moe_job jb = {.x = x, .K = K, .ldx = ldx, .experts = experts, .starts = starts, .num_groups = num_groups,
                  .parts = parts, .num_parts = num_parts, .out = out, .ldo = ldo, .fast = fast, .error = 0};
    for (int64_t p = 0; p < num_parts; p++) {
        /* a packed part (DET_PACKED, an expert's rows a multiple of 32): its groups of 16 rows in turn */
        const int64_t type = parts[p].type & ~(int64_t)DET_PACKED, bv = block_values(type);
        const int packed = type != parts[p].type;
        if (bv == 0 || K % bv || parts[p].rows < 0 || (packed && parts[p].rows % 32)) return -1;
        jb.row_bytes[p] = packed ? det_group_bytes(type, K) : K / bv * block_bytes(type);
        jb.slabs[p] = (parts[p].rows + SLAB - 1) / SLAB;
    }
    if (num_groups <= 0) return 0;
    forge_run_parallel(moe_part, &jb, 1);
    return atomic_load(&jb.error);
}
