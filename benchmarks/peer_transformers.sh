#!/usr/bin/env bash
# The transformers peer on the GPU machine, from the repo root:
#   bash benchmarks/peer_transformers.sh OUTDIR [MODES] [ARGS...]   (MODES: async (default), sync, or async,sync;
#   ARGS go to the script, e.g. --workload moe-30b-a3b)
# Installs flash-attn-4 and its CuTe DSL wheels from .fa4a/ + .fa4b/ into /tmp/fa4site (once), puts them on
# PYTHONPATH, then runs benchmarks/peer_transformers.py (which falls back to paged|sdpa without them).
set -euo pipefail
out=${1:?usage: $0 OUTDIR [MODES]}
modes=${2:-async}
shift $(( $# < 2 ? $# : 2 ))
# The two halves may come in two calls (a call carries at most 64 MiB): each is kept in
# /tmp/fa4stage, which outlives a call while the machine stays warm.
mkdir -p /tmp/fa4stage
for half in .fa4a .fa4b; do
  [ -d "$half" ] && { rm -rf "/tmp/fa4stage/$half"; cp -r "$half" /tmp/fa4stage/; }
done
if [ -d /tmp/fa4stage/.fa4a ] && [ -d /tmp/fa4stage/.fa4b ]; then
  if [ ! -d /tmp/fa4site ]; then
    (cd /tmp/fa4stage && bash .fa4a/install.sh --install)
  fi
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
else
  echo "flash-attn-4 halves missing (.fa4a and .fa4b): it will not be available"
fi
export PYTHONUNBUFFERED=1
exec python3 benchmarks/peer_transformers.py --out "$out" --modes "$modes" "$@"
