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
