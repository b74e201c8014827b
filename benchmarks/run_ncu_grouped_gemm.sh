#!/usr/bin/env bash
# Hardware counters of moekit's grouped GEMM and torch._grouped_mm on one shape and pass:
#   benchmarks/run_ncu_grouped_gemm.sh OUT_DIR SHAPE PASS [--uniform]
# Writes OUT_DIR/<shape>_<pass>_<who>.ncu-rep and .txt (SpeedOfLight, memory, warp states).
set -euo pipefail
out=$1 shape=$2 pass=$3
shift 3
export PYTHONPATH=$PWD:$PWD/benchmarks MOEKIT_AUTOTUNE=${MOEKIT_AUTOTUNE:-0}
for who in moekit torch; do
  rep="$out/${shape}_${pass}_${who}"
  # -c 4: the warm call and the profiled call (torch may add a small set-up kernel to each)
  ncu --clock-control none --set full -k regex:'ragged|gemm|Gemm|cutlass|sm90|device_kernel' -c 4 -f -o "$rep" \
    python benchmarks/probe_ncu_grouped_gemm.py --shape "$shape" --pass "$pass" --only "$who" "$@" \
    > "$rep.log" 2>&1 || { tail -20 "$rep.log"; continue; }
  ncu -i "$rep.ncu-rep" --page details --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats > "$rep.txt" 2>&1 || true
  ncu -i "$rep.ncu-rep" --page raw --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__bytes_write.sum,lts__t_sector_hit_rate.pct > "$rep.csv" 2>&1 || true
  cut -c1-400 "$rep.csv" | grep -v "^==" | head -8
  python benchmarks/ncu_report_summary.py "$rep.ncu-rep" --top 25 || true
  grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|L2 Hit|L1/TEX Hit|Warp Cycles Per Issued|Registers Per|Shared Memory Config|Grid Size|Block Size" "$rep.txt" | head -60
done
