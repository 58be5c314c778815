#!/usr/bin/env bash
# The sglang_ddtree package of another commit, for an A/B of two commits in one device run:
#
#   bash scripts/device/pack_base.sh COMMIT [DEST]      # DEST default: runs/bench/base-<12 hex of COMMIT>
#
# writes DEST/sglang_ddtree (git archive, nothing else) and prints DEST. runs/bench travels with the device calls
# (carry), and steps.sh tiny-paired runs its twin setup's servers on that package with TP_TWIN_BASE=DEST.
set -euo pipefail
commit=${1:?commit}
full=$(git rev-parse --verify "$commit^{commit}")
dest=${2:-runs/bench/base-${full:0:12}}
rm -rf "$dest"
mkdir -p "$dest"
git archive "$full" sglang_ddtree | tar -x -C "$dest"
echo "$full" > "$dest/COMMIT"
echo "$dest"
