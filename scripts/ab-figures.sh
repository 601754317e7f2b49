#!/usr/bin/env bash
# Before/after figures of two release CLIs, alternated in one sitting (this machine is
# shared and noisy: only runs side by side compare). Usage:
#   scripts/ab-figures.sh BEFORE_KVFERRY AFTER_KVFERRY [BENCH_ROUNDS] [DEMO_ROUNDS]
# Build the "before" one from a worktree, for example:
#   git worktree add /tmp/old REV && (cd /tmp/old && CARGO_TARGET_DIR=$PWD/target/old \
#     cargo build --release -p kvferry-cli)
# Prints, per workload and runtime, the median and range of `kvferry bench --runtime all`
# ratios, then each demo's GB/s (tokio and glommio) and the pages corrupted.
set -euo pipefail
before=$1 after=$2 rounds=${3:-10} demos=${4:-4}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for _ in $(seq "$rounds"); do
  for v in before after; do
    "${!v}" bench --runtime all --rounds 6 --json 2>/dev/null >>"$out/bench-$v.jsonl"
  done
done
for _ in $(seq "$demos"); do
  for v in before after; do
    "${!v}" demo --json 2>/dev/null >>"$out/demo-tokio-$v.jsonl"
    "${!v}" demo --runtime glommio --json 2>/dev/null >>"$out/demo-glommio-$v.jsonl"
  done
done
python3 - "$out" <<'PY'
import json, statistics as st, sys
d = sys.argv[1]
def rows(name):
    return [json.loads(l) for l in open(f"{d}/{name}.jsonl") if l.strip()]
for v in ("before", "after"):
    ratios = {}
    for r in rows(f"bench-{v}"):
        if "runtime" in r:
            ratios.setdefault((r["workload"], r["runtime"]), []).append(r["ratio"])
    for (w, rt), x in sorted(ratios.items()):
        print(f"{v:6} {w:18} {rt:8} median {st.median(x):.3f} range {min(x):.3f}-{max(x):.3f}")
for rt in ("tokio", "glommio"):
    for v in ("before", "after"):
        runs = rows(f"demo-{rt}-{v}")
        gbps = [r["throughput_gbps"] for r in runs]
        bad = sum(r["pages_corrupted"] for r in runs)
        print(f"demo {rt:8} {v:6} GB/s {' '.join(f'{g:.3f}' for g in gbps)}"
              f" median {st.median(gbps):.3f} corrupted {bad}")
PY
