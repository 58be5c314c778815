"""Names of the stages of one speculative round, shared by the decoders, the server worker, dumps and plots.

STAGES: the round's own work, in order (offline decoders and the SGLang worker time the same five).
SERVER_STAGES: the worker also reports `between`, the GPU time from the end of the previous decode round to the
start of this one (scheduler work on the GPU, or the GPU idle while the host prepares the round). With SGLang's
overlap scheduler the host enqueues a round while the previous one still runs, so a clock started at the round's
first host call would count the previous round's tail; chaining the CUDA events round to round makes the stages
add up to the GPU time per round, with nothing counted twice.
"""

STAGES = ("draft", "tree", "verify", "walk", "commit")
SERVER_STAGES = ("between",) + STAGES
# The worker's host time per stage of its round call (stats.RoundTimer.host_stage_ms): `choose` is `auto`'s chooser
# (before the draft), `after` the call's work after the commit (stats, `auto`'s feedback), both host-only.
HOST_STAGES = ("choose",) + STAGES + ("after",)
# With SGLANG_DDTREE_AUTO_HOST_DETAIL=1 (a measuring mode, auto_ab.auto_host_detail) `auto`'s own host work is marked
# apart: `choose` splits into choose_prep (verify states, bucket), choose_held (the held-round check), choose_drain
# (the feedback drain before a decision) and `choose` (the decision); tree_auto is the round counter and walk variant
# before the tree stage; after_cat / after_push / after_learn / after_auto the feedback vector (with the stall check
# and capture count before it, which a fixed round has in `after`), its push, the table's learn and the rest of
# `auto`'s bookkeeping after the commit. Why: the in-process A/B put `auto`'s own host time at ~0.1 ms a tiny-pair
# round (choose ~0.047, after 0.024-0.082) while the same Python takes ~12 us a round on a CPU
# (bench_auto_round_host.py); cProfile in the server inflates each call and moves the rest.
AUTO_HOST_DETAIL = ("choose_prep", "choose_held", "choose_drain", "tree_auto", "after_cat", "after_push",
                    "after_learn", "after_auto")
