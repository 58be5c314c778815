#!/usr/bin/env bash
# Unpack site chunks made by scripts/device/pack_site.py into $DDTREE_SITE (default /tmp/site). Runs on the
# GPU machine, one call per chunk, back to back (/tmp survives only while the machine stays warm).
#
#   bash scripts/device/install_chunk.sh .device-cache/site-1/site-1.tar.xz   # or the folder .device-cache/site-1
#   bash scripts/device/install_chunk.sh .device-cache/site-1-part1            # a part (split_chunk.py), one a call
#
# Idempotent: $DDTREE_SITE/.ddtree-chunks/<chunk>.sha256 marks a chunk as in; the same bytes again are skipped.
# A chunk whose bytes changed is unpacked over the old one (files it no longer has would stay: `rm -rf` the
# site dir for a clean slate). Each install appends {"chunk","sha256","seconds","method",...} to
# .ddtree-chunks/installs.jsonl, which run_gpu_suite.py reads for its "install" phase.
# DDTREE_UNPACK=python forces Python's tarfile instead of tar+xz (the default when both exist).
set -euo pipefail

site=${DDTREE_SITE:-/tmp/site}
marks=$site/.ddtree-chunks
if [ "$#" -eq 0 ]; then
    echo "usage: install_chunk.sh CHUNK.tar.xz|CHUNK_DIR ... (from scripts/device/pack_site.py)" >&2
    exit 2
fi
mkdir -p "$marks"

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# A part folder (scripts/device/split_chunk.py): keep the part under $site/.ddtree-parts; the call that brings the
# last part joins them, checks the whole chunk's sha256 and installs it like any chunk.
join_parts() {  # folder -> prints the joined chunk's path when complete, nothing otherwise
    local dir=$1 meta name count want got
    meta=$dir/parts.json
    read -r name count want < <(python3 -c \
        'import json,sys; d = json.load(open(sys.argv[1])); print(d["chunk"], d["parts"], d["sha256"])' "$meta")
    mkdir -p "$site/.ddtree-parts"
    cp "$dir"/"$name".tar.xz.part-*-of-"$count" "$site/.ddtree-parts/"
    local have=0 i
    for i in $(seq 1 "$count"); do
        [ -f "$site/.ddtree-parts/$name.tar.xz.part-$i-of-$count" ] && have=$((have + 1))
    done
    if [ "$have" -lt "$count" ]; then
        echo "install_chunk: $name: $have of $count parts kept in $site/.ddtree-parts; install the others" >&2
        return 0
    fi
    for i in $(seq 1 "$count"); do cat "$site/.ddtree-parts/$name.tar.xz.part-$i-of-$count"; done \
        >"$site/.ddtree-parts/$name.tar.xz"
    got=$(sha256sum "$site/.ddtree-parts/$name.tar.xz" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
        echo "install_chunk: $name: the joined parts' sha256 ${got:0:12} is not the chunk's ${want:0:12}" >&2
        rm -f "$site/.ddtree-parts/$name.tar.xz"
        return 3
    fi
    echo "$site/.ddtree-parts/$name.tar.xz"
}

chunks=()
for arg in "$@"; do
    if [ -d "$arg" ] && [ -f "$arg/parts.json" ]; then
        [ -f "$arg/manifest.json" ] && cp "$arg/manifest.json" "$marks/manifest.json"
        joined=$(join_parts "$arg") || exit 2
        [ -n "$joined" ] && chunks+=("$joined")
        continue
    fi
    if [ -d "$arg" ]; then
        found=0
        for f in "$arg"/*.tar.xz; do
            [ -e "$f" ] && chunks+=("$f") && found=1
        done
        if [ "$found" = 0 ]; then
            echo "install_chunk: no *.tar.xz in $arg (was it named in carry?)" >&2
            exit 2
        fi
        # The set's manifest travels with each chunk: keep it so the suite can check that all chunks are in.
        [ -f "$arg/manifest.json" ] && cp "$arg/manifest.json" "$marks/manifest.json"
    elif [ -f "$arg" ]; then
        chunks+=("$arg")
        dir=$(dirname "$arg")
        [ -f "$dir/manifest.json" ] && cp "$dir/manifest.json" "$marks/manifest.json"
    else
        echo "install_chunk: no such chunk: $arg (was its folder named in carry?)" >&2
        exit 2
    fi
done

for f in "${chunks[@]}"; do
    name=$(basename "$f" .tar.xz)
    t0=$(now)
    sha=$(sha256sum "$f" | cut -d' ' -f1)
    bytes=$(stat -c %s "$f")
    if [ -f "$marks/$name.sha256" ] && [ "$(cat "$marks/$name.sha256")" = "$sha" ]; then
        echo "install_chunk: $name already in $site (sha256 ${sha:0:12}), skipped"
        continue
    fi
    if [ -f "$marks/$name.sha256" ]; then
        echo "install_chunk: warning: $name changed since it was installed; unpacking over it" \
             "(rm -rf $site for a clean slate)"
    fi
    rm -f "$marks/$name.sha256"  # no marker while unpacking: an interrupted unpack is redone next time
    if [ "${DDTREE_UNPACK:-auto}" != python ] && command -v xz >/dev/null 2>&1 && tar --version >/dev/null 2>&1; then
        method=tar
        tar -xJf "$f" -C "$site" --no-same-owner
    else
        method=python
        python3 - "$f" "$site" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as tf:
    # 'data' refuses absolute paths, links out of the dir and device files (Python >= 3.11.4 / 3.12).
    tf.extractall(sys.argv[2], filter="data")
PY
    fi
    echo "$sha" >"$marks/$name.sha256"
    secs=$(elapsed "$t0" "$(now)")
    printf '{"chunk": "%s", "sha256": "%s", "bytes": %s, "seconds": %s, "method": "%s", "time": %s}\n' \
        "$name" "$sha" "$bytes" "$secs" "$method" "$(date +%s)" >>"$marks/installs.jsonl"
    echo "install_chunk: $name ($((bytes / 1048576)) MiB) unpacked into $site with $method in ${secs}s"
done

installed=$(find "$marks" -maxdepth 1 -name '*.sha256' | wc -l)  # 0 is fine: a call that only kept a part
echo "install_chunk: $installed chunk(s) in $site, $(du -sm "$site" | cut -f1) MiB"
