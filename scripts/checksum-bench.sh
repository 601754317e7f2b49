#!/bin/bash
# Throughput with the checksum on against off, interleaved, one sitting.
# Run from the repository root after `cargo build --release -p kvferry-cli`; prints one line
# per run: page bytes, on/off, payload GB/s.
k=./target/release/kvferry
for pb in 16384 4096; do
  rooms=1000; [ $pb = 4096 ] && rooms=2000
  for i in 1 2 3 4 5 6; do
    for c in off on; do
      flag=""; [ $c = on ] && flag="--checksum"
      g=$($k demo --json --rooms $rooms --page-bytes $pb $flag 2>/dev/null | python3 -c "import json,sys; r=json.load(sys.stdin); assert r['pages_corrupted']==0 and r['rooms_succeeded']==r['rooms_total']; print(r['throughput_gbps'])")
      echo "$pb $c $g"
    done
  done
done
