#!/usr/bin/env bash
# The thread-per-core figures in one command, for a machine with more cores than the 2-core
# development host (a 16-core device machine): the scaling sweep up to every core, and three
# runs of the tokio / glommio / raw bench with the glommio-vs-tokio line per workload.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${GLOMMIO_CHECK_OUT:-glommio-check-out}
mkdir -p "$out"
echo "== machine: $(nproc) cores, $(uname -r), RLIMIT_MEMLOCK soft $(ulimit -l)"
cargo build --release -p kvferry-cli || exit 1
rc=0
echo "== scaling sweep: 1..$(nproc) shards, 20000 rooms per point, k shards on k cores"
./target/release/kvferry bench --scaling | tee "$out/scaling.txt" || rc=1
for i in 1 2 3; do
    echo "== bench --runtime all --rounds 9, run $i"
    ./target/release/kvferry bench --runtime all --rounds 9 | tee "$out/bench-$i.txt" || rc=1
done
echo "glommio-check: rc=$rc (figures in $out/)"
exit $rc
