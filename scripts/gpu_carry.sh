#!/usr/bin/env bash
# Move the converted SmolLM2 checkpoint to another machine in parts of at most PART_BYTES each.
#   here:       bash scripts/gpu_carry.sh split      -> .carry/part0 .. .carry/partN (ignored by git)
#   there:      bash scripts/gpu_carry.sh stash      (after each part arrives in .carry: copies it to /tmp)
#               bash scripts/gpu_carry.sh assemble   (after the last part: unpacks into $CACHE)
# split also copies ../shared/data's GSM8K and WikiText-2 files to .carry/data: carry it with the last part.
# then QSPEC_JAX_CACHE=/tmp/qspec-jax-cache finds the checkpoint (convert.embedded.cache_dir) and
# QSPEC_JAX_DATA=.carry/data the data (bench.decode).
set -euo pipefail
NAME=smollm2-rtn-asym-g32
PART_BYTES=55000000  # a part, the tree and .carry/data stay under 64 MiB
STASH=/tmp/qspec-carry
CACHE=/tmp/qspec-jax-cache
cd "$(dirname "$0")/.."
case "${1:-}" in
  split)
    src="${QSPEC_JAX_CACHE:-$HOME/.cache/qspec-jax}/$NAME"
    [ -f "$src/manifest.json" ] || { echo "no converted checkpoint at $src (run the README's first command)" >&2; exit 1; }
    rm -rf .carry && mkdir -p .carry
    tar -C "$(dirname "$src")" -cf - "$NAME" | split -b "$PART_BYTES" -d -a 1 - .carry/tmp.
    for f in .carry/tmp.*; do i="${f##*.}"; mkdir -p ".carry/part$i"; mv "$f" ".carry/part$i/data"; done
    # the evaluation data (../shared/data does not travel): carried with the last part as .carry/data
    if [ -d ../shared/data ]; then
      mkdir -p .carry/data && cp ../shared/data/gsm8k_test_dev.jsonl ../shared/data/gsm8k_train.jsonl \
        ../shared/data/wikitext2_test.raw .carry/data/
    fi
    ls .carry ;;
  stash)
    mkdir -p "$STASH"
    for d in .carry/part*; do [ -f "$d/data" ] && cp "$d/data" "$STASH/$(basename "$d")"; done
    ls -la "$STASH" ;;
  assemble)
    mkdir -p "$CACHE"
    cat $(ls "$STASH"/part* | sort -V) | tar -C "$CACHE" -xf -
    ls -la "$CACHE/$NAME" ;;
  *) echo "usage: $0 split|stash|assemble" >&2; exit 2 ;;
esac
